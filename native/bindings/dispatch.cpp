// dispatch.cpp — the path decision and the operation counts (../dispatch.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dispatch.h"

#include "bindings.h"

namespace py = pybind11;

namespace nodecomm::bindings {

void bind_dispatch(py::module_& m) {
  namespace d = nodecomm::dispatch;
  py::class_<d::Dispatch>(m, "Dispatch",
                          "Decides one rank's all-reduces by the table installed, and counts what each path "
                          "carried. Paths and wires are nodecomm.v1 codes; path masks are sums of 1 << code.")
      .def(py::init<unsigned, unsigned, std::string, std::uint64_t, std::uint64_t, std::uint64_t>(),
           py::arg("paths"), py::arg("wire_paths"), py::arg("kind"), py::arg("explore_period"),
           py::arg("sample_period"), py::arg("switch_period"))
      .def(
          "install",
          [](d::Dispatch& self, std::uint64_t epoch, std::vector<std::uint64_t> range_max, const std::vector<int>& paths,
             const std::vector<int>& wires, int wire, std::int64_t compressed_min, std::vector<unsigned> settled) {
            self.install(
                d::make_table(epoch, std::move(range_max), paths, wires, wire, compressed_min, std::move(settled)));
          },
          py::arg("epoch"), py::arg("range_max"), py::arg("paths"), py::arg("wires"), py::arg("wire"),
          py::arg("compressed_min"), py::arg("settled") = std::vector<unsigned>{},
          "Dispatch by this table from the next call: ranges' inclusive ends (all but the last), a path per "
          "range, a wire per range (empty: all lossless), the group's wire, compressed_min_bytes (-1: none), and "
          "per size bucket the mask (1 << path) of the paths exploration leaves to its refresh.")
      .def(
          "decide",
          [](d::Dispatch& self, std::uint64_t nbytes, int forced, int wire, bool capturing) {
            const d::Decision decision = self.decide(nbytes, forced, wire, capturing);
            return py::make_tuple(int(decision.path), int(decision.wire), decision.explored, decision.sampled);
          },
          py::arg("nbytes"), py::arg("forced") = 0, py::arg("wire") = -1, py::arg("capturing") = false,
          "(path, wire, explored, sampled) of the next all-reduce of nbytes; forced: a path code (0: the "
          "table's), wire: a wire code (-1: the table's). Counts the call.")
      .def(
          "count",
          [](d::Dispatch& self, int op, int path, int wire, std::uint64_t nbytes, std::uint64_t wire_bytes) {
            self.count(op, path_of(path), wire::wire_of(wire), nbytes, wire_bytes);
          },
          py::arg("op"), py::arg("path"), py::arg("wire"), py::arg("nbytes"), py::arg("wire_bytes"),
          "One call of op (nodecomm.v1.Op) on path over wire, moving nbytes as wire_bytes.")
      .def(
          "record",
          [](d::Dispatch& self, int path, int wire, std::uint64_t nbytes, double seconds) {
            return self.record(path_of(path), wire::wire_of(wire), nbytes, seconds);
          },
          py::arg("path"), py::arg("wire"), py::arg("nbytes"), py::arg("seconds"),
          "One sampled call's time, kept for the session; returns how many are kept (new ones past 4096 are dropped).")
      .def("held", &d::Dispatch::held, "Samples kept and not taken yet.")
      .def("take_samples", &d::Dispatch::take_samples,
           "(path, wire, bytes, seconds) of every sample since the last take.")
      .def("take_counts", &d::Dispatch::take_counts,
           "(op, path, wire, operations, bytes, wire_bytes) of every count since the last take; resets them.")
      .def("undo", &d::Dispatch::undo, "Take the last decided call back from its size bucket's exploration counts.")
      .def("refused", &d::Dispatch::refused, "Count a call refused before decide(), as every rank refuses it.")
      .def("accepts", &d::Dispatch::accepts, py::arg("nbytes"), "Whether the table gives nbytes a path run here.")
      .def("switch_due", &d::Dispatch::switch_due, py::arg("capturing"),
           "Whether the ranks agree on a table after this call.")
      .def("arm_probes", &d::Dispatch::arm_probes, py::arg("armed"),
           "While armed, the first eager call of each size the table gives a lossless path is left to the caller "
           "(lane outcome 6) to probe; arming forgets the sizes probed before.")
      .def("probe_due", &d::Dispatch::probe_due, py::arg("nbytes"), py::arg("forced"), py::arg("wire"),
           py::arg("capturing"), "Whether an all-reduce of nbytes is left to the caller to probe first (lane outcome 6).")
      .def(
          "set_probed",
          [](d::Dispatch& self, std::uint64_t nbytes, int path) { self.set_probed(nbytes, path_of(path)); },
          py::arg("nbytes"), py::arg("path"), "The path (a code) that calls of nbytes captured from now on take.")
      .def("take_captured", &d::Dispatch::take_captured,
           "(bytes, path) of every size a table-decided call was captured at, where that changed since the last "
           "take; else empty.")
      .def_property_readonly("calls", &d::Dispatch::calls, "All-reduces decided: the same count on every rank.")
      .def_property_readonly("epoch", [](const d::Dispatch& self) { return self.table().epoch; });
}

}  // namespace nodecomm::bindings
