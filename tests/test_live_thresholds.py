"""Live recalibration: synthetic timing streams through real sessions move a CPU group's boundary
(every rank switches at the same call), and timings within the margin move nothing. The daemons
of the synthetic streams neither explore nor sample, so that the ranks' own calls add no timings."""

import ranks
from nodecomm.service.calibration.stored import CalibrationStore
from nodecomm.service.config import DaemonConfig
from nodecomm.tools.convergence_bench import every_size_to

SIXTEEN_KIB = 16 << 10
SYNTHETIC = ("--explore-period", "0", "--timing-sample-period", "100000")


def _stream(oneshot_seconds: float, twoshot_seconds: float, count: int = 6) -> list:
    return [("oneshot", SIXTEEN_KIB, oneshot_seconds)] * count + [("twoshot", SIXTEEN_KIB, twoshot_seconds)] * count


def _sampled_by_path(daemon) -> dict[str, float]:
    """The daemon's nodecomm_sampled_operations_total now, by path."""
    return {
        line.split('path="')[1].split('"')[0]: float(line.split()[-1])
        for line in daemon.metrics_text().splitlines()
        if line.startswith("nodecomm_sampled_operations_total{")
    }


def test_a_faster_path_moves_the_boundary_for_every_rank_at_once(make_daemon, spawn_ranks):
    daemon = make_daemon(*SYNTHETIC, "--table-switch-period", "16", "--live-min-samples", "4")
    # The 16 KiB bucket (4097..16384 bytes) goes to oneshot by default (up to 32 KiB); twoshot is
    # reported 10x faster there, so oneshot must stop below the bucket.
    results = spawn_ranks(ranks.live_switch, 2, 2, daemon.socket, _stream(100e-6, 10e-6), 200, timeout=120).values()
    assert results[0]["switched_at"] is not None and results[0]["switched_at"] % 16 == 15
    assert results[0] == results[1]
    assert results[0]["rows"] == [(0, 4096, "oneshot"), (4097, None, "twoshot")]
    assert results[0]["boundary"] == "oneshot_max_bytes=4KiB (calibrated)"
    assert 'nodecomm_threshold_changes_total{boundary="oneshot_max_bytes"} 1.0' in daemon.metrics_text()
    assert "boundary moved by live timings" in daemon.log()


def test_a_bucket_the_boundary_splits_moves_on_the_side_its_sizes_are(make_daemon, spawn_ranks):
    """The 64 KiB bucket (16385..65536 bytes) straddles oneshot_max_bytes (32 KiB); timings at
    24 KiB, in its oneshot part, where twoshot wins, move oneshot down to the bucket's start (a
    split bucket moved nothing before: a fresh table's loss there never went away)."""
    daemon = make_daemon(*SYNTHETIC, "--table-switch-period", "16", "--live-min-samples", "4")
    stream = [("oneshot", 24 << 10, 100e-6)] * 6 + [("twoshot", 24 << 10, 10e-6)] * 6
    results = spawn_ranks(ranks.live_switch, 2, 2, daemon.socket, stream, 200, timeout=120).values()
    assert results[0]["switched_at"] is not None and results[0] == results[1]
    assert results[0]["rows"] == [(0, 16384, "oneshot"), (16385, None, "twoshot")]


def test_timings_within_the_margin_move_nothing(make_daemon, spawn_ranks):
    daemon = make_daemon(*SYNTHETIC, "--table-switch-period", "16", "--live-min-samples", "4")
    results = spawn_ranks(ranks.live_switch, 2, 2, daemon.socket, _stream(100e-6, 97e-6), 100, timeout=120).values()
    for result in results.values():
        assert result["switched_at"] is None
        assert result["rows"] == [(0, 32768, "oneshot"), (32769, None, "twoshot")]
    assert "nodecomm_threshold_changes_total{" not in daemon.metrics_text()


def test_an_override_is_never_moved(make_daemon, spawn_ranks):
    daemon = make_daemon(
        *SYNTHETIC, "--table-switch-period", "16", "--live-min-samples", "4", "--oneshot-max-bytes", "32KiB"
    )
    results = spawn_ranks(ranks.live_switch, 2, 2, daemon.socket, _stream(100e-6, 10e-6), 100, timeout=120).values()
    assert all(
        r["switched_at"] is None and r["boundary"] == "oneshot_max_bytes=32KiB (override)" for r in results.values()
    )


def test_exploration_times_the_other_path_beside_the_tables_and_keeps_the_bits(make_daemon, spawn_ranks):
    """16 KiB goes to oneshot by the table; every 2nd call of its bucket runs twoshot instead and is
    timed, and so is the call after it, on oneshot (and the first, by the sample period): 20 and 20
    per rank in 40 calls, fewer than the 256 after which the ranks would take up a table that
    settled twoshot."""
    daemon = make_daemon("--explore-period", "2", "--timing-sample-period", "100000", "--live-margin", "0.95")
    assert spawn_ranks(ranks.reduce_many, 2, 2, daemon.socket, 4096, 40, timeout=120).values() == {0: True, 1: True}
    sampled = _sampled_by_path(daemon)
    assert sampled == {"oneshot": 40.0, "twoshot": 40.0}


def test_a_group_that_keeps_its_table_does_not_explore(make_daemon, spawn_ranks):
    """As above, with the table switches off (the engine slot's default): what exploring finds could
    never reach the group, so no call runs a rival (each would be timed) and only the sample
    period's first call is timed."""
    daemon = make_daemon("--explore-period", "2", "--timing-sample-period", "100000", "--live-margin", "0.95")
    done = spawn_ranks(ranks.reduce_many, 2, 2, daemon.socket, 4096, 40, False, timeout=120).values()
    assert done == {0: True, 1: True}
    sampled = _sampled_by_path(daemon)
    assert sampled == {"oneshot": 2.0}


# Calls for a wrong table to move and the ranks to take it up: the daemon's move comes from
# exploration's evidence, and the ranks switch a switch period or two after it is offered (on a
# loaded CI machine a move at call ~1,900 came too late for 2,000 calls).
CALLS = 2600


def test_a_wrong_stored_table_converges_within_2600_calls_and_every_rank_switches_at_the_same_call(
    make_daemon, spawn_ranks, tmp_path
):
    """A stored calibration of this machine sends every size to one path, and at 1 MiB the other
    is faster on the ranks' own timings: with exploration as the daemon has it by default, the table
    moves to the faster path and the ranks take it up within 2,600 calls, on the daemon's own
    evidence (its log), every rank switching tables at the same calls. (It may move back later: on a loaded 2-core CI machine the
    evidence changed sides within one run, and the table followed it.) Which path is faster there
    depends on the run: on the 2-core VM twoshot took 110 us against oneshot's 121 while exploring in some runs,
    and oneshot ~500 us against twoshot's ~610 in others (ranks pinned to cores of their own or
    not), the bench's hot loop showing the same two modes. So the table starts on oneshot and,
    where the evidence settles that twoshot is the slower (the table was right), on twoshot, and
    so on: within four daemons one table must move."""
    for attempt, stored in enumerate(("oneshot", "twoshot") * 2):
        state = tmp_path / str(attempt)
        CalibrationStore(str(state)).save(every_size_to(stored, "cpu"))
        daemon = make_daemon("--state-dir", str(state), "--explore-period", str(DaemonConfig.explore_period))
        results = spawn_ranks(ranks.converge, 2, 2, daemon.socket, 1 << 20, CALLS, timeout=300).values()
        assert results[0]["switches"] == results[1]["switches"], results
        if '"msg": "boundary moved by live timings"' in daemon.log():
            break
        assert '"msg": "exploration settled"' in daemon.log(), (stored, results[0], daemon.log()[-3000:])
    faster = "twoshot" if stored == "oneshot" else "oneshot"
    moved = [call for call, _, path in results[0]["switches"] if path == faster]
    assert moved and moved[0] < CALLS, (results[0], daemon.log()[-3000:])
    assert f'"winner": "{faster}"' in daemon.log()
    assert results[0]["origin"].startswith("live timings of group 'converge', moved from: " + str(state))


def test_a_backlog_of_native_timings_reaches_the_daemon_without_ending_the_session(make_daemon, spawn_ranks):
    """2,000 timed native all-reduces with no Python call between them leave 2,000 samples held;
    the session's next flush sends the newest 128, within the 256 a message may carry, and the
    session lives on (a flush of all of them once ended it: "the daemon connection was lost")."""
    daemon = make_daemon("--timing-sample-period", "1", "--table-switch-period", "1000000")
    results = spawn_ranks(ranks.sample_backlog, 2, 2, daemon.socket, 2000, timeout=120).values()
    assert results == {0: {"lost": None, "last": [2.0, 2.0]}, 1: {"lost": None, "last": [2.0, 2.0]}}, results
    sampled = sum(
        float(line.split()[-1])
        for line in daemon.metrics_text().splitlines()
        if line.startswith("nodecomm_sampled_operations_total{")
    )
    assert 2 * 128 <= sampled < 2 * 2000, sampled
