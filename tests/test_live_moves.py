"""Which boundaries live timings move, on the tables CUDA and CPU groups hold: the fastest path
that beats a bucket's path by the margin takes that bucket, however far its range is, with the
fewest boundaries moved; overrides stay, and no move sends another bucket to a path its evidence
shows slower."""

import dataclasses

from nodecomm.evidence import bucket_index
from nodecomm.service.calibration.live_thresholds import LiveEstimates
from nodecomm.thresholds import Boundary, Path, Source, Wire, build_table

KIB, MIB = 1 << 10, 1 << 20


def table(fallback: Path, *, source: Source = Source.CALIBRATED, **values: int | None):
    names = ("oneshot_max_bytes", "twoshot_max_bytes", "dma_min_bytes")
    boundaries = {name: Boundary(name, values.get(name), source) for name in names}
    return build_table(boundaries, fallback, 1)


def evidence(*timings: tuple[str, int, float], world_size: int = 2) -> LiveEstimates:
    live = LiveEstimates(world_size, margin=0.05, min_samples=4)
    for path, nbytes, seconds in timings:
        for rank in range(world_size):
            for _ in range(4):
                live.add(rank, Path(path), nbytes, seconds)
    return live


def moved(live: LiveEstimates, before, fallback: Path, fixed: frozenset[str] = frozenset()):
    move = live.proposed_move(before, fallback, fixed)
    return None if move is None else (move, [(lo, hi, p.value) for lo, hi, p in move.table.rows()])


CUDA_DEFAULT = dict(oneshot_max_bytes=256 * KIB, dma_min_bytes=6 * MIB)


def test_the_lower_neighbour_takes_a_bucket_it_wins():
    live = evidence(("nccl", 512 * KIB, 30e-6), ("oneshot", 512 * KIB, 10e-6))
    move, rows = moved(live, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL)
    assert move.values == {"oneshot_max_bytes": MIB} and move.winner is Path.ONESHOT
    assert rows == [(0, 1048576, "oneshot"), (1048577, 6291455, "nccl"), (6291456, None, "dma")]


def test_dma_takes_a_bucket_from_its_start():
    live = evidence(("nccl", 2 * MIB, 60e-6), ("dma", 2 * MIB, 40e-6))
    move, rows = moved(live, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL)
    assert move.values == {"dma_min_bytes": MIB + 1}
    assert rows == [(0, 262144, "oneshot"), (262145, 1048576, "nccl"), (1048577, None, "dma")]


def test_nccl_takes_the_top_of_twoshot_range():
    calibrated = table(Path.NCCL, oneshot_max_bytes=512 * KIB, twoshot_max_bytes=8 * MIB)
    live = evidence(("twoshot", 2 * MIB, 60e-6), ("nccl", 2 * MIB, 30e-6))
    move, rows = moved(live, calibrated, Path.NCCL)
    assert move.values == {"twoshot_max_bytes": MIB}
    assert rows == [(0, 524288, "oneshot"), (524289, 1048576, "twoshot"), (1048577, None, "nccl")]


def test_a_path_below_dma_reaches_up_with_it():
    before = table(Path.TWOSHOT, oneshot_max_bytes=4 * MIB, dma_min_bytes=4 * MIB + 1)
    live = evidence(("dma", 8 * MIB, 90e-6), ("oneshot", 8 * MIB, 40e-6))
    move, rows = moved(live, before, Path.TWOSHOT)
    assert move.values == {"dma_min_bytes": 16 * MIB + 1, "oneshot_max_bytes": 16 * MIB}
    assert rows == [(0, 16777216, "oneshot"), (16777217, None, "dma")]


def test_the_fallback_below_dma_needs_no_boundary_of_its_own():
    before = table(Path.TWOSHOT, oneshot_max_bytes=256 * KIB, dma_min_bytes=MIB + 1)
    live = evidence(("dma", 2 * MIB, 90e-6), ("twoshot", 2 * MIB, 40e-6))
    move, rows = moved(live, before, Path.TWOSHOT)
    assert move.values == {"dma_min_bytes": 4 * MIB + 1}
    assert rows == [(0, 262144, "oneshot"), (262145, 4194304, "twoshot"), (4194305, None, "dma")]


def test_the_cpu_boundary_moves_as_before():
    live = evidence(("oneshot", 16 * KIB, 100e-6), ("twoshot", 16 * KIB, 10e-6))
    move, rows = moved(live, table(Path.TWOSHOT, oneshot_max_bytes=32 * KIB), Path.TWOSHOT)
    assert move.values == {"oneshot_max_bytes": 4 * KIB}
    assert rows == [(0, 4096, "oneshot"), (4097, None, "twoshot")]


def test_overrides_and_the_margin_hold_the_table():
    live = evidence(("nccl", 2 * MIB, 60e-6), ("dma", 2 * MIB, 40e-6))
    assert moved(live, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL, frozenset({"dma_min_bytes"})) is None
    close = evidence(("nccl", 2 * MIB, 60e-6), ("dma", 2 * MIB, 58e-6))
    assert moved(close, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL) is None


def test_evidence_from_too_few_ranks_moves_nothing():
    one_rank = LiveEstimates(2, margin=0.05, min_samples=4)
    for _ in range(4):
        one_rank.add(0, Path.NCCL, 2 * MIB, 60e-6)
        one_rank.add(0, Path.DMA, 2 * MIB, 10e-6)
    assert moved(one_rank, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL) is None


def test_a_bucket_a_boundary_splits_is_compared_on_each_side_of_it():
    # 4..16 MiB straddles dma_min_bytes=6MiB: its part above (6..16 MiB) is dma's, where twoshot,
    # the fallback's neighbour, wins: dma starts past the bucket (the default table's 16 MiB loss).
    before = table(Path.TWOSHOT, **CUDA_DEFAULT)
    live = evidence(("dma", 16 * MIB, 100e-6), ("twoshot", 16 * MIB, 55e-6), ("twoshot", 5 * MIB, 20e-6))
    move, rows = moved(live, before, Path.TWOSHOT)
    assert move.values == {"dma_min_bytes": 16 * MIB + 1} and move.bucket == (6 * MIB, 16 * MIB)
    assert rows == [(0, 262144, "oneshot"), (262145, 16777216, "twoshot"), (16777217, None, "dma")]
    # Samples below the boundary say nothing about the part above it, however fast.
    below_only = evidence(("dma", 16 * MIB, 100e-6), ("twoshot", 5 * MIB, 1e-6))
    assert moved(below_only, before, Path.TWOSHOT) is None


def test_a_winner_two_boundaries_away_moves_both():
    # twoshot_max_bytes (512 KiB) below oneshot_max_bytes carries nothing today; lowering
    # oneshot_max_bytes alone to hand 256 KiB..1 MiB to NCCL would give half of it to twoshot.
    before = table(Path.NCCL, oneshot_max_bytes=MIB, twoshot_max_bytes=512 * KIB)
    live = evidence(("oneshot", 512 * KIB, 60e-6), ("nccl", 512 * KIB, 20e-6))
    move, rows = moved(live, before, Path.NCCL)
    assert move.values == {"oneshot_max_bytes": 256 * KIB, "twoshot_max_bytes": 256 * KIB}
    assert rows == [(0, 262144, "oneshot"), (262145, None, "nccl")]


def test_nccl_takes_no_size_it_did_not_win():
    """NCCL is never explored, and a move drops the evidence of the buckets it reroutes: a size
    handed to NCCL as a side effect of another path's win would stay there. Twoshot, faster at
    16 KiB in a group whose fallback is NCCL, takes oneshot's range above the bucket (twoshot's
    edge where oneshot's is now), as it does where twoshot is the fallback; the fewest boundaries
    moved would have given NCCL 16 KiB..6 MiB, which nothing timed it at."""
    live = evidence(("oneshot", 16 * KIB, 9e-6), ("twoshot", 16 * KIB, 6e-6))
    move, rows = moved(live, table(Path.NCCL, **CUDA_DEFAULT), Path.NCCL)
    assert move.values == {"oneshot_max_bytes": 4 * KIB, "twoshot_max_bytes": 256 * KIB}
    assert rows == [(0, 4096, "oneshot"), (4097, 262144, "twoshot"), (262145, 6291455, "nccl"), (6291456, None, "dma")]
    live = evidence(("oneshot", 16 * KIB, 9e-6), ("twoshot", 16 * KIB, 6e-6))  # the move dropped it
    move, rows = moved(live, table(Path.TWOSHOT, **CUDA_DEFAULT), Path.TWOSHOT)
    assert rows == [(0, 4096, "oneshot"), (4097, 6291455, "twoshot"), (6291456, None, "dma")]


def test_only_the_winner_takes_over_a_neighbours_range():
    """NCCL, faster than dma at 5 MiB, cannot take 4..16 MiB without sending 512 KiB to oneshot,
    which is timed 2x slower than dma there; lowering oneshot's edge to where twoshot's ends (a
    neighbour's range, for oneshot or twoshot to take over when they win) would hand NCCL
    64 KiB..4 MiB, which nothing timed it at. So nothing moves."""
    before = table(Path.NCCL, oneshot_max_bytes=MIB, twoshot_max_bytes=64 * KIB, dma_min_bytes=4 * KIB + 1)
    live = evidence(
        ("dma", 5 * MIB, 60e-6), ("nccl", 5 * MIB, 30e-6), ("dma", 512 * KIB, 30e-6), ("oneshot", 512 * KIB, 60e-6)
    )
    assert moved(live, before, Path.NCCL) is None


def test_a_table_of_one_path_gives_a_bucket_to_a_path_it_never_had():
    """Every size to dma (a wrong stored table): oneshot, faster at 16 MiB, takes every size up to
    the bucket's top, the one move that hands it the bucket."""
    everything_dma = table(Path.TWOSHOT, dma_min_bytes=0)
    assert [p for _, _, p in everything_dma.rows()] == [Path.DMA]
    live = evidence(("dma", 16 * MIB, 100e-6), ("twoshot", 16 * MIB, 60e-6), ("oneshot", 16 * MIB, 50e-6))
    move, rows = moved(live, everything_dma, Path.TWOSHOT)
    assert move.values == {"oneshot_max_bytes": 16 * MIB, "dma_min_bytes": 16 * MIB + 1}
    assert move.winner is Path.ONESHOT and rows == [(0, 16777216, "oneshot"), (16777217, None, "dma")]


def test_a_move_never_sends_a_bucket_to_a_path_its_evidence_shows_slower():
    """Handing 16 MiB to oneshot would send 1 MiB to oneshot too, where twoshot is timed 3x faster:
    the next fastest winner, twoshot, takes 16 MiB instead, and 1 MiB keeps its path."""
    before = table(Path.TWOSHOT, oneshot_max_bytes=256 * KIB, dma_min_bytes=6 * MIB)
    live = evidence(
        ("twoshot", MIB, 10e-6), ("oneshot", MIB, 30e-6),
        ("dma", 16 * MIB, 100e-6), ("oneshot", 16 * MIB, 50e-6), ("twoshot", 16 * MIB, 60e-6),
    )  # fmt: skip
    move, rows = moved(live, before, Path.TWOSHOT)
    assert move.winner is Path.TWOSHOT and move.values == {"dma_min_bytes": 16 * MIB + 1}
    assert rows == [(0, 262144, "oneshot"), (262145, 16777216, "twoshot"), (16777217, None, "dma")]


def test_evidence_is_dropped_once_it_moved_a_boundary():
    live = evidence(("nccl", 512 * KIB, 30e-6), ("oneshot", 512 * KIB, 10e-6))
    before = table(Path.NCCL, **CUDA_DEFAULT)
    assert live.proposed_move(before, Path.NCCL) is not None
    assert live.proposed_move(before, Path.NCCL) is None


def test_only_dma_min_moves_when_the_lower_path_already_reaches_the_bucket():
    before = table(Path.NCCL, oneshot_max_bytes=64 * MIB, dma_min_bytes=4 * MIB + 1)
    fixed = frozenset({"oneshot_max_bytes"})  # an override: it may not move, and need not
    live = evidence(("dma", 8 * MIB, 90e-6), ("oneshot", 8 * MIB, 40e-6))
    move, rows = moved(live, before, Path.NCCL, fixed)
    assert move.values == {"dma_min_bytes": 16 * MIB + 1}
    assert rows == [(0, 16777216, "oneshot"), (16777217, None, "dma")]


def test_the_faster_of_two_winning_neighbours_takes_the_bucket():
    live = evidence(("nccl", 2 * MIB, 90e-6), ("oneshot", 2 * MIB, 60e-6), ("dma", 2 * MIB, 30e-6))
    before = table(Path.NCCL, oneshot_max_bytes=MIB, dma_min_bytes=4 * MIB + 1)
    move, _ = moved(live, before, Path.NCCL)
    assert move.winner is Path.DMA and move.values == {"dma_min_bytes": MIB + 1}


def test_a_bucket_from_zero_switches_the_lower_path_off():
    live = evidence(("oneshot", 512, 50e-6), ("twoshot", 512, 10e-6))
    move, rows = moved(live, table(Path.TWOSHOT, oneshot_max_bytes=32 * KIB), Path.TWOSHOT)
    assert move.values == {"oneshot_max_bytes": None} and rows == [(0, None, "twoshot")]


def test_a_move_forgets_what_it_changed_so_old_samples_cannot_move_it_back():
    """oneshot wins 16..64 KiB against NCCL; 4..16 KiB, split by the old boundary (6 KiB), holds
    older samples saying NCCL beat oneshot there. Once oneshot takes everything up to 64 KiB, those
    samples describe a bucket whose paths changed, and must not move the boundary back down."""
    before = table(Path.NCCL, oneshot_max_bytes=6 * KIB)
    live = evidence(
        ("nccl", 12 * KIB, 20e-6), ("oneshot", 5 * KIB, 40e-6), ("nccl", 32 * KIB, 60e-6), ("oneshot", 32 * KIB, 20e-6)
    )
    move = live.proposed_move(before, Path.NCCL)
    assert move.values == {"oneshot_max_bytes": 64 * KIB}
    assert live.proposed_move(move.table, Path.NCCL) is None


def test_an_override_in_the_table_is_never_moved_by_the_keeper():
    from nodecomm.service.calibration.tables import TableKeeper
    from nodecomm.service.config import DaemonConfig
    from nodecomm.service.metrics.families import DaemonMetrics

    keeper = TableKeeper(DaemonConfig(), DaemonMetrics(), 8)
    live = evidence(("nccl", 2 * MIB, 60e-6), ("dma", 2 * MIB, 40e-6))
    pinned = table(Path.NCCL, source=Source.OVERRIDE, **CUDA_DEFAULT)
    assert keeper.follow_evidence("g", "cuda", pinned, live, nccl_fallback=True) is None
    after = keeper.follow_evidence("g", "cuda", table(Path.NCCL, **CUDA_DEFAULT), live, nccl_fallback=True)
    assert after.boundary("dma_min_bytes").describe() == "dma_min_bytes=1048577 (calibrated)"


def wire_table(compressed_min: int | None, *, source: Source = Source.CALIBRATED, wire: Wire = Wire.INT8):
    boundaries = {
        "oneshot_max_bytes": Boundary("oneshot_max_bytes", 32 * KIB, Source.DEFAULT),
        "compressed_min_bytes": Boundary("compressed_min_bytes", compressed_min, source),
    }
    return build_table(boundaries, Path.TWOSHOT, 1, wire)


def wire_evidence(*timings: tuple[str, int, float, bool]) -> LiveEstimates:
    live = LiveEstimates(2, margin=0.05, min_samples=4)
    for path, nbytes, seconds, compressed in timings:
        for rank in range(2):
            for _ in range(4):
                live.add(rank, Path(path), nbytes, seconds, compressed=compressed)
    return live


def test_a_bucket_faster_on_the_groups_wire_moves_compressed_min_down_to_it():
    live = wire_evidence(("twoshot", 256 * KIB, 100e-6, False), ("twoshot", 256 * KIB, 60e-6, True))
    move = live.proposed_wire_move(wire_table(MIB), Path.TWOSHOT)
    # The bucket of 256 KiB is (64 KiB, 256 KiB]: it takes the wire from its first size.
    assert move.values == {"compressed_min_bytes": 64 * KIB + 1} and move.winner_wire is Wire.INT8
    assert move.table.wire_for(64 * KIB + 1) is Wire.INT8 and move.table.wire_for(64 * KIB) is Wire.LOSSLESS
    assert live.estimate(Path.TWOSHOT, bucket_index(256 * KIB), compressed=True) is None  # its evidence went


def test_a_compressed_bucket_faster_lossless_moves_compressed_min_up_past_it():
    live = wire_evidence(("twoshot", 2 * MIB, 300e-6, False), ("twoshot", 2 * MIB, 500e-6, True))
    move = live.proposed_wire_move(wire_table(MIB), Path.TWOSHOT)
    assert move.values == {"compressed_min_bytes": 4 * MIB + 1} and move.winner_wire is Wire.LOSSLESS
    assert move.table.wire_for(4 * MIB) is Wire.LOSSLESS and move.table.wire_for(4 * MIB + 1) is Wire.INT8


def test_no_wire_moves_within_the_margin_under_an_override_or_in_a_lossless_group():
    close = wire_evidence(("twoshot", 256 * KIB, 100e-6, False), ("twoshot", 256 * KIB, 97e-6, True))
    assert close.proposed_wire_move(wire_table(MIB), Path.TWOSHOT) is None
    faster = wire_evidence(("twoshot", 256 * KIB, 100e-6, False), ("twoshot", 256 * KIB, 60e-6, True))
    assert (
        faster.proposed_wire_move(
            wire_table(MIB, source=Source.OVERRIDE), Path.TWOSHOT, frozenset({"compressed_min_bytes"})
        )
        is None
    )
    assert faster.proposed_wire_move(wire_table(MIB, wire=Wire.LOSSLESS), Path.TWOSHOT) is None


def test_a_path_slower_in_every_cell_of_a_bucket_is_settled_there_until_its_routing_changes():
    """The CUDA default with twoshot up to 6 MiB splits the 4..16 MiB bucket at dma_min_bytes:
    oneshot is within the margin of dma in the dma part, so only twoshot (slower in both parts)
    and dma (slower in the one where it is not the table's) are settled there; at 1 MiB (twoshot)
    dma is. A move that reroutes a bucket drops what was settled there, and keeps the rest."""
    before = table(Path.TWOSHOT, oneshot_max_bytes=256 * KIB, dma_min_bytes=6 * MIB)
    one_mib = ("twoshot", MIB, 10e-6), ("dma", MIB, 30e-6), ("oneshot", MIB, 10.2e-6)
    live = evidence(
        *one_mib,
        ("twoshot", 5 * MIB, 40e-6), ("oneshot", 5 * MIB, 60e-6), ("dma", 5 * MIB, 90e-6),
        ("dma", 16 * MIB, 100e-6), ("oneshot", 16 * MIB, 102e-6), ("twoshot", 16 * MIB, 130e-6),
    )  # fmt: skip
    two, dma = (1 << p.to_proto() for p in (Path.TWOSHOT, Path.DMA))
    settled = live.settled(before, before)
    assert settled == (0,) * bucket_index(MIB) + (dma, 0, two | dma)
    # Twoshot 3x faster than dma at 64 MiB moves dma_min_bytes above it, rerouting 4..64 MiB.
    live = evidence(*one_mib, ("dma", 64 * MIB, 300e-6), ("twoshot", 64 * MIB, 100e-6))
    move = live.proposed_move(before, Path.TWOSHOT)
    assert move.values == {"dma_min_bytes": 64 * MIB + 1}
    assert live.settled(dataclasses.replace(before, settled=settled), move.table) == (0,) * bucket_index(MIB) + (dma,)


def test_a_private_daemon_keeps_no_live_move_while_it_calibrates(tmp_path):
    """A private daemon keeps a group's live move for its new groups and the user's next daemon, but
    not while a calibration runs: then the probe decides, and its own groups' timings (paths forced
    on a machine it is loading) move only their own tables."""
    import asyncio

    from nodecomm.service.calibration.stored import CalibrationStore
    from nodecomm.service.calibration.tables import TableKeeper
    from nodecomm.service.config import DaemonConfig
    from nodecomm.service.metrics.families import DaemonMetrics

    keeper = TableKeeper(DaemonConfig(state_dir=str(tmp_path / "state")), DaemonMetrics(), 8)
    keeper.live_store = CalibrationStore(str(tmp_path / "cache"))
    before = keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS)
    twoshot_wins = (("oneshot", 8 * KIB, 40e-6), ("twoshot", 8 * KIB, 10e-6))

    async def during_a_calibration():
        async with keeper._calibrating:
            return keeper.follow_evidence("g", "cpu", before, evidence(*twoshot_wins), nccl_fallback=False)

    moved = asyncio.run(during_a_calibration())
    assert moved.path_for(8 * KIB) is Path.TWOSHOT  # the group's own table moved
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).path_for(8 * KIB) is Path.ONESHOT
    assert list((tmp_path / "cache").glob("calibration-*.json")) == []
    keeper.follow_evidence("g", "cpu", before, evidence(*twoshot_wins), nccl_fallback=False)
    assert keeper.for_new_group("cpu", False, {}, Wire.LOSSLESS).path_for(8 * KIB) is Path.TWOSHOT
    assert len(list((tmp_path / "cache").glob("calibration-*.json"))) == 1


def test_the_moves_a_private_daemon_keeps_start_only_groups_with_the_same_fallback(tmp_path):
    """Boundaries placed with twoshot as the fallback say where oneshot stops beating twoshot; read
    with NCCL as the fallback they would hand NCCL every size above that, where nothing timed it.
    So a kept move starts only the next groups whose fallback is the mover's, in this daemon and in
    the user's next one; NCCL groups are on the built-in defaults until something times NCCL."""
    from nodecomm.capabilities import DeviceKind
    from nodecomm.service.calibration.fingerprint import cuda_fingerprint
    from nodecomm.service.calibration.stored import CalibrationStore
    from nodecomm.service.calibration.tables import TableKeeper
    from nodecomm.service.config import DaemonConfig
    from nodecomm.service.metrics.families import DaemonMetrics

    gpu = {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:19:00.0", "uuid": "GPU-0"}

    def private_daemons_keeper() -> TableKeeper:
        keeper = TableKeeper(DaemonConfig(state_dir=str(tmp_path / "state")), DaemonMetrics(), 8)
        keeper.fingerprints[DeviceKind.CUDA] = cuda_fingerprint([gpu], [[(True, True, 0)]])
        keeper.live_store = CalibrationStore(str(tmp_path / "cache"), private=True)
        keeper.reuse_stored([CalibrationStore(str(tmp_path / "state"), writable=False), keeper.live_store])
        return keeper

    def new_table(keeper: TableKeeper, nccl: bool):
        return keeper.for_new_group("cuda", nccl, {}, Wire.LOSSLESS)

    first = private_daemons_keeper()
    twoshot_wins = evidence(("oneshot", 16 * KIB, 9e-6), ("twoshot", 16 * KIB, 6e-6))
    job = first.follow_evidence("job", "cuda", new_table(first, nccl=False), twoshot_wins, nccl_fallback=False)
    assert job.path_for(16 * KIB) is Path.TWOSHOT
    for keeper in (first, private_daemons_keeper()):  # this daemon's next groups, the next daemon's
        assert new_table(keeper, nccl=False).path_for(16 * KIB) is Path.TWOSHOT
        engines = new_table(keeper, nccl=True)
        assert [engines.path_for(n) for n in (16 * KIB, 256 * KIB, 256 * KIB + 1)] == [
            Path.ONESHOT, Path.ONESHOT, Path.NCCL,
        ]  # fmt: skip
        assert engines.origin.startswith("built-in defaults: nothing on this machine timed NCCL (")
    # An NCCL group's own move starts the next NCCL groups, and leaves the others as they were.
    dma_wins = evidence(("nccl", 2 * MIB, 60e-6), ("dma", 2 * MIB, 40e-6))
    assert first.follow_evidence("slot", "cuda", new_table(first, nccl=True), dma_wins, nccl_fallback=True)
    for keeper in (first, private_daemons_keeper()):
        engines, job = new_table(keeper, nccl=True), new_table(keeper, nccl=False)
        assert [engines.path_for(n) for n in (16 * KIB, 512 * KIB, MIB + 1)] == [Path.ONESHOT, Path.NCCL, Path.DMA]
        assert [job.path_for(n) for n in (16 * KIB, MIB + 1, 6 * MIB)] == [Path.TWOSHOT, Path.TWOSHOT, Path.DMA]
        assert "nothing on this machine timed NCCL" not in engines.origin
        assert "'slot'" not in job.origin  # each kind of group says where its own boundaries come from
    assert new_table(first, nccl=True).origin.startswith("live timings of group 'slot'")
    assert new_table(first, nccl=False).origin.startswith("live timings of group 'job'")
