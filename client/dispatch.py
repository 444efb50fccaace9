"""The one place that decides which path carries a rank's all-reduce.

The daemon's dispatch table (nodecomm/thresholds.py) maps sizes to paths; the Dispatcher turns a
call into a path: the path the caller forced, or the table's for its size, now and then the
neighbouring lossless path instead (so the daemon gets timings on both sides of a boundary), and
never a path the stream cannot run (the service path under graph capture), and the form the path
takes at that size (oneshot pushes or pulls on CUDA, as the native group says), and the wire the
payload crosses as: lossless unless the call asks for a compressed one or the group asked and the
table gives the size one (a group that did not ask never gets one). It also owns the
table: every rank switches to a newer one only when all agree on it. Every rank makes the same
calls in the same order, so every rank's Dispatcher decides the same; it needs no group to test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from nodecomm.errors import InvalidArgumentError
from nodecomm.thresholds import DispatchTable, Path, Wire

# Paths that give the same bits, so exploring between them changes no result.
LOSSLESS = frozenset({Path.ONESHOT, Path.TWOSHOT, Path.DMA})


def one_form(path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
    """The form of a transport whose paths have one each."""
    return ""


@dataclass(frozen=True)
class Decision:
    path: Path
    explored: bool  # the table's neighbour, not its choice: time it for the daemon
    wire: Wire = Wire.LOSSLESS
    nbytes: int = 0
    form_of: Callable[[Path, int, Wire], str] = field(default=one_form, repr=False, compare=False)

    @property
    def form(self) -> str:
        """How the path moves this size ("push" or "pull" for CUDA oneshot): asked of the
        transport only when someone reads it, not on every call."""
        return self.form_of(self.path, self.nbytes, self.wire)


class Dispatcher:
    """Decides every all-reduce of one rank. `paths`: what the rank runs (service included);
    `kind`: "cpu" or "cuda", for messages; `form_of(path, nbytes, wire)`: the transport's form of
    a path at a size; `wire_paths`: the paths on which it runs compressed wires; every
    `explore_period`-th call explores, after every `switch_period`-th one the ranks agree on the
    newest table (0: never)."""

    def __init__(
        self,
        table: DispatchTable,
        paths: frozenset[Path],
        kind: str,
        *,
        form_of: Callable[[Path, int, Wire], str] = one_form,
        wire_paths: frozenset[Path] = frozenset(),
        explore_period: int = 0,
        switch_period: int = 0,
    ):
        self.table = table
        self.paths = paths
        self._kind = kind
        self._form_of = form_of
        self._wire_paths = wire_paths
        self._explore_period = explore_period
        self._switch_period = switch_period
        self.calls = 0  # all-reduce calls decided: the same count on every rank

    def decide(self, nbytes: int, *, forced: str | None, capturing: bool, wire: str | None = None) -> Decision:
        """The path and wire of the next all-reduce of `nbytes`: the path forced to `forced` and the
        wire to `wire` unless None; counts the call. InvalidArgumentError where the rank cannot run
        the path or carry the wire on it."""
        self.calls += 1
        explore = bool(self._explore_period) and self.calls % self._explore_period == 0 and not capturing
        wanted = self.table.wire_for(nbytes) if wire is None else self._parsed_wire(wire)
        if explore and wire is None and forced is None:
            # Across compressed_min_bytes the same path on the other wire (both within the group's opt-in).
            other, path = self.table.wire_neighbour(nbytes), self.table.path_for(nbytes)
            if other is not None and path in self._wire_paths and path in self.paths:
                return Decision(path, True, other, nbytes, self._form_of)
        # A compressed call is not explored onto another path: path moves compare lossless timings.
        decision = self._path(nbytes, forced, capturing, explore and wanted is Wire.LOSSLESS)
        if wanted is Wire.LOSSLESS:
            return decision
        path = decision.path
        if path not in self._wire_paths:
            if wire is None:  # the table's wire on a path this rank carries losslessly only
                return decision
            carriers = ", ".join(sorted(p.value for p in self._wire_paths)) or "no path"
            raise InvalidArgumentError(
                f"wire {wanted.value!r} on the {path.value} path: a {self._kind.upper()} group carries compressed "
                f"wires on {carriers}"
            )
        return dataclasses.replace(decision, wire=wanted)

    @staticmethod
    def _parsed_wire(name: str) -> Wire:
        try:
            return Wire.parse(name)
        except (ValueError, AttributeError):
            raise InvalidArgumentError(f"wire {name!r}: expected one of lossless, int8, fp8") from None

    def _path(self, nbytes: int, forced: str | None, capturing: bool, explore: bool) -> Decision:
        if forced is not None:
            path = self.forced_path(forced)
            return Decision(path, False, Wire.LOSSLESS, nbytes, self._form_of)
        chosen = self.table.path_for(nbytes)
        if chosen not in self.paths:
            hint = "; it runs NCCL itself for these sizes (ask accepts() first)" if chosen is Path.NCCL else ""
            raise InvalidArgumentError(
                f"the dispatch table sends {nbytes} bytes to {chosen.value}, which this rank cannot run{hint}"
            )
        if chosen is Path.SERVICE and capturing:
            raise InvalidArgumentError(
                f"the dispatch table sends {nbytes} bytes to the service path (service_min_bytes), which a "
                "CUDA graph cannot capture; pass path= for captured calls, or turn service_min_bytes off"
            )
        if explore and chosen in LOSSLESS:
            # Between lossless paths, so the result's bits are the same.
            neighbour = self.table.neighbour_path(nbytes)
            if neighbour in LOSSLESS and neighbour in self.paths:
                return Decision(neighbour, True, Wire.LOSSLESS, nbytes, self._form_of)
        return Decision(chosen, False, Wire.LOSSLESS, nbytes, self._form_of)

    def form(self, path: str, nbytes: int, wire: str | None = None) -> str:
        """The form `path` takes for an all-reduce of `nbytes` (over `wire`) on this rank, without
        deciding a call."""
        return self._form_of(self.forced_path(path), nbytes, Wire.LOSSLESS if wire is None else self._parsed_wire(wire))

    def accepts(self, nbytes: int) -> bool:
        """Whether the table gives `nbytes` a path this rank runs."""
        return self.table.path_for(nbytes) in self.paths

    def forced_path(self, name: str) -> Path:
        """The path named `name`, which this rank must run."""
        try:
            path = Path.parse(name)
        except ValueError as error:
            raise InvalidArgumentError(str(error)) from None
        if path not in self.paths:
            available = ", ".join(repr(p.value) for p in Path if p in self.paths)
            hint = " (nccl needs connect(..., nccl_group=...))" if path is Path.NCCL else ""
            raise InvalidArgumentError(
                f"path {name!r} is not available to a {self._kind.upper()} group{hint}; expected one of {available}"
            )
        return path

    def switch_due(self, capturing: bool) -> bool:
        """Whether the ranks agree on a table after this call: after every switch_period-th
        all-reduce (after it, so that what accepts() answered before a call is what that call
        dispatched by), and never inside a graph capture."""
        return bool(self._switch_period) and self.calls % self._switch_period == 0 and not capturing

    def agree(self, offered: dict[int, DispatchTable], lowest_of_ranks: Callable[[int], int]) -> int | None:
        """Every rank shares the newest table epoch it was offered; all switch to the lowest of
        them, which every rank holds, so all dispatch the next call by the same table.
        `lowest_of_ranks(epoch)` returns the lowest epoch any rank passed. Returns the epoch
        switched to, or None. Offers up to it are dropped from `offered`."""
        newest = max(offered, default=self.table.epoch)
        agreed = lowest_of_ranks(max(newest, self.table.epoch))
        if agreed <= self.table.epoch:
            return None
        self.table = offered[agreed]
        for epoch in list(offered):  # the lease thread may add offers meanwhile
            if epoch <= agreed:
                offered.pop(epoch, None)
        return agreed
