"""The Dispatcher, without a group: what a call's path is, given the table, the forced path and
whether the stream captures; when the ranks agree on a table, and which one."""

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nodecomm.client.dispatch import PATH_CODES, Dispatcher
from nodecomm.errors import InvalidArgumentError
from nodecomm.evidence import bucket_index
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


LOSSLESS = (Path.ONESHOT, Path.TWOSHOT, Path.DMA)
# One size in each bucket (nodecomm.evidence, as native/dispatch_table.h's): oneshot's up to 30 KiB
# near its edge, twoshot's, dma's up to 64 MiB at the service path's edge, and the service path's.
SIZES = (512, 3 * KIB, 10 * KIB, 30 * KIB, 200 * KIB, 700 * KIB, 2 << 20, 10 << 20, 64 << 20, 100 << 20, 1 << 30)
assert sorted(bucket_index(n) for n in SIZES) == list(range(len(SIZES)))
REFRESH = 256  # native/dispatch.h's kRefresh: where every rival is settled, one explore in explore_period x 256


def rivals(table: DispatchTable, nbytes: int) -> tuple[frozenset[Path], frozenset[Path]]:
    """The paths a table-dispatched call of `nbytes` may explore (every other lossless path a CUDA
    rank runs, where the table's is lossless), and those of them the table has not settled there."""
    path = table.path_for(nbytes)
    every = frozenset(p for p in LOSSLESS if p is not path and p in CUDA_PATHS) if path in LOSSLESS else frozenset()
    mask = table.settled[bucket_index(nbytes)] if table.settled else 0
    return every, frozenset(p for p in every if not mask >> PATH_CODES[p] & 1)


CALLS = st.lists(
    st.one_of(
        st.tuples(st.just("table"), st.sampled_from(SIZES)),
        st.tuples(st.just("table"), st.sampled_from(SIZES)),
        # A capture is replayed as recorded: never explored (the service path cannot be captured).
        st.tuples(st.just("captured"), st.sampled_from([n for n in SIZES if TABLE.path_for(n) is not Path.SERVICE])),
        st.tuples(st.just("forced"), st.sampled_from(SIZES)),
    ),
    max_size=400,
)
SETTLED = st.lists(st.sets(st.sampled_from(LOSSLESS)), min_size=len(SIZES), max_size=len(SIZES)).map(
    lambda buckets: tuple(sum(1 << PATH_CODES[p] for p in settled) for settled in buckets)
)
EVERY_SIZE_AGAIN = [("table", n) for n in SIZES] * 12 + [("captured", 30 * KIB), ("forced", 30 * KIB)] * 3


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@example(explore_period=1, sample_period=1 << 20, settled=(), calls=EVERY_SIZE_AGAIN)
@example(explore_period=3, sample_period=1 << 20, settled=(0,) * 3 + (1 << 2,) + (0,) * 7, calls=EVERY_SIZE_AGAIN)
@given(explore_period=st.integers(1, 4), sample_period=st.integers(1, 5), settled=SETTLED, calls=CALLS)
def test_each_rival_of_a_bucket_is_timed_within_explore_period_calls_per_rival(
    explore_period, sample_period, settled, calls
):
    """native/dispatch.h's exploration, as a property of any calls: every explore_period-th
    table-dispatched call of a size bucket runs a rival instead, so that each rival the daemon has
    not settled there is timed within N = explore_period x (those rivals) of the bucket's calls;
    where it settled them all, N = explore_period x 256 x (rivals). A settled rival is left out
    while another is open; the service path's range (no lossless rival) explores nothing; calls of
    other buckets, captured calls and forced ones count for nothing there. Every sample_period-th
    call is timed, every explored one, and the bucket's call after an explore of an open rival (on
    the table's own path, beside it)."""
    table = dataclasses.replace(TABLE, settled=settled)
    dispatcher = Dispatcher(table, CUDA_PATHS, "cuda", explore_period=explore_period, sample_period=sample_period)
    explored: dict[int, list[Path | None]] = {}  # per bucket, each table-dispatched call's rival or None
    paired: dict[int, bool] = {}
    for number, (kind, nbytes) in enumerate(calls, 1):
        decision = dispatcher.decide(nbytes, forced="dma" if kind == "forced" else None, capturing=kind == "captured")
        by_period = (number - 1) % sample_period == 0
        if kind != "table":
            assert (decision.explored, decision.sampled) == (False, by_period), (number, kind, decision)
            continue
        bucket = bucket_index(nbytes)
        every, open_ = rivals(table, nbytes)
        history = explored.setdefault(bucket, [])
        history.append(decision.path if decision.explored else None)
        period = explore_period if open_ else explore_period * REFRESH
        assert decision.explored == (bool(every) and len(history) % period == 0), (number, nbytes, decision)
        if decision.explored:
            assert decision.path in (open_ or every) and decision.sampled, (number, nbytes, decision)
        else:
            assert decision.path is table.path_for(nbytes), (number, nbytes, decision)
            assert decision.sampled == (by_period or paired.get(bucket, False)), (number, nbytes, decision)
        paired[bucket] = decision.explored and bool(open_)
    for bucket, history in explored.items():
        every, open_ = rivals(table, SIZES[bucket])
        timed = open_ or every
        within = (explore_period if open_ else explore_period * REFRESH) * len(timed)
        for start in range(len(history) - within + 1):
            window = set(history[start : start + within])
            assert timed <= window, f"bucket {bucket}: {sorted(timed - window)} not timed in calls {start + 1}.."


@pytest.mark.parametrize("explore_period", [1, 3])
def test_a_bucket_whose_rivals_are_all_settled_explores_once_in_explore_period_x_256_calls(explore_period):
    """Both of oneshot's rivals settled at 16..64 KiB: only every (explore_period x 256)-th call
    there explores, the least timed of all, each within two such; nothing beside it is timed."""
    masks = (0,) * 3 + (1 << PATH_CODES[Path.TWOSHOT] | 1 << PATH_CODES[Path.DMA],)
    table = dataclasses.replace(TABLE, settled=masks)
    dispatcher = Dispatcher(table, CUDA_PATHS, "cuda", explore_period=explore_period, sample_period=1 << 20)
    refresh = explore_period * REFRESH
    decided = [dispatcher.decide(30 * KIB, forced=None, capturing=False) for _ in range(4 * refresh)]
    explored = [(number, d.path) for number, d in enumerate(decided, 1) if d.explored]
    assert [number for number, _ in explored] == [refresh, 2 * refresh, 3 * refresh, 4 * refresh]
    assert all({a, b} == {Path.TWOSHOT, Path.DMA} for (_, a), (_, b) in zip(explored, explored[1:], strict=False))
    assert [number for number, d in enumerate(decided, 1) if d.sampled and not d.explored] == [1]


TABLES = (
    TABLE,
    dataclasses.replace(TABLE, epoch=2, settled=(0,) * 3 + (1 << PATH_CODES[Path.TWOSHOT],)),
    DispatchTable(epoch=3, range_max=(32 * KIB, (2 << 20) - 1, 64 << 20), range_paths=TABLE.range_paths),
    DispatchTable(epoch=4, range_max=(1 << 20,), range_paths=(Path.TWOSHOT, Path.SERVICE), settled=(6,) * 11),
)
STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("call"),
            st.sampled_from(SIZES + (0, 32 * KIB + 1, (1 << 20) + 1)),
            st.booleans(),
            st.sampled_from([None, None, None, "oneshot", "dma", "ring"]),
        ),
        st.tuples(st.just("table"), st.sampled_from(range(len(TABLES)))),
        st.tuples(st.just("undo")),
    ),  # fmt: skip
    max_size=300,
)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(explore_period=st.integers(0, 4), sample_period=st.integers(1, 5), switch_period=st.integers(0, 3), steps=STEPS)
def test_ranks_fed_the_same_calls_decide_the_same(explore_period, sample_period, switch_period, steps):
    """What makes exploring safe: two ranks' Dispatchers given the same calls, tables and undos
    in the same order decide every call alike (path, wire, explored, timed), refuse the same ones,
    and are due to switch tables after the same calls. The two take each step in turn, in one
    process, so that neither can lean on state the other left."""
    periods = {"explore_period": explore_period, "sample_period": sample_period, "switch_period": switch_period}
    ranks = [Dispatcher(TABLE, CUDA_PATHS, "cuda", **periods) for _ in range(2)]
    decided: list[list] = [[], []]
    for step in steps:
        for dispatcher, seen in zip(ranks, decided, strict=True):
            if step[0] == "table":
                dispatcher.table = TABLES[step[1]]
            elif step[0] == "undo":
                dispatcher.native.undo()
            else:
                _, nbytes, capturing, forced = step
                try:
                    d = dispatcher.decide(nbytes, forced=forced, capturing=capturing)
                    seen.append((d.path, d.wire, d.explored, d.sampled, dispatcher.switch_due(capturing)))
                except InvalidArgumentError as error:
                    seen.append(("refused", str(error)))
    assert decided[0] == decided[1]
    assert ranks[0].calls == ranks[1].calls


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
