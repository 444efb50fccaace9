"""TableKeeper: the daemon's dispatch tables, one rule for every boundary.

    the group's own override  >  the daemon's override  >  calibrated  >  built-in default

It builds each new group's table, keeps this machine's calibration (probing on request), moves a
group's boundaries when its live timings demand it, and numbers every table it makes with a
fresh epoch. The thresholds metric shows the boundaries a new group would get.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from nodecomm import _native
from nodecomm.byte_size import format_byte_size
from nodecomm.capabilities import DeviceKind
from nodecomm.errors import AlreadyExistsError, InvalidArgumentError, NodecommError, UnsupportedError, shown
from nodecomm.service.calibration.boundaries import calibration_from
from nodecomm.service.calibration.fingerprint import cpu_fingerprint, cuda_fingerprint, fingerprint_key
from nodecomm.service.calibration.live_thresholds import LiveEstimates
from nodecomm.service.calibration.probe import NOISE_RETRIES, Measured, calibration_point, probe
from nodecomm.service.calibration.stored import Calibration, CalibrationStore
from nodecomm.service.config import DEFAULT_BOUNDARIES, DaemonConfig
from nodecomm.service.metrics.families import DaemonMetrics
from nodecomm.thresholds import Boundary, DispatchTable, Path, Source, Wire, build_table
from nodecomm.v1 import control_pb2 as pb

log = logging.getLogger("nodecomm.tables")

# A daemon numbers its tables past those of the group it adopts by a block of epochs: more than one
# daemon's life could offer (a table per group formed or moved), so that no table it makes has the
# epoch of one the daemon before offered and some ranks may hold (client/session.py's withheld).
EPOCH_BLOCK = 1 << 32


def fallback_path(nccl_fallback: bool) -> Path:
    """The path of the sizes no other range takes: NCCL where the ranks passed a group for it."""
    return Path.NCCL if nccl_fallback else Path.TWOSHOT


class TableKeeper:
    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics, max_world_size: int, gpu_count: int = 0):
        self.config = config
        self.metrics = metrics
        self.max_world_size = max_world_size
        self.gpu_count = gpu_count
        # What each device kind's calibration depends on on this machine; CUDA only with GPUs.
        self.fingerprints = {DeviceKind.CPU: cpu_fingerprint()}
        # links[i][j]: (peer access, native atomics, performance rank) of GPU i to GPU j's memory.
        self.links: list[list[tuple]] = _native.cuda_peer_links() if gpu_count else []
        if gpu_count:
            self.fingerprints[DeviceKind.CUDA] = cuda_fingerprint(_native.cuda_devices(), self.links)
        self._epoch = 0
        # Boundaries measured on this machine, per device kind (see service.calibration), for groups
        # whose fallback is twoshot.
        self.calibrated: dict[str, dict[str, int | None]] = {}
        # The calibration in force per device kind, and why the boundaries are what they are (for
        # the log and every table's origin).
        self.calibrations: dict[str, Calibration] = {}
        self.origins: dict[str, str] = {}
        self.nccl_origins: dict[str, str] = {}  # the same for calibrated_nccl, where there is one
        # Where a private daemon keeps its groups' live moves for the user's next one (None: a node
        # daemon, whose groups' timings are each their own user's to make up).
        self.live_store: CalibrationStore | None = None
        # For CUDA groups whose fallback is NCCL: where a probe timed NCCL, or such a group's live
        # timings moved them; else they get the built-in defaults.
        self.calibrated_nccl: dict[str, dict[str, int | None]] = {}
        # compressed_min_bytes per device kind and compressed wire, where the probe timed it.
        self.calibrated_wires: dict[str, dict[str, int | None]] = {}
        self._calibrating = asyncio.Lock()
        self._publish_thresholds()

    def default_boundaries(
        self,
        device_kind: str,
        group_overrides: dict[str, int | None] | None = None,
        nccl: bool = False,
        wire: Wire = Wire.LOSSLESS,
    ) -> dict[str, Boundary]:
        """The boundaries for a new group of `device_kind` (whose fallback is NCCL if `nccl`, and
        which asked for `wire`): the group's own override > the daemon's override > calibrated >
        built-in default. CPU groups have no DMA path, so oneshot_max_bytes and service_min_bytes
        apply to them; compressed_min_bytes is calibrated per wire."""
        # Boundaries placed with twoshot as the fallback say where our paths beat twoshot, not NCCL:
        # an NCCL group takes only those placed (or moved live) with NCCL as its fallback.
        calibrated = (self.calibrated_nccl if nccl else self.calibrated).get(device_kind, {})
        wires = self.calibrated_wires.get(device_kind, {})
        if wire is not Wire.LOSSLESS and wire.value in wires:
            calibrated = {**calibrated, "compressed_min_bytes": wires[wire.value]}
        group_overrides = group_overrides or {}
        boundaries = {}
        for name, default in DEFAULT_BOUNDARIES[device_kind].items():
            if name in group_overrides:
                boundaries[name] = Boundary(name, group_overrides[name], Source.OVERRIDE)
            elif name in self.config.overrides:
                boundaries[name] = Boundary(name, self.config.overrides[name], Source.OVERRIDE)
            elif name in calibrated:
                boundaries[name] = Boundary(name, calibrated[name], Source.CALIBRATED)
            else:
                boundaries[name] = Boundary(name, default, Source.DEFAULT)
        return boundaries

    def _publish_thresholds(self) -> None:
        self.metrics.threshold.clear()
        for kind in DEFAULT_BOUNDARIES:
            for boundary in self.default_boundaries(kind).values():
                if boundary.value_bytes is not None:
                    self.metrics.threshold.labels(kind, boundary.name, boundary.source.value).set(boundary.value_bytes)

    def use_calibration(self, calibration: Calibration, origin: str) -> None:
        """Use `calibration` for new groups; `origin` says where it comes from."""
        kind = str(calibration.fingerprint["device_kind"])
        self.calibrations[kind] = calibration
        self.origins[kind] = origin
        self.calibrated[kind] = dict(calibration.boundaries)
        if calibration.nccl_boundaries is not None:
            self.calibrated_nccl[kind] = dict(calibration.nccl_boundaries)
            self.nccl_origins[kind] = origin
        else:
            self.calibrated_nccl.pop(kind, None)
            self.nccl_origins.pop(kind, None)
        self.calibrated_wires[kind] = dict(calibration.wire_boundaries)
        self._publish_thresholds()
        log.info(
            "calibration in force",
            extra={
                "device_kind": kind,
                "fingerprint_key": calibration.key,
                "origin": origin,
                "thresholds": [b.describe() for b in self.default_boundaries(kind).values()],
            },
        )

    def reuse_stored(self, stores: Sequence[CalibrationStore]) -> list[str]:
        """Use every calibration measured on this machine before (same fingerprint), the newer
        where several stores hold one, without probing; returns the device kinds that have none."""
        missing = []
        for kind, fingerprint in self.fingerprints.items():
            found = [(stored, store) for store in stores if (stored := store.load(fingerprint)) is not None]
            if not found:
                missing.append(kind)
                continue
            stored, store = max(found, key=lambda pair: pair[0].measured_at)
            self.use_calibration(stored, f"{store.path_for(stored.key)}, measured {_when(stored.measured_at)}")
        return missing

    def origin(self, kind: str, nccl: bool = False) -> str:
        """Why new groups of `kind` (whose fallback is NCCL if `nccl`) get the boundaries they do."""
        if nccl and kind in self.nccl_origins:
            return self.nccl_origins[kind]
        if nccl and kind in self.origins:
            return f"built-in defaults: nothing on this machine timed NCCL ({self.origins[kind]}, for groups without an NCCL group)"
        return self.origins.get(kind, "built-in defaults (no calibration of this machine)")

    def _probe_world_size(self, kind: str, asked: int) -> int:
        """The probe's ranks: as asked, else 2 on the CPU and one per GPU (at least 2) on GPUs."""
        world_size = asked or (max(2, self.gpu_count) if kind == DeviceKind.CUDA else 2)
        most = min(self.max_world_size, self.config.max_ranks_per_group)
        if not 2 <= world_size <= most:
            raise InvalidArgumentError(f"world_size {world_size}: expected 2..{most} probe ranks")
        if kind == DeviceKind.CUDA and world_size > self.gpu_count and not self.config.allow_shared_devices:
            raise UnsupportedError(
                f"{world_size} probe ranks on {self.gpu_count} GPUs would share one; a daemon with "
                "allow_shared_devices lets them (its numbers then show ranks sharing a GPU, and no NCCL)"
            )
        return world_size

    async def calibrate(
        self,
        request: pb.CalibrateRequest,
        socket: str,
        store: CalibrationStore,
        on_point: Callable[[str, int, float], None] = lambda path, size, seconds: None,
    ) -> pb.CalibrateReply:
        """Probe, place the boundaries, persist them, and use them for new groups. One at a time."""
        asked = request.device_kind or DeviceKind.CPU
        if asked not in DEFAULT_BOUNDARIES:  # keyed by every DeviceKind
            raise InvalidArgumentError(f"device_kind {shown(asked)}: expected 'cpu' or 'cuda'")
        kind = DeviceKind(asked)
        if kind not in self.fingerprints:
            raise UnsupportedError(f"device_kind {kind.value!r}: this daemon sees no GPU to calibrate")
        world_size = self._probe_world_size(kind, request.world_size)
        min_bytes = request.min_bytes or 4 << 10
        max_bytes = request.max_bytes or (256 << 20 if kind == DeviceKind.CUDA else 64 << 20)
        if not 4 <= min_bytes <= max_bytes:
            raise InvalidArgumentError(f"sizes {min_bytes}..{max_bytes}: expected 4 <= min_bytes <= max_bytes")
        wires = self._wires_to_time(kind, request.wires)
        if self._calibrating.locked():
            raise AlreadyExistsError("a calibration is already running on this daemon")
        async with self._calibrating:
            started = time.monotonic()
            try:
                measured = await self._measure(kind, socket, world_size, min_bytes, max_bytes, on_point, wires)
            except NodecommError:
                self.metrics.calibrations.labels("failed").inc()
                raise
            return await self.conclude(kind, measured, store, wires, started)

    async def conclude(
        self,
        kind: str,
        measured: Measured,
        store: CalibrationStore,
        wires: Sequence[str] = (),
        started: float | None = None,
    ) -> pb.CalibrateReply:
        """What a probe's measurements make of this machine's `kind` calibration: refused where
        they are still noise (the boundaries in force stay, nothing is stored), else the boundaries
        they place, stored and used for new groups. `started`: when probing began (monotonic), for
        the log. Apart from probing so that the same code can be given timings (tests)."""
        noise = measured.noise()
        if noise:
            return self._refuse_noisy(kind, measured, noise)
        medians = measured.medians
        try:
            # The boundary search tries every assignment of boundaries: off the event loop.
            calibration = await asyncio.to_thread(
                calibration_from, self.fingerprints[kind], medians, measured.variants, list(wires)
            )
        except NodecommError:
            self.metrics.calibrations.labels("failed").inc()
            raise
        try:
            path = await asyncio.to_thread(store.save, calibration)
            stored = str(path) if path is not None else "nowhere: this daemon writes no state"
        except OSError as error:
            # The measurement still takes effect; only a restarted daemon will not find it.
            log.error("storing the calibration failed", extra={"device_kind": kind, "error": str(error)})
            stored = f"nowhere: {error}"
        self.metrics.calibrations.labels("ok").inc()
        log.info(
            "calibrated",
            extra={
                "device_kind": kind,
                "boundaries": calibration.boundaries,
                "variants": calibration.variants,
                "wire_boundaries": calibration.wire_boundaries,
                "medians_us": {p: {s: round(t * 1e6, 1) for s, t in m.items()} for p, m in medians.items()},
                "seconds": None if started is None else round(time.monotonic() - started, 1),
                "stored_at": stored,
            },
        )
        self.use_calibration(calibration, f"probed {_when(calibration.measured_at)}, stored in {stored}")
        reply = pb.CalibrateReply(
            fingerprint_key=calibration.key,
            stored_at=stored,
            thresholds=self._build_table(kind, "nccl" in medians, 0).to_proto(),
        )
        return _with_points(reply, medians)

    @staticmethod
    def _wires_to_time(kind: str, asked: Iterable[int]) -> list[str]:
        """The compressed wires a calibration times, by name, checked."""
        wires = []
        for value in asked:
            if value not in (pb.INT8, pb.FP8):
                raise InvalidArgumentError(f"wires: {value} is not a compressed wire; expected int8 (1) or fp8 (2)")
            wires.append(pb.Wire.Name(value).lower())
        return sorted(set(wires))

    async def _measure(
        self, kind: str, socket: str, world_size: int, min_bytes: int, max_bytes: int, on_point, wires: list[str]
    ) -> Measured:
        """The probe's measurements, noise measured again: a busy machine (noise at more than a
        quarter of the sizes) is probed whole once more, and left noisy if it stays busy; a few
        noisy sizes (a burst on a quiet machine) are measured again, up to NOISE_RETRIES times."""
        measured = await probe(kind, socket, world_size, min_bytes, max_bytes, 3600, on_point, wires=wires)
        sizes = len(next(iter(measured.medians.values()), {}))

        def busy(found: Measured) -> bool:
            return len(found.noisy_sizes()) > max(1, sizes // 4)

        if busy(measured):
            log.warning("calibration measured noise at most sizes; probing again", extra={"noise": measured.noise()})
            measured = await probe(kind, socket, world_size, min_bytes, max_bytes, 3600, on_point, wires=wires)
            if busy(measured):
                return measured
        for _ in range(NOISE_RETRIES):
            if not measured.noise():
                break
            log.warning("calibration measured noise; measuring those sizes again", extra={"noise": measured.noise()})
            again = await probe(
                kind, socket, world_size, min_bytes, max_bytes, 3600, on_point, measured.noisy_sizes(), wires
            )
            measured = measured.remeasured(again)
        return measured

    def _refuse_noisy(self, kind: str, measured: Measured, noise: list[str]) -> pb.CalibrateReply:
        """Still too noisy to place a boundary by after measuring again: keep the boundaries in
        force, store nothing, and say so with the figures."""
        warning = (
            f"calibration refused: {len(noise)} points were still noise after measuring again (is the machine "
            "busy?), so "
            f"the {kind} boundaries stay as they were and nothing was stored: {'; '.join(noise[:6])}"
            + (f"; and {len(noise) - 6} more" if len(noise) > 6 else "")
        )
        self.metrics.calibrations.labels("noisy").inc()
        log.warning(warning, extra={"device_kind": kind, "noise": noise})
        reply = pb.CalibrateReply(
            stored_at="nowhere: the measurements were noise",
            thresholds=self._build_table(kind, "nccl" in measured.medians, 0).to_proto(),
            warnings=[warning],
        )
        return _with_points(reply, measured.medians)

    def _build_table(
        self,
        device_kind: str,
        nccl_fallback: bool,
        epoch: int,
        group_overrides: dict[str, int | None] | None = None,
        wire: Wire = Wire.LOSSLESS,
        topology: tuple[dict[str, int | None], str] | None = None,
    ) -> DispatchTable:
        boundaries = self.default_boundaries(device_kind, group_overrides, nccl_fallback, wire)
        origin = self.origin(device_kind, nccl_fallback)
        if topology is not None:
            changed, why = topology
            for name, value in changed.items():
                if boundaries[name].source is Source.DEFAULT:
                    boundaries[name] = Boundary(name, value, Source.DEFAULT)
                    origin = f"{origin}; {why}"
        table = build_table(boundaries, fallback_path(nccl_fallback), epoch, wire)
        return dataclasses.replace(table, origin=origin)

    def adopt_epoch(self, epoch: int) -> None:
        """An adopted group dispatches by `epoch`: tables made from now on come after it, and after
        every epoch the daemon before could have offered it beyond (which its ranks may hold, not
        all of them): in the next block of EPOCH_BLOCK epochs."""
        self._epoch = max(self._epoch, (epoch // EPOCH_BLOCK + 1) * EPOCH_BLOCK - 1)

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def for_new_group(
        self,
        device_kind: str,
        nccl_fallback: bool,
        group_overrides: dict[str, int | None],
        wire: Wire,
        devices: Sequence[int | None] = (),
    ) -> DispatchTable:
        """A new group's table; `devices`, its ranks' CUDA device indices, decide the built-in
        default where the topology says it loses (topology_default)."""
        topology = self.topology_default(devices) if device_kind == DeviceKind.CUDA else None
        return self._build_table(device_kind, nccl_fallback, self._next_epoch(), group_overrides, wire, topology)

    def topology_default(self, devices: Sequence[int | None]) -> tuple[dict[str, int | None], str] | None:
        """The built-in boundaries a CUDA group's topology changes, and why; None where it changes
        none. The copy engines (dma) lost to the SM paths at every size wherever peer reads are
        fast: on ranks sharing a GPU and on GPUs every pair of which is NVLink-connected, seen as
        peer access with native atomics (docs/calibration-gpu.md has both runs). PCIe keeps 6 MiB."""
        gpus = sorted({d for d in devices if d is not None})
        if len(gpus) < len(devices):
            return {"dma_min_bytes": None}, "dma off: ranks share a GPU"
        pairs = [(i, j) for i in gpus for j in gpus if i != j]
        if pairs and all(
            i < len(self.links) and j < len(self.links[i]) and all(self.links[i][j][:2]) for i, j in pairs
        ):
            return {"dma_min_bytes": None}, "dma off: NVLink between every pair of GPUs"
        return None

    def preview(self, device_kind: str, nccl_fallback: bool) -> DispatchTable:
        """What a new group of device_kind would get now (epoch 0: not any group's table)."""
        if device_kind not in DEFAULT_BOUNDARIES:
            raise InvalidArgumentError(f"device_kind {shown(device_kind)}: expected 'cpu' or 'cuda'")
        return self._build_table(device_kind, nccl_fallback and device_kind == DeviceKind.CUDA, 0)

    def nccl_only(self) -> DispatchTable:
        """For a group whose peer memory failed its checks: every size to NCCL."""
        return build_table({}, Path.NCCL, self._next_epoch())

    def follow_evidence(
        self, group: str, kind: str, table: DispatchTable, live: LiveEstimates, nccl_fallback: bool
    ) -> DispatchTable | None:
        """A group's new table where its live timings move a boundary or settle a path (found
        slower, so that exploration leaves it), else None. Overrides are never second-guessed. A
        private daemon also starts its new groups from a move, and keeps it for the user's next
        private daemon (live_store)."""
        fixed = frozenset(b.name for b in table.boundaries if b.source is Source.OVERRIDE)
        fallback = fallback_path(nccl_fallback)
        move = live.proposed_move(table, fallback, fixed) or live.proposed_wire_move(table, fallback, fixed)
        if move is None:
            # No move, but paths found slower leave exploration: a new epoch that says so.
            settled = live.settled(table, table)
            if settled == table.settled:
                return None
            log.debug("exploration settled", extra={"group": group, "settled": list(settled)})
            return dataclasses.replace(table, epoch=self._next_epoch(), settled=settled)
        started = table.origin.split(LIVE_FROM, 1)[-1]
        origin = f"live timings of group {shown(group)}{LIVE_FROM}{started}"
        settled = live.settled(table, move.table)
        moved = dataclasses.replace(move.table, epoch=self._next_epoch(), origin=origin, settled=settled)
        # While a calibration runs, it decides what this machine keeps: its probe's own groups (and
        # any other) move only their own tables meanwhile.
        if self.live_store is not None and not self._calibrating.locked():
            self._keep(kind, nccl_fallback, table.wire, move.values, group)
        for name in move.values:
            self.metrics.threshold_changes.labels(name).inc()
        log.info(
            "boundary moved by live timings",
            extra={
                "group": group,
                "boundaries": [moved.boundary(name).describe() for name in move.values],
                "epoch": moved.epoch,
                "bucket": f"{format_byte_size(move.bucket[0])}..{format_byte_size(move.bucket[1])}",
                "winner": move.winner.value,
                "winner_wire": move.winner_wire.value,
                "winner_us": round(move.winner_seconds * 1e6, 1),
                "loser_us": round(move.loser_seconds * 1e6, 1),
            },
        )
        return moved

    def _keep(self, kind: str, nccl_fallback: bool, wire: Wire, values: dict[str, int | None], group: str) -> None:
        """A live move of a private daemon's group: new groups start from it, and live_store keeps
        it, as this machine's calibration, for the user's next private daemon."""
        lossless = {name: value for name, value in values.items() if name != "compressed_min_bytes"}
        if lossless and nccl_fallback:
            self.calibrated_nccl[kind] = {**self.calibrated_nccl.get(kind, {}), **lossless}
        elif lossless:
            self.calibrated[kind] = {**self.calibrated.get(kind, {}), **lossless}
        if "compressed_min_bytes" in values:
            self.calibrated_wires.setdefault(kind, {})[wire.value] = values["compressed_min_bytes"]
        previous = self.calibrations.get(kind)
        fingerprint = self.fingerprints[kind]
        calibration = Calibration(
            fingerprint_key(fingerprint), fingerprint, dict(self.calibrated.get(kind, {})),
            previous.medians if previous else {}, time.time(), self.calibrated_nccl.get(kind),
            previous.variants if previous else {}, dict(self.calibrated_wires.get(kind, {})),
        )  # fmt: skip
        try:
            where = str(self.live_store.save(calibration))
        except OSError as error:
            log.error("keeping a live move failed", extra={"device_kind": kind, "error": str(error)})
            where = f"nowhere: {error}"
        self.calibrations[kind] = calibration
        origin = f"live timings of group {shown(group)}, kept in {where}"
        (self.nccl_origins if lossless and nccl_fallback else self.origins)[kind] = origin
        self._publish_thresholds()


LIVE_FROM = ", moved from: "


def _when(measured_at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(measured_at))


def _with_points(reply: pb.CalibrateReply, medians: dict[str, dict[int, float]]) -> pb.CalibrateReply:
    """`reply` with every measured point, by path then size."""
    for label, by_size in sorted(medians.items()):
        reply.points.extend(calibration_point(label, size, seconds) for size, seconds in sorted(by_size.items()))
    return reply
