"""NodecommAllreduce: nodecomm in the custom all-reduce slot of vLLM and SGLang.

Both engines build one object per tensor-parallel group from the group's CPU (gloo) process group
and the rank's device, enter its capture() while they capture CUDA graphs, and per all-reduce ask
should_custom_ar(x) and then custom_all_reduce(x); the sizes it declines go to the engine's own
NCCL. This class answers with nodecomm's dispatch table: it declines what the table gives NCCL
(the group is joined with nccl_by_caller, so the table keeps its NCCL ranges) and runs the rest
through nodecomm on the current stream. Nothing needs registering for a captured graph (the
buffers are the group's, mapped once), so capture() only marks the capture, and warm-up calls
inside it communicate for real: their results are right, not placeholders.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from nodecomm.errors import NodecommError

log = logging.getLogger("nodecomm.integrations")

DEFAULT_MAX_SIZE = 8 << 20  # vLLM's default for its own custom all-reduce


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
    max_size: the largest all-reduce taken, in bytes. table_switching: False keeps the dispatch
    table the group formed with, so no eager call ever does the host all-gather that switches to
    a live table. symm_mem_enabled and register_graph_buffers are vLLM's arguments: accepted, and
    they change nothing here. A daemon that cannot be reached leaves the object disabled (every
    size goes to NCCL), with the reason in `disabled_reason` and the log, as the engines' own
    classes do when their transport cannot run.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: int | str | torch.device,
        max_size: int = DEFAULT_MAX_SIZE,
        *,
        symm_mem_enabled: bool = False,
        register_graph_buffers: bool = True,
        table_switching: bool = True,
        socket: str | None = None,
        timeout: float = 60.0,
        thresholds: Mapping[str, str | int | None] | None = None,
    ):
        del symm_mem_enabled, register_graph_buffers  # nothing to size or register
        self.group = group
        self.device = _device_of(device)
        self.max_size = max_size
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.disabled = True
        self.disabled_reason = ""
        self.comm = None
        self._IS_CAPTURING = False  # noqa: N815 (the engines' attribute name)
        if self.world_size == 1:
            self.disabled_reason = "a group of one rank has nothing to reduce"
            return
        # Every rank learns rank 0's token (a fresh name per engine) and group key (which admits
        # this engine's ranks, and no other process, to the group) over the engine's CPU group.
        shared = [(secrets.token_hex(6), secrets.token_hex(16)) if self.rank == 0 else None]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        token, group_key = shared[0]
        import nodecomm

        try:
            self.comm = nodecomm.connect(
                f"engine-ar.{token}",
                self.rank,
                self.world_size,
                device="cpu" if self.device.type == "cpu" else f"cuda:{self.device.index}",
                socket=socket,
                timeout=timeout,
                nccl_by_caller=self.device.type == "cuda",
                thresholds=thresholds,
                table_switching=table_switching,
                group_key=group_key,
            )
        except NodecommError as error:
            self.disabled_reason = str(error)
            log.warning("nodecomm custom all-reduce disabled; NCCL takes every size", extra={"reason": str(error)})
            return
        if not self.comm.thresholds().paths() & self.comm.paths:
            self.disabled_reason = "the dispatch table gives every size to NCCL"
            return
        self.disabled = False

    # Attributes the engines read.
    @property
    def fully_connected(self) -> bool:
        """vLLM's name: whether every rank reaches every peer's memory (the group's peer check passed)."""
        return not self.disabled

    full_nvlink = fully_connected  # SGLang's name for the same

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether this class takes `inp`: not disabled, at most max_size bytes, and a size the
        dispatch table gives a nodecomm path (not NCCL) for a dtype and device the group has."""
        if self.disabled or inp.numel() * inp.element_size() > self.max_size:
            return False
        return self.comm.accepts(inp)

    def all_reduce(
        self, inp: torch.Tensor, *, out: torch.Tensor | None = None, registered: bool = False
    ) -> torch.Tensor:
        """Out-of-place sum on the current stream (capturable). `registered` is accepted and
        unused: every input is staged through the group's own buffers."""
        del registered
        return self.comm.all_reduce(inp, out=out)

    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:  # noqa: A002 (the engines' name)
        """The sum of `input` across the group, or None where should_custom_ar declines it."""
        if not self.should_custom_ar(input):
            return None
        return self.comm.all_reduce(input)

    # The other collectives vLLM asks its custom all-reduce for: declined, so its NCCL runs them.
    def custom_all_gather(self, inp: torch.Tensor) -> None:
        return None

    def custom_reduce_scatter(self, inp: torch.Tensor) -> None:
        return None

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Entered around an engine's CUDA-graph capture. Nothing to register on exit."""
        self._IS_CAPTURING = True
        try:
            yield
        finally:
            self._IS_CAPTURING = False

    def register_graph_buffers(self) -> None:
        """Nothing to register: captured calls address the group's buffers, mapped at join."""

    def finalize_p2p(self) -> None:
        """vLLM's deferred peer check: nodecomm checked peer memory when the group formed."""

    def close(self) -> None:
        """Leave the nodecomm group. Not collective; safe to call twice, and after the engine's
        process groups are gone (SGLang destroys them first)."""
        comm, self.comm = self.comm, None
        self.disabled = True
        if comm is not None:
            comm.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
