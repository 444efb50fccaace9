"""The rank's view of the one place that decides which path carries its all-reduce.

The daemon's dispatch table (nodecomm/thresholds.py) maps sizes to paths; native/dispatch.h turns
a call into a path and a wire, on every call without Python (the rule is written there once). The
Dispatcher installs the table the ranks agree on into it, names paths and wires for callers that
force them, and answers what the bench, calibration and accepts() ask. Every rank makes the same
calls in the same order, so every rank decides the same; it needs no group to test.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from nodecomm import _native
from nodecomm.errors import InternalError, InvalidArgumentError
from nodecomm.thresholds import DispatchTable, Path, Wire

# nodecomm.v1 codes, looked up once: the native side takes and returns codes.
PATH_CODES = {path: path.to_proto() for path in Path}
PATHS = {code: path for path, code in PATH_CODES.items()}
WIRE_CODES = {wire: wire.to_proto() for wire in Wire}
WIRES = {code: wire for wire, code in WIRE_CODES.items()}


def one_variant(path: Path, nbytes: int, wire: Wire = Wire.LOSSLESS) -> str:
    """The variant of a transport whose paths have one each."""
    return ""


def path_mask(paths: frozenset[Path]) -> int:
    return sum(1 << PATH_CODES[path] for path in paths)


@dataclass(frozen=True)
class Decision:
    path: Path
    explored: bool  # not the table's choice but a rival's: time it for the daemon
    wire: Wire = Wire.LOSSLESS
    nbytes: int = 0
    variant_of: Callable[[Path, int, Wire], str] = field(default=one_variant, repr=False, compare=False)
    sampled: bool = False  # time this call for the daemon

    @property
    def variant(self) -> str:
        """How the path moves this size ("push" or "pull" for CUDA oneshot): asked of the
        transport only when someone reads it, not on every call."""
        return self.variant_of(self.path, self.nbytes, self.wire)


class Dispatcher:
    """Decides every all-reduce of one rank. `paths`: what the rank runs (service included);
    `kind`: "cpu" or "cuda", for messages; `variant_of(path, nbytes, wire)`: the transport's variant of
    a path at a size; `wire_paths`: the paths on which it runs compressed wires; every
    `sample_period`-th call is timed, after every `switch_period`-th one the ranks agree on the
    newest table (0: never); every `explore_period`-th call of a size bucket explores (0: off;
    native/dispatch.h says how). `native` is the decider itself, for the hot path."""

    def __init__(
        self,
        table: DispatchTable,
        paths: frozenset[Path],
        kind: str,
        *,
        variant_of: Callable[[Path, int, Wire], str] = one_variant,
        wire_paths: frozenset[Path] = frozenset(),
        explore_period: int = 0,
        switch_period: int = 0,
        sample_period: int = 1,
    ):
        self.paths = paths
        self._kind = kind
        self._variant_of = variant_of
        self._codes: dict[tuple[str | None, str | None], tuple[int, int]] = {}
        self.native = _native.Dispatch(
            path_mask(paths), path_mask(wire_paths), kind, explore_period, sample_period, switch_period
        )
        self.table = table

    @property
    def table(self) -> DispatchTable:
        return self._table

    @table.setter
    def table(self, table: DispatchTable) -> None:
        start = next((b.value_bytes for b in table.boundaries if b.name == "compressed_min_bytes"), None)
        self.native.install(
            table.epoch, list(table.range_max), [PATH_CODES[p] for p in table.range_paths],
            [WIRE_CODES[w] for w in table.range_wires], WIRE_CODES[table.wire], -1 if start is None else start,
            list(table.settled),
        )  # fmt: skip
        self._table = table

    @property
    def calls(self) -> int:
        """All-reduce calls decided: the same count on every rank."""
        return self.native.calls

    def codes(self, forced: str | None, wire: str | None) -> tuple[int, int]:
        """The native codes of a call's forced path (0: the table's) and wire (-1: the table's).
        A name refused here counts as a decided call all the same: every rank refuses the same ones."""
        known = self._codes.get((forced, wire))
        if known is not None:
            return known
        try:
            forced_code = 0 if forced is None else PATH_CODES[self.forced_path(forced)]
            codes = forced_code, -1 if wire is None else WIRE_CODES[self._parsed_wire(wire)]
        except InvalidArgumentError:
            self.native.refused()
            raise
        self._codes[(forced, wire)] = codes  # names accepted once: a call that forces one pays a lookup
        return codes

    def decide(self, nbytes: int, *, forced: str | None, capturing: bool, wire: str | None = None) -> Decision:
        """The path and wire of the next all-reduce of `nbytes`: the path forced to `forced` and the
        wire to `wire` unless None; counts the call. InvalidArgumentError where the rank cannot run
        the path or carry the wire on it."""
        forced_code, wire_code = self.codes(forced, wire)
        path, on_wire, explored, sampled = self.native.decide(nbytes, forced_code, wire_code, capturing)
        return Decision(PATHS[path], explored, WIRES[on_wire], nbytes, self._variant_of, sampled)

    @staticmethod
    def _parsed_wire(name: str) -> Wire:
        try:
            return Wire.parse(name)
        except (ValueError, AttributeError):
            raise InvalidArgumentError(f"wire {name!r}: expected one of lossless, int8, fp8") from None

    def variant(self, path: str, nbytes: int, wire: str | None = None) -> str:
        """The variant `path` takes for an all-reduce of `nbytes` (over `wire`) on this rank, without
        deciding a call."""
        return self._variant_of(
            self.forced_path(path), nbytes, Wire.LOSSLESS if wire is None else self._parsed_wire(wire)
        )

    def accepts(self, nbytes: int) -> bool:
        """Whether the table gives `nbytes` a path this rank runs."""
        return self.native.accepts(nbytes)

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
        return self.native.switch_due(capturing)

    def agree(
        self,
        offered: dict[int, DispatchTable],
        lowest_of_ranks: Callable[[int], int],
        withheld: Collection[int] = (),
    ) -> int | None:
        """Every rank offers the newest table epoch it holds; all switch to the lowest epoch
        offered, which every rank holds, so all dispatch the next call by the same table.
        `lowest_of_ranks(epoch)` offers `epoch` and returns the lowest epoch the ranks agreed on
        (Communicator._agree_on_table: the lowest of the previous switch point's offers). Epochs in
        `withheld` are not offered (a lost daemon's: a peer may never have received them), though
        the ranks may still agree on one all offered before. Returns the epoch switched to, or
        None. Offers up to it are dropped from `offered`; InternalError if the ranks agreed on an
        epoch this rank does not hold."""
        newest = max((epoch for epoch in list(offered) if epoch not in withheld), default=self.table.epoch)
        agreed = lowest_of_ranks(max(newest, self.table.epoch))
        if agreed <= self.table.epoch:
            return None
        table = offered.get(agreed)
        if table is None:
            raise InternalError(
                f"the ranks agreed on dispatch table epoch {agreed}, which this rank never received (it holds "
                f"{sorted(offered) or 'none newer than ' + str(self.table.epoch)}); it stays on epoch {self.table.epoch}"
            )
        self.table = table
        for epoch in list(offered):  # the session thread may add offers meanwhile
            if epoch <= agreed:
                offered.pop(epoch, None)
        return agreed
