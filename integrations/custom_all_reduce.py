"""NodecommAllreduce: nodecomm in the custom all-reduce slot of vLLM and SGLang.

Both engines build one object per tensor-parallel group from the group's CPU (gloo) process group
and the rank's device, enter its capture() while they capture CUDA graphs, and per all-reduce ask
should_custom_ar(x) and then custom_all_reduce(x); the sizes it declines go to the engine's own
NCCL. This class answers with nodecomm's dispatch table: it declines what the table gives NCCL
(the group is joined with nccl_by_caller, so the table keeps its NCCL ranges) and runs the rest
through nodecomm on the current stream. Nothing needs registering for a captured graph (the
buffers are the group's, mapped once), so capture() marks the capture and probes sizes for it
(Communicator.capture()), and warm-up calls inside it communicate for real: their results are
right, not placeholders.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from . import engine_group

log = logging.getLogger("nodecomm.integrations")

DEFAULT_MAX_SIZE = 8 << 20  # vLLM's default for its own custom all-reduce


def deterministic_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the engine runs batch-invariant: vLLM's VLLM_BATCH_INVARIANT (an integer), SGLang's
    SGLANG_USE_1STAGE_ALLREDUCE where set, else SGLANG_ENABLE_DETERMINISTIC_INFERENCE (booleans),
    read as the engines read them."""
    try:
        if int(environ.get("VLLM_BATCH_INVARIANT", "0") or "0"):
            return True
    except ValueError:
        pass
    for name in ("SGLANG_USE_1STAGE_ALLREDUCE", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE"):
        if name in environ:
            return environ[name].strip().lower() in ("1", "true", "yes", "y", "on")
    return False


def _device_of(device: int | str | torch.device) -> torch.device:
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class NodecommAllreduce:
    """The surface vLLM's CudaCommunicator and SGLang's GroupCoordinator call on a custom all-reduce.

    group: the engine's CPU (gloo) group for the tensor-parallel ranks; the ranks agree on a
    nodecomm group name over it (collective: every rank constructs together). device: the rank's
    GPU ("cpu" works too, over host shared memory, which is how CI drives this class).
    max_size: the largest all-reduce taken, in bytes. table_switching: True lets the group switch
    to the tables live recalibration makes (agreed on the group's control page every 256th call,
    with no wait for the GPU) and explore; off by default, so the table the group formed with
    stays and no call leaves it. symm_mem_enabled and register_graph_buffers are vLLM's
    arguments: accepted, and they change nothing here.

    Construction never raises into the engine: a group that spans nodes, a daemon that cannot be
    reached, or any other failure leaves the object disabled (every size goes to the engine's
    own all-reduce), with the reason in `disabled_reason` and one warning in the log, as the
    engines' own classes do when their transport cannot run. The ranks agree on it over the CPU
    group: where one rank is disabled all are, since ranks that answer should_custom_ar
    differently would wait for each other forever.

    Batch-invariant engines (deterministic_requested(), or deterministic=True) get every size, on
    nodecomm's lossless paths and never NCCL: each element of the result is the fp32 sum of the
    ranks' elements in rank order, rounded once, whatever the batch it came in and whatever path
    its size took, so a row gives the same bits in a batch of 1 and of 300.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: int | str | torch.device,
        max_size: int = DEFAULT_MAX_SIZE,
        *,
        symm_mem_enabled: bool = False,
        register_graph_buffers: bool = True,
        table_switching: bool = False,
        socket: str | None = None,
        timeout: float = 60.0,
        thresholds: Mapping[str, str | int | None] | None = None,
        deterministic: bool | None = None,
    ):
        del symm_mem_enabled, register_graph_buffers  # nothing to size or register
        self.group = group
        self.device = _device_of(device)
        self.deterministic = deterministic_requested() if deterministic is None else deterministic
        self.max_size = None if self.deterministic else max_size
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.disabled = True
        self.disabled_reason = ""
        self.comm = None
        self.fully_connected = False  # vLLM's name: NVLink between every pair of the group's GPUs
        self._IS_CAPTURING = False  # noqa: N815 (the engines' attribute name)
        if self.world_size == 1:
            self.disabled_reason = "a group of one rank has nothing to reduce"
            return

        def usable(comm) -> str:
            return "" if comm.thresholds().paths() & comm.paths else "the dispatch table gives every size to NCCL"

        joined = engine_group.join(
            group, self.device, "engine-ar", usable, socket=socket, timeout=timeout,
            nccl_by_caller=self.device.type == "cuda" and not self.deterministic, thresholds=thresholds,
            table_switching=table_switching,
        )  # fmt: skip
        if joined.comm is None:
            self.disabled_reason = joined.disabled_reason
            log.warning(
                f"nodecomm custom all-reduce disabled; the engine's own all-reduce takes every size: "
                f"{self.disabled_reason}",
                extra={"rank": self.rank, "reason": self.disabled_reason},
            )
            return
        self.comm = joined.comm
        try:
            self.fully_connected = engine_group.nvlink_between(joined.gpu_uuids)
        except Exception:  # noqa: BLE001 (links unknown: not NVLink; construction never raises into the engine)
            self.fully_connected = False
        self.disabled = False
        # The engines' two calls per all-reduce, native on this object (the methods below are what
        # they do, and what a closed slot answers).
        calls = self.comm.engine_slot(max_bytes=self.max_size)
        self.should_custom_ar, self.custom_all_reduce = calls.should_custom_ar, calls.custom_all_reduce

    # Attributes the engines read.
    @property
    def full_nvlink(self) -> bool:
        """SGLang's name for fully_connected."""
        return self.fully_connected

    # DeepSeek-V4.1 in vLLM reads it while the model is built: no multicast buffer here.
    mnnvl_lamport_ag_multicast_ptr = 0

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether this class takes `inp`: not disabled, at most max_size bytes (any size when
        deterministic), and a size the dispatch table gives a nodecomm path (not NCCL) for a
        dtype and device the group has."""
        return not self.disabled and self.comm.accepts(inp, max_bytes=self.max_size)

    def all_reduce(
        self, inp: torch.Tensor, *, out: torch.Tensor | None = None, registered: bool = False
    ) -> torch.Tensor:
        """Out-of-place sum on the current stream (capturable). `registered` is accepted and
        unused: every input is staged through the group's own buffers."""
        del registered
        return self.comm.all_reduce(inp, out=out)

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:  # noqa: A002 (the engines' name)
        """The sum of `input` across the group, or None where should_custom_ar declines it (one
        native call: Communicator.slot_all_reduce)."""
        return None if self.disabled else self.comm.slot_all_reduce(input, max_bytes=self.max_size)

    def fused_allreduce_rmsnorm(
        self, input_: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """SGLang's name (GroupCoordinator.fused_allreduce_rmsnorm asks the slot for it): (normed,
        residual_out) of all_reduce_rms_norm, new tensors on the current stream (capturable), with
        the bits nodecomm.rms_norm states; None where should_custom_ar declines the input, and the
        engine runs its own."""
        if not self.should_custom_ar(input_):
            return None
        return self.comm.all_reduce_rms_norm(input_, residual, weight, eps)

    # The other collectives vLLM asks its custom all-reduce for: declined, so its NCCL runs them.
    def custom_all_gather(self, inp: torch.Tensor) -> None:
        return None

    def custom_reduce_scatter(self, inp: torch.Tensor) -> None:
        return None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Entered around an engine's CUDA-graph captures, which run each shape eagerly first: those
        warm-up calls time their size's paths in graphs, and the captured calls take the fastest
        (Communicator.capture()). Nothing to register on exit."""
        self._IS_CAPTURING = True
        try:
            with self.comm.capture() if self.comm is not None else contextlib.nullcontext():
                yield
        finally:
            self._IS_CAPTURING = False

    def register_graph_buffers(self) -> None:
        """Nothing to register: captured calls address the group's buffers, mapped at join."""

    def close(self) -> None:
        """Leave the nodecomm group. Not collective; safe to call twice, and after the engine's
        process groups are gone (SGLang destroys them first)."""
        comm, self.comm = self.comm, None
        self.disabled = True
        for native in ("should_custom_ar", "custom_all_reduce"):
            self.__dict__.pop(native, None)
        if comm is not None:
            comm.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
