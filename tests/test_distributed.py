"""The "nodecomm" torch.distributed backend, launched the way engines launch it: torchrun."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

import distributed_ranks
from conftest import free_port, kill_at_work
from nodecomm.distributed import _node_entry
from nodecomm.errors import GroupMismatchError

RANKS = Path(__file__).parent / "distributed_ranks.py"


def test_import_registers_the_backend_for_cpu_and_cuda():
    probe = (
        "import torch.distributed as dist, nodecomm.distributed\n"
        "print(dist.Backend('nodecomm'), dist.Backend.backend_capability['nodecomm'], "
        "dist.Backend.default_device_backend_map['cpu'])"
    )
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert printed.split() == ["nodecomm", "['cpu',", "'cuda']", "gloo"]


def torchrun(ranks: int, socket: str, device: str = "cpu", environment: dict | None = None) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(RANKS), device,
    ]  # fmt: skip
    env = {**os.environ, "NODECOMM_SOCKET": socket, "OMP_NUM_THREADS": "1", **(environment or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reports(
    job: subprocess.Popen, printed: list[str] | None = None, daemons: dict[int, str] | None = None
) -> dict[int, list[str]]:
    """Every rank's problems (and in `daemons`, the daemon it used: "<kind> <socket>")."""
    output, _ = job.communicate(timeout=600)
    if printed is not None:
        printed.append(output)
    found = {}
    for line in output.splitlines():
        if line.startswith('{"rank"'):
            report = json.loads(line)
            found[report["rank"]] = report["problems"]
            if daemons is not None:
                daemons[report["rank"]] = report["daemon"]
    assert job.returncode == 0 and found, output[-6000:]
    return found


def test_every_collective_is_exact_under_torchrun_two_jobs_at_once(daemon):
    """Two jobs of 2 and 4 ranks on one daemon at the same time: each names its groups from its
    own token, so their default groups (both torch's "0") never meet. Every collective, on the
    default group and on sub-groups, sync and async, matches a reference exactly."""
    jobs = {2: torchrun(2, daemon.socket), 4: torchrun(4, daemon.socket)}
    for ranks, job in jobs.items():
        found = reports(job)
        assert sorted(found) == list(range(ranks))
        assert all(problems == [] for problems in found.values()), found


def test_killed_rank_makes_the_others_raise(daemon, spawn_ranks):
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(distributed_ranks.reduce_until_error, 3, 3, daemon.socket, free_port(), report, timeout=120)
    words, results = kill_at_work(group, report)
    assert all(word[0] == "running" for word in words), words
    for rank in (0, 2):
        status, (name, message, _) = results[rank]
        assert status == "ok"
        assert name == "PeerLostError" and "rank 1" in message, message


def test_bad_calls_get_clear_errors_and_change_nothing(daemon, spawn_ranks):
    seen = spawn_ranks(distributed_ranks.misuse, 2, 2, daemon.socket, free_port(), timeout=120).values()[0]
    assert seen["premul_sum"].startswith("UnsupportedError") and "PREMUL_SUM" in seen["premul_sum"]
    assert "ReduceOp.AVG needs a floating-point" in seen["avg_of_ints"] and "torch.int32" in seen["avg_of_ints"]
    assert "ReduceOp.BAND needs an integer or bool tensor" in seen["band_of_floats"]
    assert seen["sparse"].startswith("UnsupportedError") and "dense" in seen["sparse"]
    assert "3 rows do not split equally over 2 ranks" in seen["uneven_all_to_all"]
    assert "expected nodecomm.distributed.Options, got dict" in seen["pg_options"]
    assert seen["gather_into_other_dtype"] == (
        "InvalidArgumentError: all_gather_into_tensor: the output holds 4 torch.int32; expected world_size (2) "
        "times the input's 2, of its dtype torch.float32"
    )
    assert seen["reduce_scatter_into_other_dtype"] == (
        "InvalidArgumentError: reduce_scatter_tensor: the input holds 4 torch.float32; expected world_size (2) "
        "times the output's 2, of its dtype torch.int64"
    )
    assert seen["all_gather_wrong_size"] == (
        "InvalidArgumentError: all_gather's output list: tensor 0 holds 3 torch.float32; expected 2 "
        "torch.float32, as the input"
    )
    assert seen["still_works"] == "[2.0, 2.0, 2.0, 2.0]"
    assert "was shut down" in seen["after_destroy"]


def test_ddp_and_dtensor_tensor_parallelism_give_gloos_bits(daemon):
    assert reports(torchrun(2, daemon.socket, "workloads")) == {0: [], 1: []}


def test_mixed_backend_strings_give_each_device_its_backend(daemon):
    assert reports(torchrun(2, daemon.socket, "mixed")) == {0: [], 1: []}


def test_an_all_reduce_nobody_joins_fails_with_the_groups_timeout(daemon, spawn_ranks):
    """The native all-reduce (the C++ backend's lane) waits the group's timeout (3 s, not the
    daemon's 60 s), then raises DeadlineExceededError through torch, located and naming who."""
    seen = spawn_ranks(distributed_ranks.unanswered_all_reduce, 2, 2, daemon.socket, free_port(), 3.0, timeout=120)
    message = seen.values()[0]
    assert message.startswith("DeadlineExceededError: [group 'torch."), message
    assert "rank 0] waited 3." in message and "s for rank 1" in message, message
    print(message)


@pytest.mark.parametrize("dtype", ["float32", "int64"], ids=["native", "python"])
def test_an_abort_on_another_thread_ends_the_all_reduce_under_way(daemon, spawn_ranks, dtype):
    """The backend's abort() on another thread while an all-reduce waits for a peer (the native
    lane's, or the Python group's): the call ends at once saying why, abort() returns, and the
    next call says the group is gone. (The native call once crashed the process there, then waited
    out the group's timeout, as the Python group's did, abort() waiting with it.)"""
    seen = spawn_ranks(
        distributed_ranks.aborted_during_all_reduce, 2, 2, daemon.socket, free_port(), 20.0, dtype, timeout=180
    ).values()[0]
    print(seen)
    assert seen["first"].startswith("InvalidArgumentError: [group 'torch."), seen
    assert seen["first"].endswith("rank 0] this rank aborted the group (abort()): its calls under way end here"), seen
    assert seen["first took"] < 10.0 and seen["abort took"] < 10.0, seen  # not the group's timeout (20 s)
    assert seen["next"].startswith("InvalidArgumentError: ") and "was shut down" in seen["next"], seen


def test_an_asynchronous_operation_that_fails_fails_its_future(daemon, spawn_ranks):
    """Its future, and a then() chained on it, raise the operation's error (the group's timeout)
    through torch's C++ future, as DDP's comm hooks see it: they once returned the error as the
    value, a failed all_gather read as a successful one."""
    seen = spawn_ranks(distributed_ranks.failed_future, 2, 2, daemon.socket, free_port(), 3.0, timeout=120)
    early, waited, chained, asked = seen.values()[0]
    print(early, waited, chained, asked, sep="\n")
    assert early == "DeadlineExceededError: the operation did not finish within wait()'s 0.200 s", early
    for outcome in (waited, chained):
        assert outcome.startswith("RuntimeError: ") and "DeadlineExceededError: [group 'torch." in outcome, outcome
    # The Work itself, through the C++ backend, says so too (its exception() was once None).
    assert asked.startswith("is_success False, exception DeadlineExceededError: [group 'torch."), asked


def test_an_asynchronous_cpu_all_reduce_returns_before_its_peers_come(daemon, spawn_ranks):
    """Rank 0 all-reduces asynchronously, then sends; rank 1 receives, then all-reduces: as on
    gloo, the all-reduce runs in the background (the native lane's call, which returns once every
    rank has come, had rank 0 wait for a rank that waited for its send: both timed out)."""
    results = spawn_ranks(distributed_ranks.all_reduce_beside_a_send, 2, 2, daemon.socket, free_port(), 20.0)
    for rank, (returned_after, summed, received) in results.values().items():
        assert summed == [4.0] * 4 and received == [7.0, 7.0], (rank, summed, received)
        assert returned_after < 10.0, (rank, returned_after)  # not the group's timeout (20 s)


def test_a_send_nobody_receives_fails_with_the_groups_timeout(daemon, spawn_ranks):
    """init_process_group(timeout=5 s): a dist.send whose receive never comes raises
    DeadlineExceededError naming who never came, bounded by the group's timeout (not the
    daemon's 60 s operation timeout), and not a TypeError of the error's formatting."""
    seen = spawn_ranks(distributed_ranks.unanswered_send, 2, 2, daemon.socket, free_port(), 5.0, timeout=120).values()
    assert seen[0].startswith("DeadlineExceededError"), seen[0]
    assert "never joined" in seen[0], seen[0]
    print(seen[0])


def test_a_rank_that_ends_before_its_first_collective_is_named_at_once(daemon, spawn_ranks):
    """Rank 1 exits after init_process_group (timeout 100 s): rank 0's all-reduce fails within
    seconds with PeerLostError naming it (gloo: "Connection closed by peer"), not after the join
    timeout."""
    seen = spawn_ranks(
        distributed_ranks.a_rank_that_leaves_before_its_first_collective, 2, 2, daemon.socket, free_port(), 100.0,
        timeout=120,
    ).results()  # fmt: skip
    assert seen[1] == ("died", 0), seen
    status, message = seen[0]
    assert status == "ok" and message.startswith("PeerLostError after "), message
    assert float(message.split()[2]) < 10.0, message
    assert "global ranks [1] ended (pid " in message and "before the group formed" in message, message


def test_a_send_nobody_receives_names_the_global_ranks_and_the_daemons_cap(make_daemon, spawn_ranks):
    """In a group of global ranks [1, 2] under init_process_group(timeout=100 s), on a daemon whose
    join_timeout_seconds is 4: the error names global ranks (not the pair's own 0 and 1) and says
    that the daemon's 4 s capped the job's 100 s."""
    daemon = make_daemon("--join-timeout-seconds", "4")
    seen = spawn_ranks(
        distributed_ranks.unanswered_send_in_a_subgroup, 3, 3, daemon.socket, free_port(), 100.0, timeout=120
    ).values()
    message = seen[2]
    assert message.startswith("DeadlineExceededError"), message
    assert "the send from global rank 2 to global rank 1 (tag 0)" in message, message
    assert "global rank 2 waited 4.0 s (the daemon's join_timeout_seconds 4 s caps the 100 s asked for)" in message, (
        message
    )
    assert "global ranks [1] never joined" in message, message


def test_a_receive_from_any_source_nobody_sends_to_fails_with_the_groups_timeout(daemon, spawn_ranks):
    """init_process_group(timeout=3 s): dist.recv naming no source, with nothing sent, raises
    DeadlineExceededError after the group's timeout, saying what it waited for."""
    seen = spawn_ranks(
        distributed_ranks.unanswered_receive_from_any, 2, 2, daemon.socket, free_port(), 3.0, timeout=120
    )
    message = seen.values()[0]
    assert message.startswith("DeadlineExceededError after "), message
    assert 3.0 <= float(message.split()[2]) < 10.0, message  # the group's timeout, not the daemon's 60 s
    assert "rank 0: no rank sent it a message with tag 0 within the group's timeout (3 s)" in message, message


def test_receives_from_any_source_of_different_tags_wait_for_none_but_their_own(daemon, spawn_ranks):
    """A receive waiting for tag 1's message does not hold up one for tag 2's, which its sender
    sends first (they once took turns on one worker, and both ranks waited out the timeout), and a
    group destroyed under receives nobody answers leaves at once, each raising why (it once waited
    out the group's timeout for each in turn)."""
    seen = spawn_ranks(
        distributed_ranks.receives_from_any_of_two_tags, 2, 2, daemon.socket, free_port(), 20.0, timeout=180
    ).values()[0]
    print(seen)
    assert seen["values"] == [[1.0, 1.0], [2.0, 2.0]] and seen["sources"] == [1, 1], seen
    assert seen["pending source"] == -1, seen  # a receive from any source not yet complete
    assert seen["took"] < 20.0 and seen["left"] < 20.0, seen  # neither waited out the group's timeout
    for error in seen["errors"]:
        assert error.startswith(
            "InvalidArgumentError: rank 0: the process group was shut down (destroy_process_group "
            "or abort) while a receive from any source waited for a message with tag 7"
        ), seen


def test_asynchronous_works_are_kept_only_while_they_run(daemon, spawn_ranks):
    """The C++ backend keeps the Python group's running CPU Works so that no native all-reduce
    overtakes them; finished ones leave as the next call comes, so the list stays as long as what
    runs, and at most 1024 (before, every asynchronous Work stayed until the next CPU all-reduce,
    which this test does last)."""
    results = spawn_ranks(
        distributed_ranks.outstanding_async_works, 2, 2, daemon.socket, free_port(), 1500, timeout=180
    ).values()
    for seen in results.values():
        assert seen["right"], seen
        assert seen["after_waited"] <= 1 and seen["after_all_reduce"] == 0, seen
        assert seen["after_two_threads"] <= 2, seen
        assert seen["most"] <= 1024, seen  # past it, a new call waits for the oldest


def test_a_native_all_reduce_never_overtakes_another_threads_operation(daemon, spawn_ranks):
    """Two threads' asynchronous all-reduces issued at once, then a synchronous one: the backend
    lists the running ones in the worker's order, so the native call waits for both (the list once
    took the order the threads reached it in, and a native call that judged by the newest one
    overtook the other on one rank: 2 to 5 wrong sums in 300 rounds, each run)."""
    results = spawn_ranks(
        distributed_ranks.two_threads_then_a_native_call, 2, 2, daemon.socket, free_port(), 300, timeout=120
    ).values()
    assert results == {0: [], 1: []}, results


def test_a_node_entry_in_the_store_that_no_rank_of_nodecomm_wrote_stops_the_rank():
    """The job's store has no authentication: an entry not as _node_names writes it is named."""

    assert _node_entry("k", b'["host|/s", "boot ns", 12, 34]') == ("host|/s", "boot ns", 12, 34)
    for raw in (b"host|/s", b'["host|/s", "boot", 12]', b'["host|/s", "boot", true, 34]', b'[1, "boot", 1, 2]'):
        with pytest.raises(GroupMismatchError, match="not what a rank of nodecomm writes there"):
            _node_entry("nodecomm/node/1/0", raw)
