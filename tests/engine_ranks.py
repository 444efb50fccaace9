"""Rank programs that drive NodecommAllreduce the way vLLM and SGLang do, through the engine
stand-ins in tests/engine_standins (real plugin entry points, real daemon, real process groups)."""

from __future__ import annotations

import gc
import os
import pkgutil
import sys
import weakref
from importlib.metadata import entry_points
from pathlib import Path

import torch
import torch.distributed as dist

STANDINS = str(Path(__file__).parent / "engine_standins")
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def rank_input(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 31 + rank)
    return (torch.randn(count, generator=generator) * (1.0 + rank / 5.0)).to(dtype)


def reference(world_size: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """fp32 in rank order, rounded once: what nodecomm returns."""
    total = rank_input(0, count, dtype, seed).float()
    for rank in range(1, world_size):
        total += rank_input(rank, count, dtype, seed).float()
    return total.to(dtype)


def wrong(got: torch.Tensor, world_size: int, count: int, dtype: torch.dtype, exact: bool) -> bool:
    """Whether `got` is not the sum of rank_input(..., seed=count): its bits where nodecomm served
    it (`exact`), else within the tolerance of an engine's NCCL."""
    want = reference(world_size, count, dtype, count)
    if exact:
        return not torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
    return not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def engine_communicator(rank: int, world_size: int, socket: str, port: int, engine: str, device_kind: str):
    """The engine's device communicator for its tensor-parallel group, built as the engine builds
    it (plugins loaded first): (communicator, the custom all-reduce object in its slot, device)."""
    os.environ.update(NODECOMM_SOCKET=socket, NODECOMM_CUSTOM_ALLREDUCE="1")
    if engine == "vllm-platform":  # nodecomm's platform and its communicator, no slot
        os.environ.update(NODECOMM_CUSTOM_ALLREDUCE="0", NODECOMM_VLLM_PLATFORM="1")
    sys.path.insert(0, STANDINS)
    cuda = device_kind == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    cpu_group = dist.new_group(backend="gloo")
    # The engine's own NCCL takes what the class declines; NCCL refuses ranks that share a GPU,
    # so where they do, gloo (which reduces CUDA tensors through the host) stands in for it.
    shared_gpu = cuda and torch.cuda.device_count() < world_size
    device_group = dist.new_group(backend="gloo" if shared_gpu or not cuda else "nccl") if cuda else cpu_group
    if engine.startswith("vllm"):
        for plugin in entry_points(group="vllm.general_plugins"):  # what vLLM's plugin loader does
            plugin.load()()
    else:
        from sglang.srt.plugins import load_plugins  # runs the plugins, then applies their hooks

        load_plugins()
    if engine == "vllm-platform":
        # vLLM takes the one out-of-tree platform that answers, and builds the communicator it names.
        answers = [plugin.load()() for plugin in entry_points(group="vllm.platform_plugins")]
        (platform,) = [pkgutil.resolve_name(name) for name in answers if name]
        communicator = pkgutil.resolve_name(platform.get_device_communicator_cls())(cpu_group, device, device_group)
        ca_comm = communicator.nodecomm
    elif engine == "vllm":
        from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

        communicator = CudaCommunicator(cpu_group, device, device_group)
        ca_comm = communicator.ca_comm
    else:
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        communicator = GroupCoordinator(cpu_group, device_group, device)
        ca_comm = communicator.ca_comm
    return communicator, ca_comm, device


def engine_sequence(
    rank: int, world_size: int, socket: str, port: int, engine: str, device_kind: str, counts: list[int]
) -> dict:
    """Construction, a profile run, graph capture with its warm-up, replay, eager calls, teardown,
    in the engine's order. Returns which sizes the class took and every mismatch."""
    communicator, ca_comm, device = engine_communicator(rank, world_size, socket, port, engine, device_kind)
    cuda = device.type == "cuda"
    outcome: dict = {"class": type(ca_comm).__name__, "disabled": ca_comm.disabled, "taken": {}, "problems": []}
    # The engine's two calls per all-reduce, as the object answers them: native (Communicator.engine_slot).
    outcome["native calls"] = sorted(
        name for name in ("should_custom_ar", "custom_all_reduce")
        if type(getattr(getattr(ca_comm, name), "__self__", None)).__name__ == "EngineSlot"
    )  # fmt: skip
    problems = outcome["problems"]
    dtype = torch.bfloat16

    def check(label: str, count: int, got: torch.Tensor, seed: int) -> None:
        want = reference(world_size, count, dtype, seed).to(device)
        taken = outcome["taken"][count]
        if taken and not torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype])):
            problems.append(f"{label} {count}: not the bits of the fp32 rank-order sum")
        elif not taken and not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            problems.append(f"{label} {count}: the engine's NCCL result is wrong")

    # Profile run: eager calls of every size.
    for count in counts:
        x = rank_input(rank, count, dtype, count).to(device)
        outcome["taken"][count] = ca_comm.should_custom_ar(x)
        check("profile", count, communicator.all_reduce(x), count)

    # Graph capture: warm-up calls inside capture() communicate for real, then the capture.
    stream = torch.cuda.Stream() if cuda else None
    static = {count: rank_input(rank, count, dtype, count).to(device) for count in counts if outcome["taken"][count]}
    graph, captured = None, {}
    with communicator.graph_capture(stream):
        outcome["capturing_inside"] = ca_comm._IS_CAPTURING
        for count, x in static.items():
            check("warm-up", count, communicator.all_reduce(x), count)
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for count, x in static.items():
                    captured[count] = communicator.all_reduce(x)
    outcome["capturing_after"] = ca_comm._IS_CAPTURING

    # Replay with new inputs in the captured tensors.
    if graph is not None:
        for replay in range(3):
            for count, x in static.items():
                x.copy_(rank_input(rank, count, dtype, 1000 * replay + count))
            graph.replay()
            torch.cuda.synchronize()
            for count in static:
                check(f"replay {replay}", count, captured[count], 1000 * replay + count)

    # Eager calls after capture.
    for count in counts:
        check("eager", count, communicator.all_reduce(rank_input(rank, count, dtype, 7 * count).to(device)), 7 * count)

    # Teardown as the engine does it; the object must leave its nodecomm group when dropped.
    held = weakref.ref(ca_comm)
    del ca_comm, graph, captured
    communicator.destroy()
    gc.collect()
    outcome["released"] = held() is None
    if dist.is_initialized():
        dist.destroy_process_group()
    return outcome


def construct_slot(rank: int, world_size: int, socket: str, port: int) -> dict:
    """Build the slot over a gloo group as the engines do, rank 1 pointed at a socket where no
    daemon serves; what each rank's object says afterwards."""
    from nodecomm.integrations import NodecommAllreduce

    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        slot = NodecommAllreduce(
            dist.new_group(backend="gloo"), "cpu", socket=socket if rank == 0 else socket + ".nowhere", timeout=5
        )
        return {
            "disabled": slot.disabled,
            "reason": slot.disabled_reason,
            "taken": slot.should_custom_ar(torch.ones(16)),
            "fully_connected": slot.fully_connected,
            "multicast": slot.mnnvl_lamport_ag_multicast_ptr,
        }
    finally:
        dist.destroy_process_group()


def batch_invariant_rows(rank: int, world_size: int, socket: str, port: int, width: int, device_kind: str) -> dict:
    """With VLLM_BATCH_INVARIANT=1, one row all-reduced inside batches of 1, 7 and 300 rows (at
    different positions, among other rows) through the slot as the engine calls it: whether the
    slot took each batch, and the row's result bits in each, with the fp32 rank-order sum's."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from nodecomm.integrations import NodecommAllreduce

    cuda = device_kind == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    slot = NodecommAllreduce(dist.new_group(backend="gloo"), device, socket=socket)
    dtype = torch.bfloat16
    row = rank_input(rank, width, dtype, 1)
    taken, bits = {}, {}
    for rows, at in ((1, 0), (7, 3), (300, 150)):
        batch = rank_input(rank, rows * width, dtype, 100 + rows).view(rows, width)
        batch[at] = row
        batch = batch.to(device)
        taken[rows] = slot.should_custom_ar(batch)
        summed = slot.custom_all_reduce(batch) if taken[rows] else None
        bits[rows] = None if summed is None else summed[at].cpu().view(BITS[dtype]).tolist()
    want = sum(rank_input(r, width, dtype, 1).float() for r in range(world_size)).to(dtype)
    outcome = {
        "taken": taken,
        "same": len({str(b) for b in bits.values()}) == 1,
        "exact": bits[1] == want.view(BITS[dtype]).tolist(),
    }
    slot.close()
    dist.destroy_process_group()
    return outcome


def vllm_dispatch(rank: int, world_size: int, socket: str, port: int, wheel: str, counts: list[int]) -> dict:
    """vLLM 0.34.0's own CudaCommunicator.all_reduce, compiled from its wheel, run with the slot as
    its custom all-reduce and nothing else built (its other backends None, gloo as the NCCL it ends
    on): which sizes reached the slot, and whether every result is right."""
    import types

    import engine_source

    from nodecomm.integrations import NodecommAllreduce

    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    cpu_group = dist.new_group(backend="gloo")
    slot = NodecommAllreduce(cpu_group, "cpu", socket=socket)
    served = []
    custom_all_reduce = slot.custom_all_reduce
    slot.custom_all_reduce = lambda x: served.append(x.numel()) or custom_all_reduce(x)
    namespace = {
        "torch": torch,
        "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "current_platform": types.SimpleNamespace(is_rocm=lambda: False),
        "should_nccl_symm_mem_allreduce": lambda world_size, input_: False,
    }
    all_reduce = engine_source.method(
        Path(wheel), "vllm/distributed/device_communicators/cuda_communicator.py", "CudaCommunicator", "all_reduce",
        namespace,
    )  # fmt: skip
    communicator = types.SimpleNamespace(
        fi_ar_comm=None, pynccl_comm=None, qr_comm=None, fi_pcie_ipc_ar_comm=None, aiter_ar_comm=None,
        use_aiter_allreduce=False, ca_comm=slot, symm_mem_comm=None, device_group=cpu_group,
    )  # fmt: skip
    problems, dtype = [], torch.bfloat16
    for count in counts:
        got = all_reduce(communicator, rank_input(rank, count, dtype, count))
        if wrong(got, world_size, count, dtype, exact=count in served):
            problems.append(count)
    slot.close()
    dist.destroy_process_group()
    return {"served": served, "problems": problems}


class _Backend:
    """One of vLLM's other all-reduce backends, ready for every size up to `limit` bytes: records
    what reaches it and sums through the engine's device group."""

    disabled = False

    def __init__(self, name: str, limit: float, group: dist.ProcessGroup, served: list) -> None:
        self.name, self.limit, self.group, self.served = name, limit, group, served

    def accepts(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.limit

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.served.append((self.name, x.numel()))
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    should_quick_allreduce = should_use_fi_ar = accepts
    quick_all_reduce = all_reduce = reduce


def vllm_platform_dispatch(rank: int, world_size: int, socket: str, port: int, wheel: str, counts: list[int]) -> dict:
    """nodecomm's platform communicator with vLLM 0.34.0's own CudaCommunicator.all_reduce, compiled
    from its wheel, as its parent; QuickReduce (up to 16 MiB) and FlashInfer (every size) stand
    ready ahead of the custom all-reduce in vLLM's order. Which backend served each size, and
    whether every result is right."""
    import types

    import engine_source

    os.environ["NODECOMM_SOCKET"] = socket
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    cpu_group = dist.new_group(backend="gloo")
    served: list = []

    class CudaCommunicator:  # vLLM's constructor with no backend built; its all_reduce as released
        def __init__(self, cpu_group, device=None, device_group=None, unique_name=""):
            self.cpu_group, self.device, self.device_group = cpu_group, device, device_group
            self.pynccl_comm = self.qr_comm = self.fi_ar_comm = self.fi_pcie_ipc_ar_comm = None
            self.aiter_ar_comm = self.ca_comm = self.symm_mem_comm = None
            self.use_aiter_allreduce = False

        def destroy(self) -> None:
            pass

    CudaCommunicator.all_reduce = engine_source.method(
        Path(wheel), "vllm/distributed/device_communicators/cuda_communicator.py", "CudaCommunicator", "all_reduce",
        {"torch": torch, "envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
         "current_platform": types.SimpleNamespace(is_rocm=lambda: False),
         "should_nccl_symm_mem_allreduce": lambda world_size, input_: False},
    )  # fmt: skip
    for name in ("vllm", "vllm.distributed", "vllm.distributed.device_communicators"):
        sys.modules[name] = types.ModuleType(name)
    module = types.ModuleType("vllm.distributed.device_communicators.cuda_communicator")
    module.CudaCommunicator = CudaCommunicator
    sys.modules[module.__name__] = module
    from nodecomm.integrations.vllm_communicator import NodecommCudaCommunicator

    communicator = NodecommCudaCommunicator(cpu_group, torch.device("cpu"), cpu_group)
    communicator.qr_comm = _Backend("quick", 16 << 20, cpu_group, served)
    communicator.fi_ar_comm = _Backend("flashinfer", float("inf"), cpu_group, served)
    custom_all_reduce = communicator.nodecomm.custom_all_reduce

    def served_by_nodecomm(x: torch.Tensor) -> torch.Tensor | None:  # None: declined, nothing run
        out = custom_all_reduce(x)
        if out is not None:
            served.append(("nodecomm", x.numel()))
        return out

    communicator.nodecomm.custom_all_reduce = served_by_nodecomm
    problems, dtype = [], torch.bfloat16
    for count in counts:
        got = communicator.all_reduce(rank_input(rank, count, dtype, count))
        if wrong(got, world_size, count, dtype, exact=("nodecomm", count) in served):
            problems.append(count)
    # The fused op, as a model calls it with vLLM's group name: nodecomm's kernels up to the slot's
    # limit (nodecomm.rms_norm's bits), vLLM's all-reduce order and torch's norm past it.
    groups = types.ModuleType("vllm.distributed.parallel_state")
    group = types.SimpleNamespace(device_communicator=communicator, all_reduce=communicator.all_reduce)
    groups._groups = {"tp:0": lambda: group}  # vLLM keeps weak references; the group lives here
    sys.modules[groups.__name__] = groups
    from nodecomm.rms_norm import add_rms_norm

    hidden = 4096
    for rows in (1, 7, 1152):
        count = rows * hidden
        x = rank_input(rank, count, dtype, count).view(rows, hidden)
        residual, weight = rank_input(0, count, dtype, 1).view(rows, hidden), rank_input(0, hidden, dtype, 2)
        got = torch.ops.nodecomm.all_reduce_rms_norm(x, residual, weight, 1e-6, "tp:0")
        summed = reference(world_size, count, dtype, count).view(rows, hidden)
        if rows < 1152:
            want = add_rms_norm(summed, residual, weight, 1e-6)
            exact = all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want, strict=True))
            served.append(("fused", rows) if exact else ("fused, wrong bits", rows))
        else:
            residual_out = summed + residual
            normed = torch.nn.functional.rms_norm(residual_out, (hidden,), weight, 1e-6)
            if not (torch.equal(got[1], residual_out) and torch.allclose(got[0], normed)):
                problems.append(("rms_norm", rows))
    communicator.destroy()
    dist.destroy_process_group()
    return {"served": served, "problems": problems}


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it is not one: SGLang's all_reduce sends CPU tensors to its own
    shared-memory all-reduce before any dispatch, so this stands in for a GPU's tensor there."""

    @property
    def is_cpu(self) -> bool:
        return False


SGLANG_ENVIRON = """import os


class _Setting:
    def __init__(self, name):
        self.name = name

    def get(self):
        return os.environ.get(self.name, "")


class envs:
    SGLANG_PLUGINS = _Setting("SGLANG_PLUGINS")
    SGLANG_PLATFORM = _Setting("SGLANG_PLATFORM")
"""


def sglang_fused_norm(rank: int, world_size: int, coordinator) -> dict:
    """The fused all-reduce, residual add and RMSNorm two ways SGLang asks for it: its
    GroupCoordinator.fused_allreduce_rmsnorm (the wheel's), which asks the slot by name, and the
    flashinfer_allreduce_residual_rmsnorm that its RMSNorm calls on CUDA, which nodecomm's hook
    wraps. Which token counts nodecomm served (bits against nodecomm.rms_norm) and which went on to
    FlashInfer's function (the stand-in, which declines)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import flashinfer_comm_fusion

    from nodecomm.rms_norm import add_rms_norm

    parallel_state._TP_GROUP = coordinator  # the engine's attention tensor-parallel group
    hidden, dtype, problems = 4096, torch.bfloat16, []
    asks = {
        "coordinator": lambda x, r, w: coordinator.fused_allreduce_rmsnorm(x, r, w, 1e-6),
        "flashinfer": lambda x, r, w: flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm(
            input_tensor=x, residual=r, weight=w, eps=1e-6, max_token_num=2048, use_attn_tp_group=True
        ),
    }
    for name, ask in asks.items():
        for rows in (1, 7, 1152):  # 1152 rows: 9 MiB, past the slot's max_size
            count = rows * hidden
            x = rank_input(rank, count, dtype, count).view(rows, hidden)
            residual, weight = rank_input(0, count, dtype, 1).view(rows, hidden), rank_input(0, hidden, dtype, 2)
            got = ask(x, residual, weight)
            if rows == 1152:
                if got is not None and got[0] is not None:
                    problems.append((name, rows, "served past max_size"))
                continue
            want = add_rms_norm(reference(world_size, count, dtype, count).view(rows, hidden), residual, weight, 1e-6)
            if got is None or not all(
                torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want, strict=True)
            ):
                problems.append((name, rows, "differs from nodecomm.rms_norm"))
    return {"flashinfer_asked": flashinfer_comm_fusion.calls, "problems": problems}


def sglang_dispatch(rank: int, world_size: int, socket: str, port: int, wheel: str, counts: list[int]) -> dict:
    """SGLang 0.5.23's own plugin loader and HookRegistry (the wheel's files, over the stand-in
    package) apply nodecomm's REPLACE hook; the slot is built as GroupCoordinator builds it, and
    SGLang's own all-reduce dispatch (GroupCoordinator.all_reduce, the method it resolves, the
    out-of-place and in-place ops, compiled from parallel_state.py) runs each size. Which sizes
    reached the slot, and whether every result is right."""
    import shutil
    import tempfile
    import typing

    import engine_source

    os.environ.update(NODECOMM_SOCKET=socket, NODECOMM_CUSTOM_ALLREDUCE="1")
    root = Path(tempfile.mkdtemp(prefix="sglang-"))
    shutil.copytree(Path(STANDINS) / "sglang", root / "sglang")
    released = Path(wheel)
    engine_source.unpack(released, ["sglang/srt/plugins/__init__.py", "sglang/srt/plugins/hook_registry.py"], root)
    (root / "sglang/srt/environ.py").write_text(SGLANG_ENVIRON)
    sys.path.insert(0, str(root))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    cpu_group = dist.new_group(backend="gloo")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.distributed.device_communicators.custom_all_reduce import dispatch_custom_allreduce

    groups: dict = {}
    namespace = {
        "torch": torch, "_groups": groups, "is_in_tc_piecewise_cuda_graph": lambda: False,
        **{name: getattr(typing, name) for name in ("Any", "Optional", "List", "Tuple", "Union")},
    }  # fmt: skip
    file = "sglang/srt/distributed/parallel_state.py"
    engine_source.functions(released, file, ["inplace_all_reduce", "outplace_all_reduce"], namespace)
    methods = engine_source.functions(
        released, file,
        ["all_reduce", "_resolve_outplace_all_reduce_method", "_can_use_flashinfer_allreduce",
         "_all_reduce_out_place", "_all_reduce_in_place", "fused_allreduce_rmsnorm"],
        namespace, "GroupCoordinator",
    )  # fmt: skip
    coordinator = type("GroupCoordinator", (), methods)()
    coordinator.__dict__.update(
        world_size=world_size, unique_name="tp:0", cpu_group=cpu_group, device_group=cpu_group,
        device=torch.device("cpu"), hpu_communicator=None, xpu_communicator=None, pymscclpp_comm=None,
        pynccl_comm=None, qr_comm=None, torch_symm_mem_comm=None, pcie_ipc_comm=None, _fi_workspace_hint=None,
        is_symmetric_memory_enabled=lambda: False,
    )  # fmt: skip
    ca_class = dispatch_custom_allreduce(group=cpu_group, device=coordinator.device)
    coordinator.ca_comm = slot = ca_class(group=cpu_group, device=coordinator.device)
    groups[coordinator.unique_name] = weakref.ref(coordinator)
    # The slot gets plain tensors again: nodecomm's CPU group asks is_cpu of what it is given.
    served, should_custom_ar, custom_all_reduce = [], slot.should_custom_ar, slot.custom_all_reduce
    slot.should_custom_ar = lambda x: should_custom_ar(x.as_subclass(torch.Tensor))
    slot.custom_all_reduce = lambda x: served.append(x.numel()) or custom_all_reduce(x.as_subclass(torch.Tensor))
    problems, dtype = [], torch.bfloat16
    for count in counts:
        got = coordinator.all_reduce(rank_input(rank, count, dtype, count).as_subclass(_OnDevice))
        got = got.as_subclass(torch.Tensor)
        if wrong(got, world_size, count, dtype, exact=count in served):
            problems.append(count)
    outcome = {"class": type(slot).__name__, "served": served, "problems": problems}
    outcome["norm"] = sglang_fused_norm(rank, world_size, coordinator)
    slot.close()
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    return outcome
