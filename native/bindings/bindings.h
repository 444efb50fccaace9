// bindings.h — the parts of nodecomm._native, one file per area (module.cpp puts them together).
// Functions take addresses, element counts, dtype codes and ranks as Python ints (no torch types),
// so the daemon loads the module without torch; codes are checked where they enter (../codes.h).
#pragma once

#include <pybind11/pybind11.h>

namespace nodecomm::bindings {

void bind_control(pybind11::module_& m);  // control.cpp
void bind_host(pybind11::module_& m);     // host.cpp
void bind_dispatch(pybind11::module_& m); // dispatch.cpp
void bind_capabilities(pybind11::module_& m);  // capabilities.cpp: after bind_host, which registers Path

#ifdef NODECOMM_WITH_CUDA
void bind_cuda_memory(pybind11::module_& m);   // cuda_memory.cpp
void bind_cuda_group(pybind11::module_& m);    // cuda_group.cpp
void bind_cuda_service(pybind11::module_& m);  // cuda_service.cpp
#endif

}  // namespace nodecomm::bindings
