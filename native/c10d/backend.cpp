// backend.cpp — nodecomm as a C++ torch.distributed backend (c10d::Backend): module nodecomm._c10d.
//
// torch holds one Backend per device type it was named for ("nodecomm", "cpu:gloo,cuda:nodecomm").
// An all-reduce SUM of one contiguous float32/float16/bfloat16 tensor runs through the rank's lane
// with no Python (../lane_api.h: HostLane on the CPU; CudaLane on the tensor's current stream,
// synchronous or not, an asynchronous one returning a StreamWork): checks, path decision,
// collective, sample, count (the engine's NCCL group's calls too: nccl_runner.h). Every other operation
// goes to the Python process group this backend composes (nodecomm.distributed.process_group), by
// its Python name, and comes back as that group's Work.
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../lane_api.h"
#include "nccl_runner.h"
#include "tensor_call.h"

namespace py = pybind11;

namespace nodecomm::c10d_backend {

using ::c10d::OpType;
using ::c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

// Lets go of Python objects from C++ destructors: under the GIL, or, once the interpreter has
// finalized (a backend torch's registries free at exit), by leaking them.
template <typename... Objects>
void drop(Objects&... objects) {
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    ((objects = std::remove_reference_t<Objects>{}), ...);
  } else {
    ((void)objects.release(), ...);
  }
}

// An operation that finished before it was returned: its outputs, and a completed future of them,
// made when first asked for (most callers never ask).
class CompletedWork : public Work {
 public:
  CompletedWork(std::vector<at::Tensor> result, OpType type) : Work(-1, type), result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::call_once(made_, [this] {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      future_->markCompleted(c10::IValue(result_));
    });
    return future_;
  }

 private:
  std::vector<at::Tensor> result_;
  std::once_flag made_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Events for StreamWorks, kept for the next Work once one is dropped (as ProcessGroupNCCL's event
// cache): a CUDA event made and destroyed per call costs more than recording it.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(c10::DeviceType type) : type_(type) {}

  std::shared_ptr<c10::Event> take() {
    std::unique_ptr<c10::Event> event;
    {
      std::lock_guard<std::mutex> hold(lock_);
      if (!free_.empty()) {
        event = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!event) event = std::make_unique<c10::Event>(type_);
    std::weak_ptr<EventPool> pool = weak_from_this();
    return std::shared_ptr<c10::Event>(event.release(), [pool](c10::Event* dropped) {
      if (auto alive = pool.lock()) {
        alive->give(dropped);
      } else {
        delete dropped;
      }
    });
  }

 private:
  static constexpr std::size_t kKept = 64;

  void give(c10::Event* event) {
    std::unique_ptr<c10::Event> owned(event);
    std::lock_guard<std::mutex> hold(lock_);
    if (free_.size() < kKept) free_.push_back(std::move(owned));
  }

  c10::DeviceType type_;
  std::mutex lock_;
  std::vector<std::unique_ptr<c10::Event>> free_;
};

// An asynchronous CUDA operation enqueued on `stream`, as ProcessGroupNCCL's Work is seen by its
// callers: an event recorded after it; wait() makes the caller's current stream wait on it (the
// host does not), isCompleted() queries it, and getFuture() is a CUDA-aware future, completed on
// the operation's stream (it records events of its own there), that DDP's comm hooks and then()
// callbacks can chain on. The event and the device guard are reached through c10's
// device-generic interfaces: no CUDA library here.
class StreamWork : public Work {
 public:
  StreamWork(std::vector<at::Tensor> result, OpType type, c10::Stream stream, std::shared_ptr<c10::Event> done)
      : Work(-1, type), result_(std::move(result)), stream_(stream), done_(std::move(done)) {
    done_->record(stream_);
  }
  bool isCompleted() override { return done_->query(); }
  // Enqueued without an error: a kernel that gives up sets the group's abort word, which the next
  // call raises (as ProcessGroupNCCL's Work, this answers for errors, not for completion).
  bool isSuccess() const override { return true; }
  // Both make the caller's current stream wait, as ProcessGroupNCCL's do. With a timeout the host
  // also waits, at most that long, and raises if the operation has not finished by then (as
  // ProcessGroupNCCL's wait(timeout) does); its kernels give up by their own at the group's timeout.
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout != ::kNoTimeout) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!done_->query()) {
        if (std::chrono::steady_clock::now() >= deadline) {
          C10_THROW_ERROR(DistBackendError, "nodecomm: the operation did not finish within wait()'s " +
                                                std::to_string(timeout.count()) + " ms");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    synchronize();
    return true;
  }
  // Most callers wait on the stream they called on, where stream order already holds.
  void synchronize() override {
    const c10::Stream current = c10::impl::VirtualGuardImpl(stream_.device_type()).getStream(stream_.device());
    if (current != stream_) done_->block(current);
  }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::call_once(made_, [this] {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                         std::vector<c10::Device>{stream_.device()});
      // The future records its events on the current stream: make that the operation's.
      const c10::impl::VirtualGuardImpl guard(stream_.device_type());
      const c10::Stream previous = guard.exchangeStream(stream_);
      future_->markCompleted(c10::IValue(result_));
      guard.exchangeStream(previous);
    });
    return future_;
  }

 private:
  std::vector<at::Tensor> result_;
  c10::Stream stream_;
  std::shared_ptr<c10::Event> done_;  // from the backend's EventPool
  std::once_flag made_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A Work of the Python group (nodecomm.distributed.work.Work), kept alive with its Python object:
// torch's Work trampoline forwards wait() and get_future(); the rest is asked of Python here.
class PythonWork : public Work {
 public:
  // Made under the GIL (Backend::python).
  explicit PythonWork(py::object work)
      : work_(work.cast<WorkPtr>()), on_stream_(work.attr("on_stream").cast<bool>()), object_(std::move(work)) {}
  ~PythonWork() override { drop(object_); }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }
  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return object_.attr("is_completed")().cast<bool>();
  }
  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return object_.attr("is_success")().cast<bool>();
  }
  // The Python Work's error, as the Python exception itself: rethrown to Python, it is that
  // error again (its class and its group and rank).
  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    const py::object error = object_.attr("exception")();
    if (error.is_none()) return nullptr;
    // Restored as it is (PyErr_SetObject would chain an error being handled here as its context).
    PyObject* value = error.ptr();
    Py_INCREF(Py_TYPE(value));
    Py_INCREF(value);
    PyErr_Restore(reinterpret_cast<PyObject*>(Py_TYPE(value)), value, PyException_GetTraceback(value));
    return std::make_exception_ptr(py::error_already_set());
  }
  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    return object_.attr("result")().cast<std::vector<at::Tensor>>();
  }
  void synchronize() override {
    py::gil_scoped_acquire gil;
    object_.attr("synchronize")();
  }
  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return object_.attr("source_rank")().cast<int>();
  }
  // Ordered by a CUDA stream, as a native CUDA all-reduce is: nothing for one to wait behind.
  bool on_stream() const { return on_stream_; }

 private:
  WorkPtr work_;
  bool on_stream_;
  py::object object_;
};

class Backend : public ::c10d::Backend {
 public:
  Backend(py::object composed, int rank, int size, std::chrono::milliseconds timeout)
      : ::c10d::Backend(rank, size), composed_(std::move(composed)), timeout_(timeout) {}

  ~Backend() override {
    for (auto& made : bindings_) drop(made->object, made->communicator);
    drop(composed_);
  }

  const std::string getBackendName() const override { return "nodecomm"; }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>("nodecomm", timeout_);
  }

  py::object composed() const { return composed_; }
  std::size_t outstanding() const { return outstanding_count_.load(std::memory_order_acquire); }
  std::uint64_t lane_calls() const { return lane_calls_.load(std::memory_order_relaxed); }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const ::c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && opts.reduceOp == ::c10d::ReduceOp::SUM) {
      at::Tensor& tensor = tensors[0];
      const Binding* bound = binding_for(tensor, opts.asyncOp);
      if (bound != nullptr) {
        const std::optional<c10::Stream> stream =
            tensor.is_cuda() ? std::optional(c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(tensor.device()))
                             : std::nullopt;
        int kind = 0;
        char message[1024];
        message[0] = '\0';
        const int outcome = bound->api->all_reduce(bound->address, tensor.data_ptr(), tensor.data_ptr(),
                                                  tensor.numel(), dtype_code(tensor), 0, -1,
                                                  stream ? stream->native_handle() : nullptr, &kind, message,
                                                  sizeof message);
        lane_calls_.fetch_add(1, std::memory_order_relaxed);
        if (outcome != lane::kDone) {  // a table switch, the service path or an error: Python's
          py::gil_scoped_acquire gil;
          bound->communicator.attr("native_outcome")(outcome, tensor, kind, std::string(message));
        }
        if (stream && opts.asyncOp) {
          return c10::make_intrusive<StreamWork>(tensors, OpType::ALLREDUCE, *stream, events_->take());
        }
        return c10::make_intrusive<CompletedWork>(tensors, OpType::ALLREDUCE);
      }
    }
    WorkPtr work = collective("allreduce", tensors, opts);
    if (tensors.size() == 1) bind(tensors[0]);
    return work;
  }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const ::c10d::BroadcastOptions& opts) override {
    return collective("broadcast", tensors, opts);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const ::c10d::AllreduceCoalescedOptions& opts) override {
    return collective("allreduce_coalesced", tensors, opts);
  }
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const ::c10d::ReduceOptions& opts) override {
    return collective("reduce", tensors, opts);
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const ::c10d::AllgatherOptions& opts) override {
    return collective("allgather", outputs, inputs, opts);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const ::c10d::AllgatherOptions& opts) override {
    return collective("all_gather_single", output, input, opts);
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                              const ::c10d::AllgatherOptions& opts) override {
    return collective("allgather_coalesced", outputs, inputs, opts);
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const ::c10d::AllgatherOptions& opts) override {
    return collective("all_gather_single_coalesced", outputs, inputs, opts);
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const ::c10d::GatherOptions& opts) override {
    return collective("gather", outputs, inputs, opts);
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const ::c10d::ScatterOptions& opts) override {
    return collective("scatter", outputs, inputs, opts);
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                         const ::c10d::ReduceScatterOptions& opts) override {
    return collective("reduce_scatter", outputs, inputs, opts);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const ::c10d::ReduceScatterOptions& opts) override {
    return collective("reduce_scatter_single", output, input, opts);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const ::c10d::ReduceScatterOptions& opts) override {
    return collective("reduce_scatter_single_coalesced", outputs, inputs, opts);
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const ::c10d::AllToAllOptions& opts) override {
    return collective("all_to_all_single", output, input, output_splits, input_splits, opts);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const ::c10d::AllToAllOptions& opts) override {
    return collective("alltoall", outputs, inputs, opts);
  }
  WorkPtr barrier(const ::c10d::BarrierOptions& opts) override { return collective("barrier", opts); }

  // Sends and receives run on pair lanes of their own, never behind this group's collectives.
  WorkPtr send(std::vector<at::Tensor>& tensors, int destination, int tag) override {
    return python("send", tensors, destination, tag);
  }
  WorkPtr recv(std::vector<at::Tensor>& tensors, int source, int tag) override {
    return python("recv", tensors, source, tag);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return python("recv_anysource", tensors, tag);
  }

  void shutdown() override { unbind_and_call("shutdown"); }
  void abort() override { unbind_and_call("abort"); }

 private:
  // A collective of the Python group. A CPU one it runs in the background stays outstanding until
  // it completes: no native all-reduce may overtake it (the ranks' calls must stay in one order).
  // It is issued under the list's lock, so that the list keeps the worker's order when threads
  // call at once: the worker runs them in that order, so the finished ones leave from the front,
  // and the newest done means all are. Past kMaxOutstanding running, the caller waits for the
  // oldest. Stream-ordered (CUDA) Works are never kept. Works that leave are dropped after the
  // lock is (dropping one runs Python, which may call in here).
  template <typename... Args>
  WorkPtr collective(const char* name, Args&&... args) {
    std::vector<WorkPtr> finished;
    const std::unique_lock<std::recursive_mutex> hold = hold_outstanding();
    auto work = c10::static_intrusive_pointer_cast<PythonWork>(python(name, std::forward<Args>(args)...));
    while (!outstanding_.empty() && outstanding_.front()->isCompleted()) leave_front(finished);
    if (!work->isCompleted() && !work->on_stream()) {
      if (outstanding_.size() >= kMaxOutstanding) {
        try {
          outstanding_.front()->wait(timeout_);
        } catch (...) {
          // Its error stays with its Work, for whoever waits on it.
        }
        leave_front(finished);
      }
      outstanding_.push_back(work);
    }
    outstanding_count_.store(outstanding_.size(), std::memory_order_release);
    return work;
  }

  void leave_front(std::vector<WorkPtr>& finished) {
    finished.push_back(std::move(outstanding_.front()));
    outstanding_.pop_front();
  }

  // Whether no CPU collective of the Python group is still running (forgetting those that ended).
  bool drained() {
    if (outstanding_count_.load(std::memory_order_acquire) == 0) return true;
    std::deque<WorkPtr> finished;
    const std::unique_lock<std::recursive_mutex> hold = hold_outstanding();
    if (!outstanding_.empty() && !outstanding_.back()->isCompleted()) return false;
    finished.swap(outstanding_);
    outstanding_count_.store(0, std::memory_order_release);
    return true;
  }

  // The list's lock, for a caller that may hold the GIL: taken without it, since its holder calls
  // Python (issuing a collective, a Work's isCompleted()), which needs the GIL; the GIL alone
  // would not do, as Python code lets other threads run between its bytecodes. Recursive: Python
  // run under it (a signal handler, a finalizer) may call a collective on this thread.
  std::unique_lock<std::recursive_mutex> hold_outstanding() {
    std::unique_lock<std::recursive_mutex> hold(outstanding_lock_, std::defer_lock);
    if (Py_IsInitialized() && PyGILState_Check()) {
      const py::gil_scoped_release unlocked;
      hold.lock();
    } else {
      hold.lock();
    }
    return hold;
  }

  static constexpr std::size_t kMaxOutstanding = 1024;

  template <typename... Args>
  WorkPtr python(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<PythonWork>(composed_.attr(name)(std::forward<Args>(args)...));
  }

  // How this backend reaches a rank's lane (the native all-reduce) for one device type, once the
  // Python group's node group of that type has joined. Published once made and never changed.
  struct Binding {
    const NodecommLaneApi* api = nullptr;
    void* address = nullptr;
    int device = -1;           // the CUDA device index it enqueues on
    py::object object;         // the lane (kept alive here)
    py::object communicator;   // its Communicator, for what the lane leaves to Python
  };

  // The binding whose lane runs this all-reduce natively, or null: the Python group takes it. A CPU call
  // waits for nothing the Python group runs in the background (the ranks' calls keep one order);
  // an asynchronous one is the Python group's, whose worker runs it in the background as gloo's
  // does (the host lane's call returns only once every rank has come). A CUDA one is ordered by
  // its stream.
  const Binding* binding_for(const at::Tensor& tensor, bool asynchronous) {
    if (dtype_code(tensor) == 0 || tensor.layout() != at::kStrided || !tensor.is_contiguous() || tensor.numel() == 0)
      return nullptr;
    if (tensor.is_cpu()) {
      const Binding* bound = asynchronous ? nullptr : cpu_.load(std::memory_order_acquire);
      return bound != nullptr && drained() ? bound : nullptr;
    }
    const Binding* bound = tensor.is_cuda() ? cuda_.load(std::memory_order_acquire) : nullptr;
    return bound != nullptr && bound->device == tensor.device().index() ? bound : nullptr;
  }

  // After a call the Python group ran: bind the lane of the tensor's device type, if joined now.
  void bind(const at::Tensor& tensor) {
    if (!(tensor.is_cpu() || tensor.is_cuda())) return;
    std::atomic<const Binding*>& slot = tensor.is_cpu() ? cpu_ : cuda_;
    if (slot.load(std::memory_order_acquire) != nullptr) return;
    py::gil_scoped_acquire gil;  // bindings are made under the GIL
    bool& none = tensor.is_cpu() ? cpu_none_ : cuda_none_;
    if (slot.load(std::memory_order_relaxed) != nullptr || none) return;
    py::object communicator = composed_.attr("connected_communicator")(tensor.is_cpu() ? "cpu" : "cuda");
    if (communicator.is_none()) return;
    py::object lane = communicator.attr("native_lane")();
    if (lane.is_none()) {
      none = true;
      return;
    }
    auto parts = lane.cast<py::tuple>();
    const NodecommLaneApi* api = lane_api_of(parts[0].cast<py::capsule>());
    py::object device = communicator.attr("device").attr("index");
    bindings_.push_back(std::make_unique<Binding>(Binding{api, reinterpret_cast<void*>(parts[1].cast<std::uintptr_t>()),
                                                          device.is_none() ? -1 : device.cast<int>(), parts[2],
                                                          std::move(communicator)}));
    slot.store(bindings_.back().get(), std::memory_order_release);
  }

  // The lanes close below; a later call takes the Python path, which says so. A call another
  // thread is making on a lane still holds its Binding, which lives as long as this backend.
  void unbind_and_call(const char* name) {
    py::gil_scoped_acquire gil;
    cpu_.store(nullptr, std::memory_order_release);
    cuda_.store(nullptr, std::memory_order_release);
    composed_.attr(name)();
  }

  py::object composed_;
  std::chrono::milliseconds timeout_;
  std::recursive_mutex outstanding_lock_;
  std::deque<WorkPtr> outstanding_;  // the Python group's CPU collectives running, oldest first
  std::atomic<std::size_t> outstanding_count_{0};  // its size, read without the lock
  std::atomic<std::uint64_t> lane_calls_{0};
  std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>(c10::kCUDA);
  // The lanes' bindings, once joined: null before, and after shutdown() or abort(). Every Binding
  // made stays in bindings_ until the backend goes, so that one read here stays valid for the call.
  std::atomic<const Binding*> cpu_{nullptr}, cuda_{nullptr};
  std::vector<std::unique_ptr<Binding>> bindings_;  // under the GIL
  bool cpu_none_ = false, cuda_none_ = false;       // the communicator has no lane (across nodes); under the GIL
};

}  // namespace nodecomm::c10d_backend

PYBIND11_MODULE(_c10d, m) {
  namespace b = nodecomm::c10d_backend;
  m.doc() = "nodecomm's torch.distributed backend (c10d::Backend); import torch first";
  py::class_<b::Backend, ::c10d::Backend, c10::intrusive_ptr<b::Backend>>(m, "Backend")
      .def(py::init([](py::object composed, int rank, int size, std::chrono::milliseconds timeout) {
             return c10::make_intrusive<b::Backend>(std::move(composed), rank, size, timeout);
           }),
           py::arg("composed"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
           "A backend over `composed`, the Python group that runs what this backend does not natively.")
      .def_property_readonly("composed", &b::Backend::composed, "The Python process group composed here.")
      .def_property_readonly("outstanding", &b::Backend::outstanding,
                             "The Python group's CPU collectives still running, which native all-reduces wait "
                             "behind (at most 1024).")
      .def_property_readonly("lane_calls", &b::Backend::lane_calls,
                             "All-reduces handed to the native lane (not to the Python group) so far.");
  py::class_<b::TensorCall>(m, "TensorCall", "Communicator.all_reduce's native call (tensor_call.h).")
      .def(py::init<const py::capsule&, std::uintptr_t, py::object, int, const std::vector<int>&>(), py::arg("api"),
           py::arg("address"), py::arg("lane"), py::arg("device"), py::arg("dtypes"))
      .def("__call__", &b::TensorCall::operator(), py::arg("tensor"), py::arg("out"), py::arg("forced") = 0,
           py::arg("wire") = -1,
           "None: not taken; the output: done; else (outcome, output, error kind, message). forced: a "
           "path code (0: the table's); wire: a wire code (-1: the table's).")
      .def("accepts", &b::TensorCall::accepts, py::arg("tensor"), py::arg("max_bytes") = -1,
           "Whether all_reduce(tensor) runs here (at most max_bytes; -1: any size); None for a tensor subclass.")
      .def("slot", &b::TensorCall::slot, py::arg("tensor"), py::arg("max_bytes") = -1,
           "An engine slot's all-reduce: None (nothing run) where accepts() declines, the output where done, "
           "else as __call__.");
  py::class_<b::NcclRunner>(m, "NcclRunner", "The engine's NCCL group as a CUDA lane's NCCL path (nccl_runner.h).")
      .def(py::init<c10::intrusive_ptr<::c10d::ProcessGroup>, int>(), py::arg("group"), py::arg("device"),
           "Run the lane's NCCL calls through `group` (a torch.distributed ProcessGroup over the lane's ranks) on "
           "CUDA device `device`.")
      .def(
          "api",
          [](const b::NcclRunner& self) {
            return py::capsule(static_cast<const void*>(self.api()), nodecomm::lane::kNcclCapsule);
          },
          "The C ABI (../lane_api.h's NodecommNccl) for CudaLane.set_nccl, which keeps this object alive.");
  py::class_<b::EngineSlot>(m, "EngineSlot", "An engine's custom all-reduce slot's two calls (tensor_call.h).")
      .def(py::init<py::object, py::object, std::int64_t>(), py::arg("call"), py::arg("communicator"),
           py::arg("max_bytes"))
      .def("should_custom_ar", &b::EngineSlot::should_custom_ar, py::arg("tensor"),
           "Whether custom_all_reduce(tensor) runs here (Communicator.accepts at the slot's max_bytes).")
      .def("custom_all_reduce", &b::EngineSlot::custom_all_reduce, py::arg("tensor"),
           "The sum of tensor, or None (nothing run) where should_custom_ar declines it.");
}
