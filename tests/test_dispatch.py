"""The Dispatcher, without a group: what a call's path is, given the table, the forced path and
whether the stream captures; when the ranks agree on a table, and which one."""

import dataclasses

import pytest

from nodecomm.client.dispatch import PATH_CODES, Dispatcher
from nodecomm.errors import InvalidArgumentError
from nodecomm.thresholds import Boundary, DispatchTable, Path, Source, Wire, build_table

KIB = 1 << 10
# <=32KiB oneshot, <=1MiB twoshot, <=64MiB dma, then service.
TABLE = DispatchTable(
    epoch=1, range_max=(32 * KIB, 1 << 20, 64 << 20), range_paths=(Path.ONESHOT, Path.TWOSHOT, Path.DMA, Path.SERVICE)
)
CUDA_PATHS = frozenset({Path.ONESHOT, Path.TWOSHOT, Path.DMA, Path.SERVICE})


def cuda_dispatcher(**periods) -> Dispatcher:
    return Dispatcher(TABLE, CUDA_PATHS, "cuda", **periods)


@pytest.mark.parametrize(
    "nbytes, path",
    [(0, Path.ONESHOT), (32 * KIB, Path.ONESHOT), (32 * KIB + 1, Path.TWOSHOT), (1 << 20, Path.TWOSHOT),
     ((1 << 20) + 1, Path.DMA), ((64 << 20) + 1, Path.SERVICE)],
)  # fmt: skip
def test_the_table_decides_by_size(nbytes, path):
    decision = cuda_dispatcher().decide(nbytes, forced=None, capturing=False)
    assert (decision.path, decision.explored) == (path, False)


def test_a_forced_path_wins_and_is_checked():
    dispatcher = cuda_dispatcher()
    assert dispatcher.decide(4, forced="DMA", capturing=True).path is Path.DMA
    with pytest.raises(InvalidArgumentError, match=r"unknown path 'ring': expected one of oneshot, twoshot"):
        dispatcher.decide(4, forced="ring", capturing=False)
    with pytest.raises(InvalidArgumentError, match=r"'nccl' is not available to a CUDA group \(nccl needs connect"):
        dispatcher.decide(4, forced="nccl", capturing=False)
    cpu = Dispatcher(TABLE, frozenset({Path.ONESHOT, Path.TWOSHOT, Path.SERVICE}), "cpu")
    with pytest.raises(InvalidArgumentError, match=r"'dma' is not available to a CPU group; expected one of 'oneshot'"):
        cpu.decide(4, forced="dma", capturing=False)
    assert dispatcher.calls == 3  # refused calls count too: every rank refuses the same ones


def test_a_table_path_this_rank_cannot_run_is_refused():
    cpu = Dispatcher(TABLE, frozenset({Path.ONESHOT, Path.TWOSHOT, Path.SERVICE}), "cpu")
    with pytest.raises(InvalidArgumentError, match=r"sends 2097152 bytes to dma, which this rank cannot run$"):
        cpu.decide(2 << 20, forced=None, capturing=False)
    assert not cpu.accepts(2 << 20) and cpu.accepts(4 * KIB)
    nccl_table = DispatchTable(epoch=1, range_max=(32 * KIB,), range_paths=(Path.ONESHOT, Path.NCCL))
    by_caller = Dispatcher(nccl_table, CUDA_PATHS, "cuda")
    with pytest.raises(InvalidArgumentError, match=r"runs NCCL itself for these sizes \(ask accepts\(\) first\)"):
        by_caller.decide(1 << 20, forced=None, capturing=False)


def test_the_service_path_is_refused_under_capture_unless_forced():
    dispatcher = cuda_dispatcher()
    with pytest.raises(InvalidArgumentError, match="which a CUDA graph cannot capture; pass path="):
        dispatcher.decide(128 << 20, forced=None, capturing=True)
    assert dispatcher.decide(128 << 20, forced=None, capturing=False).path is Path.SERVICE


def test_every_explore_period_th_call_of_a_bucket_times_the_least_timed_rival_the_daemon_has_not_settled():
    """30 KiB goes to oneshot; every 3rd call of its bucket (16..64 KiB) runs twoshot or dma, the
    one timed less (the lower code on a tie), and the call after it is timed on oneshot (the first
    call is, by the sample period). Calls in other buckets, and captured calls (a capture is
    replayed as recorded), count for nothing there. A rival the table lists as settled there is
    left out; with both settled only every 3 x 256th call explores."""
    dispatcher = cuda_dispatcher(explore_period=3, sample_period=1 << 20)
    near_edge = 30 * KIB

    def calls(count: int) -> list[tuple[Path, bool, bool]]:
        decided = [dispatcher.decide(near_edge, forced=None, capturing=False) for _ in range(count)]
        return [(d.path, d.explored, d.sampled) for d in decided]

    one, two, dma = Path.ONESHOT, Path.TWOSHOT, Path.DMA
    assert calls(3) == [(one, False, True), (one, False, False), (two, True, True)]
    dispatcher.decide(4 * KIB, forced=None, capturing=False)  # another bucket
    assert [dispatcher.decide(near_edge, forced=None, capturing=True).path for _ in range(3)] == [one] * 3
    assert calls(7) == [
        (one, False, True), (one, False, False), (dma, True, True),
        (one, False, True), (one, False, False), (two, True, True),
        (one, False, True),
    ]  # fmt: skip
    bucket = 3  # 16..64 KiB: 1 KiB, 4 KiB, 16 KiB, 64 KiB
    dispatcher.table = dataclasses.replace(TABLE, epoch=2, settled=(0,) * bucket + (1 << 2,))  # twoshot
    assert calls(3) == [(one, False, False), (dma, True, True), (one, False, True)]  # calls 11 .. 13
    dispatcher.table = dataclasses.replace(TABLE, epoch=3, settled=(0,) * bucket + (1 << 2 | 1 << 3,))
    assert not any(explored or sampled for _, explored, sampled in calls(3 * 256 - 14))  # calls 14 .. 767
    assert calls(2) == [(two, True, True), (one, False, False)]  # the 768th refreshes the least timed
    # dma's range ends at the service path, which is not lossless: its rivals are the SM paths.
    at_service_edge = cuda_dispatcher(explore_period=1)
    assert [at_service_edge.decide(64 << 20, forced=None, capturing=False).path for _ in range(3)] == [one, two, one]
    # The service path's range explores nothing.
    beyond = cuda_dispatcher(explore_period=1)
    assert not any(beyond.decide(1 << 30, forced=None, capturing=False).explored for _ in range(4))


def test_a_new_table_restarts_the_count_where_it_routes_differently():
    """Every 2nd call of a bucket explores: 30 KiB made 3 calls and 4 MiB one before dma moved
    from 1 MiB to 2 MiB; 16..64 KiB counts on (its 4th call explores), 1..4 MiB starts again."""
    dispatcher = cuda_dispatcher(explore_period=2)
    for nbytes in (30 * KIB, 30 * KIB, 30 * KIB, 4 << 20):
        dispatcher.decide(nbytes, forced=None, capturing=False)
    dispatcher.table = DispatchTable(
        epoch=2, range_max=(32 * KIB, (2 << 20) - 1, 64 << 20), range_paths=TABLE.range_paths
    )
    assert dispatcher.decide(30 * KIB, forced=None, capturing=False).explored
    assert not dispatcher.decide(4 << 20, forced=None, capturing=False).explored


def test_the_ranks_switch_to_the_lowest_newest_table_they_hold():
    dispatcher = cuda_dispatcher(switch_period=2)
    dispatcher.decide(4, forced=None, capturing=False)
    assert not dispatcher.switch_due(capturing=False)
    dispatcher.decide(4, forced=None, capturing=False)
    assert dispatcher.switch_due(capturing=False) and not dispatcher.switch_due(capturing=True)

    newer = {e: DispatchTable(epoch=e, range_max=(), range_paths=(Path.TWOSHOT,)) for e in (2, 3)}
    offered = dict(newer)
    passed = []

    def lowest_of_ranks(epoch: int) -> int:
        passed.append(epoch)
        return min(epoch, 2)  # a peer holds only epoch 2

    assert dispatcher.agree(offered, lowest_of_ranks) == 2
    assert passed == [3] and dispatcher.table is newer[2] and list(offered) == [3]
    assert dispatcher.decide(4, forced=None, capturing=False).path is Path.TWOSHOT
    # Nothing newer anywhere: no switch, the table stays.
    assert dispatcher.agree({}, lambda epoch: epoch) is None and dispatcher.table is newer[2]
    # Never without a period.
    assert not cuda_dispatcher().switch_due(capturing=False)


def test_a_decision_carries_the_variant_of_the_path_it_chose():
    """The transport's variant of the path decided, forced, chosen or explored (here a stand-in for
    CUDA oneshot's: pushed up to 8 KiB, pulled over a compressed wire)."""

    def variant_of(path: Path, nbytes: int, wire: Wire) -> str:
        if path is not Path.ONESHOT:
            return ""
        return "push" if nbytes <= 8 * KIB and wire is Wire.LOSSLESS else "pull"

    dispatcher = Dispatcher(TABLE, CUDA_PATHS, "cuda", variant_of=variant_of, wire_paths=CUDA_PATHS, explore_period=2)
    assert dispatcher.decide(4 * KIB, forced=None, capturing=False).variant == "push"
    dispatcher.decide(33 * KIB, forced=None, capturing=False)
    explored = dispatcher.decide(33 * KIB, forced=None, capturing=False)  # the bucket's second call explores
    assert (explored.path, explored.explored, explored.variant) == (Path.ONESHOT, True, "pull")
    assert dispatcher.decide(16 * KIB, forced="twoshot", capturing=False).variant == ""
    assert dispatcher.variant("oneshot", 8 * KIB) == "push" and dispatcher.variant("oneshot", 8 * KIB + 1) == "pull"
    assert dispatcher.variant("oneshot", 4 * KIB, "int8") == "pull"
    assert dispatcher.decide(4 * KIB, forced="oneshot", capturing=False, wire="fp8").variant == "pull"
    assert dispatcher.calls == 5  # variant() decides no call
    assert Dispatcher(TABLE, CUDA_PATHS, "cuda").decide(4, forced=None, capturing=False).variant == ""


def test_an_opted_in_group_explores_the_other_wire_near_compressed_min():
    """Within 4x of compressed_min_bytes every explore_period-th call of a bucket takes the other
    wire on the same path (so the daemon times both) before another path; beyond it, and in a
    group that did not ask, never."""
    boundaries = {
        "oneshot_max_bytes": Boundary("oneshot_max_bytes", 32 * KIB, Source.DEFAULT),
        "compressed_min_bytes": Boundary("compressed_min_bytes", 1 << 20, Source.CALIBRATED),
    }
    table = build_table(boundaries, Path.TWOSHOT, 1, Wire.INT8)
    paths = frozenset({Path.ONESHOT, Path.TWOSHOT, Path.SERVICE})
    dispatcher = Dispatcher(table, paths, "cpu", wire_paths=paths - {Path.SERVICE}, explore_period=2)
    below = [dispatcher.decide(512 * KIB, forced=None, capturing=False) for _ in range(2)]
    assert [(d.wire, d.explored) for d in below] == [(Wire.LOSSLESS, False), (Wire.INT8, True)]
    above = [dispatcher.decide(2 << 20, forced=None, capturing=False) for _ in range(2)]
    assert [(d.wire, d.explored) for d in above] == [(Wire.INT8, False), (Wire.LOSSLESS, True)]
    far = [dispatcher.decide(64 << 20, forced=None, capturing=False) for _ in range(2)]
    assert [d.wire for d in far] == [Wire.INT8, Wire.INT8] and not any(d.explored for d in far)
    dispatcher.decide(512 * KIB, forced=None, capturing=False)  # the bucket's 3rd call
    captured = dispatcher.decide(512 * KIB, forced=None, capturing=True)  # would be its 4th: no exploring
    assert (captured.wire, captured.explored) == (Wire.LOSSLESS, False)
    plain = Dispatcher(build_table(boundaries, Path.TWOSHOT, 1), paths, "cpu", wire_paths=paths, explore_period=1)
    assert all(plain.decide(512 * KIB, forced=None, capturing=False).wire is Wire.LOSSLESS for _ in range(4))


def test_the_sampled_calls_and_the_counts_are_kept_natively():
    """Every sample_period-th call, and every explored one, is timed; the counts of what each path
    carried add up per (op, path, wire) until taken, and a take starts them again. A bad code or
    a table that is not one is refused with what was expected."""
    dispatcher = Dispatcher(TABLE, CUDA_PATHS, "cuda", explore_period=3, sample_period=4)
    sampled = [dispatcher.decide(16 * KIB, forced=None, capturing=False).sampled for _ in range(9)]
    # Calls 1, 5 and 9 by the period; 3, 6 and 9 explore twoshot, dma and twoshot, and 4 and 7 time
    # oneshot beside them.
    assert sampled == [True, False, True, True, True, True, True, False, True]
    native = dispatcher.native
    oneshot, dma, int8 = Path.ONESHOT.to_proto(), Path.DMA.to_proto(), Wire.INT8.to_proto()
    for nbytes in (100, 200):
        native.count(1, oneshot, 0, nbytes, nbytes)
    native.count(1, dma, int8, 4096, 1152)
    native.count(2, oneshot, 0, 64, 64)
    assert sorted(native.take_counts()) == [
        (1, oneshot, 0, 2, 300, 300),
        (1, dma, int8, 1, 4096, 1152),
        (2, oneshot, 0, 1, 64, 64),
    ]
    assert native.take_counts() == []
    with pytest.raises(InvalidArgumentError, match="unknown path code 9: expected 1-5"):
        native.count(1, 9, 0, 1, 1)
    with pytest.raises(InvalidArgumentError, match="range ends must increase"):
        native.install(2, [64, 32], [1, 2, 3], [], 0, -1)
    assert dispatcher.table is TABLE and native.epoch == 1  # the refused table left the one in force


def test_a_failed_call_is_taken_back_from_its_buckets_exploration():
    """Ranks that disagreed on a call's size counted it in different buckets; the CPU lane undoes
    the count of a call that raised, so every rank explores the same calls afterwards."""
    one, other = (
        cuda_dispatcher(explore_period=2),
        cuda_dispatcher(explore_period=2),
    )
    one.decide(30 * KIB, forced=None, capturing=False)
    other.decide(4 * KIB, forced=None, capturing=False)  # the disagreeing call
    one.native.undo()
    other.native.undo()
    both = [[d.decide(30 * KIB, forced=None, capturing=False).explored for _ in range(4)] for d in (one, other)]
    assert both[0] == both[1] == [False, True, False, True]


def test_sizes_probed_for_a_capture_take_their_path_when_captured():
    """Communicator.capture() arms probes: the first eager call of a size the table gives a
    lossless path is left to the caller (the lane's outcome 6) until a path is set for it, which
    that size's captured calls then take; eager calls keep the table's, and what was captured is
    taken whole once per change, for the daemon."""
    native = cuda_dispatcher().native
    oneshot, twoshot, dma = (PATH_CODES[p] for p in (Path.ONESHOT, Path.TWOSHOT, Path.DMA))
    assert not native.probe_due(4 * KIB, 0, -1, False)  # not armed
    native.arm_probes(True)
    assert native.probe_due(4 * KIB, 0, -1, False)
    assert not native.probe_due(4 * KIB, oneshot, -1, False)  # forced
    assert not native.probe_due(4 * KIB, 0, -1, True)  # already capturing: too late
    assert not native.probe_due(128 << 20, 0, -1, False)  # the service path's size: not lossless
    native.set_probed(4 * KIB, dma)
    assert not native.probe_due(4 * KIB, 0, -1, False)
    assert native.decide(4 * KIB, 0, -1, True)[0] == dma
    assert native.decide(4 * KIB, 0, -1, False)[0] == oneshot
    assert native.decide(64 * KIB, 0, -1, True)[0] == twoshot  # not probed: the table's
    assert native.decide(64 * KIB, dma, -1, True)[0] == dma  # forced: not recorded
    assert native.take_captured() == [(4 * KIB, dma), (64 * KIB, twoshot)]
    assert native.take_captured() == []
    native.decide(4 * KIB, 0, -1, True)
    assert native.take_captured() == []  # nothing changed
    native.arm_probes(True)  # a new capture phase probes afresh
    assert native.probe_due(4 * KIB, 0, -1, False)
    assert native.decide(4 * KIB, 0, -1, True)[0] == oneshot
    assert native.take_captured() == [(4 * KIB, oneshot), (64 * KIB, twoshot)]
    with pytest.raises(InvalidArgumentError, match="must be a lossless one this rank runs, not service"):
        native.set_probed(4 * KIB, PATH_CODES[Path.SERVICE])
    for n in range(300):
        native.decide(8 + n, 0, -1, True)
    assert len(native.take_captured()) == 256  # bounded
    native.arm_probes(False)
    assert not native.probe_due(8 * KIB, 0, -1, False)
