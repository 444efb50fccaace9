// capabilities.cpp — CAPABILITIES: what each device kind this build has runs (../capabilities.h),
// {kind: {"paths", "wire_paths": Path values; "world_sizes", "topk_world_sizes": ints}}.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "capabilities.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {
namespace {

py::dict record(const Capabilities& capabilities) {
  py::dict fields;
  fields["paths"] = py::tuple(py::cast(capabilities.paths));
  fields["wire_paths"] = py::tuple(py::cast(capabilities.wire_paths));
  fields["world_sizes"] = py::tuple(py::cast(capabilities.world_sizes));
  fields["topk_world_sizes"] = py::tuple(py::cast(capabilities.topk_world_sizes));
  return fields;
}

}  // namespace

void bind_capabilities(py::module_& m) {
  py::dict kinds;
  kinds["cpu"] = record(host_capabilities());
#ifdef NODECOMM_WITH_CUDA
  kinds["cuda"] = record(cuda_capabilities());
#endif
  m.attr("CAPABILITIES") = kinds;
}

}  // namespace nodecomm::bindings
