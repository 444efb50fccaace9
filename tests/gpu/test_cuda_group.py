"""CUDA groups end to end: rank processes join through the real daemon (sharing one GPU where
there is only one), and every path is checked bit for bit, eagerly and under graph replay, along
with what happens when a peer dies or never comes."""

import multiprocessing as mp
import signal

import pytest

import cuda_ranks
from conftest import free_port, kill_at_work
from nodecomm import _native

pytestmark = pytest.mark.gpu

CASES = [
    ("float32", 1),
    ("float32", 1001),
    ("float16", 7),
    ("bfloat16", (1 << 20) + 3),
    ("float32", (2 << 20) - 5),
    ("bfloat16", 12_345_679),
    ("float32", 16 << 20),  # 64 MiB: eight slot-sized pieces
]


@pytest.fixture
def cuda_daemon(make_daemon):
    return make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "60")


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_path_is_bit_exact_eager_and_in_graphs(cuda_daemon, spawn_ranks, world_size):
    group = spawn_ranks(
        cuda_ranks.exact_everywhere, world_size, world_size, cuda_daemon.socket, CASES, world_size - 1, timeout=900
    )
    assert group.values() == {r: [] for r in range(world_size)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_legacy_ipc_buffers_are_bit_exact_too(make_daemon, spawn_ranks, world_size):
    daemon = make_daemon(
        "--allow-shared-devices", "true", "--cuda-memory", "legacy", "--operation-timeout-seconds", "60"
    )  # fmt: skip
    group = spawn_ranks(
        cuda_ranks.exact_everywhere, world_size, world_size, daemon.socket, CASES[:4], world_size - 1, timeout=900
    )
    assert group.values() == {r: [] for r in range(world_size)}
    assert '"memory_kind": "CUDA_IPC_LEGACY"' in daemon.log()


def test_killed_rank_makes_the_others_raise(cuda_daemon, spawn_ranks):
    report = mp.get_context("spawn").Queue()
    group = spawn_ranks(cuda_ranks.reduce_until_error, 3, 3, cuda_daemon.socket, report, timeout=180)
    _, results = kill_at_work(group, report, timeout=120)
    for rank in (0, 2):
        status, (name, message, _) = results[rank]
        assert status == "ok" and name == "PeerLostError", message
        assert "rank 1" in message


@pytest.mark.parametrize("call", ["all_reduce", "barrier"])
def test_peer_that_never_comes_times_out(make_daemon, spawn_ranks, call):
    daemon = make_daemon("--allow-shared-devices", "true", "--operation-timeout-seconds", "1")
    results = spawn_ranks(cuda_ranks.wait_alone, 2, 2, daemon.socket, call, timeout=120).values()
    name, message = results[0]
    assert name == "PeerLostError" and "rank 0 timed out waiting for rank 1" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_close_waits_for_queued_work_before_leaving(cuda_daemon, spawn_ranks, world_size):
    results = spawn_ranks(cuda_ranks.close_with_work_queued, world_size, world_size, cuda_daemon.socket, timeout=300)
    assert results.values() == {r: [] for r in range(world_size)}


def test_offsets_past_two_gib(make_daemon, spawn_ranks):
    import torch

    count = (1 << 30) + 8  # bf16: 2 GiB + 16 bytes per rank, in one slot
    if torch.cuda.mem_get_info(0)[0] < (48 << 30):
        pytest.skip("needs about 48 GiB of free GPU memory")
    daemon = make_daemon(
        "--allow-shared-devices", "true", "--max-capacity-bytes", "3GiB", "--max-reserved-bytes", "16GiB",
        "--max-reserved-bytes-per-caller", "16GiB",
    )  # fmt: skip
    results = spawn_ranks(cuda_ranks.large_offsets, 2, 2, daemon.socket, count, timeout=600).values()
    assert results == {r: {"oneshot": 0, "twoshot": 0, "dma": 0} for r in range(2)}


def test_the_nccl_range_runs_natively_through_the_engines_group(cuda_daemon, spawn_ranks):
    """The table's NCCL sizes go through the group given as nccl_group from the lane, with no
    Python: exact, counted on the nccl path, and timed (the daemon gets samples of it). On one GPU,
    which NCCL refuses to two ranks, a gloo group stands in: the same torch.distributed call."""
    import os

    import torch

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    calls = 70  # each rank's lane calls 1 and 65 of its 74 are sampled (timing_sample_period 64)
    metrics = {
        'nodecomm_operations_total{group="with-nccl",op="all_reduce",path="nccl"}': 2 * (4 + calls),
        f'nodecomm_sampled_operations_total{{op="all_reduce",path="nccl",uid="{os.getuid()}"}}': 4,
    }
    url = f"http://127.0.0.1:{cuda_daemon.metrics_port}/metrics"
    results = spawn_ranks(
        cuda_ranks.nccl_fallback, 2, 2, cuda_daemon.socket, free_port(), backend, calls, metrics, url, timeout=300
    ).values()
    for value in results.values():
        assert value["table"][0][1] == 256 << 10 and any(path == "nccl" for _, _, path in value["table"])
        assert value["exact"] == [True] * 4
        assert value["python"] == ["communicator.py:all_reduce"], value["python"]
    seen = results[0]["metrics"]
    assert all(seen[series] >= value for series, value in metrics.items()), (seen, metrics)


@pytest.mark.parametrize("nccl", [False, True])
def test_failed_peer_check_leaves_only_nccl(cuda_daemon, nccl):
    """The daemon's verdict when one rank reports a failed probe: without an NCCL group every
    rank gets UNIMPLEMENTED naming the rank and its reason; with one, a table that sends every
    size to NCCL. (The probe itself runs in every connect of the tests above.)"""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from conftest import join_request, stub_for
    from nodecomm import _native
    from nodecomm.v1 import control_pb2 as pb

    gpu = _native.cuda_device_uuids()[0]
    channel, stub = stub_for(cuda_daemon)
    with channel, ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(stub.Join, join_request(group="probe", rank=r, device=gpu, nccl=nccl, timeout=20), timeout=30)
            for r in range(2)
        ]
        group_id = joins[0].result().group_id

        def report(rank: int, ok: bool):
            message = pb.PeerCheckReport(
                group="probe", group_id=group_id, rank=rank, ok=ok, detail="" if ok else "simulated: no write", stage=1
            )
            return stub.CheckPeers(message, timeout=30)

        verdicts = [pool.submit(report, 0, True), pool.submit(report, 1, False)]
        for verdict in verdicts:
            if nccl:
                result = verdict.result()
                assert not result.peer_memory_ok and "rank 1: simulated: no write" in result.reason
                assert [r.path for r in result.thresholds.ranges] == [pb.NCCL]
            else:
                with pytest.raises(grpc.RpcError) as raised:
                    verdict.result()
                assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "rank 1: simulated: no write" in raised.value.details()
                assert "no NCCL group" in raised.value.details()


# (what they disagree on, rank 0's value, rank 1's value); ranks past 1 do as rank 0 does.
DISAGREEMENTS = {
    "count_pushed": ("all_reduce's element count", "has 4096", "has 4100"),
    "count_pulled": ("all_reduce's element count", "has 300000", "has 300001"),
    "count_twoshot": ("all_reduce's element count", "has 300000", "has 300001"),
    "count_dma": ("all_reduce's element count", "has 1048576", "has 1048577"),
    "count_pieces": ("all_reduce's element count", "has 5242880", "has 6291456"),
    "count_zero": ("all_reduce's element count", "has 16", "has 0"),
    "dtype": ("all_reduce's dtype", "has float32", "has float16"),
    "dtype_same_bytes": ("all_reduce's dtype", "has bfloat16", "has float16"),
    "path_pushed_twoshot": ("all_reduce's path", "has oneshot", "has twoshot"),
    "path_pushed_dma": ("all_reduce's path", "has oneshot", "has dma"),
    "path_pulled_twoshot": ("all_reduce's path", "has oneshot", "has twoshot"),
    "path_twoshot_dma": ("all_reduce's path", "has twoshot", "has dma"),
    "wire_pushed": ("all_reduce's wire format", "has lossless", "has int8"),
    "wire_twoshot": ("all_reduce's wire format", "has int8", "has fp8"),
    "wire_dma": ("all_reduce's wire format", "has fp8", "has lossless"),
    "collective": ("the collective", "calls all_reduce", "calls all_gather"),
    "barrier": ("the collective", "calls all_reduce", "calls barrier"),
    "gather_bytes": ("all_gather's byte count", "has 16", "has 20"),
    "topk_rows": ("top-k stage's row count", "has 8", "has 12"),
    "norm_shape_oneshot": ("all_reduce_rms_norm's shape (rows x hidden)", "has 4 x 1024", "has 8 x 512"),
    "norm_shape_twoshot": ("all_reduce_rms_norm's shape (rows x hidden)", "has 4 x 1024", "has 8 x 512"),
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_all_get_group_mismatch_and_nothing_is_written(cuda_daemon, spawn_ranks, world_size):
    """Rank 1 passes another count, dtype, path, shape or collective, on every kernel path and across
    kinds of kernel (pushed lines against barriers): every rank's next call raises the same
    GroupMismatchError, naming each rank's value, no output is written, and the group stays
    aborted (a CUDA group cannot be brought back into step from the device)."""
    cases = list(DISAGREEMENTS)
    results = spawn_ranks(cuda_ranks.disagree, world_size, world_size, cuda_daemon.socket, cases, timeout=600)
    for rank, outcome in results.values().items():
        assert list(outcome) == cases
        for case, (name, message, untouched, again) in outcome.items():
            field, usual, odd = DISAGREEMENTS[case]
            values = ", ".join(f"rank {r} {odd if r == 1 else usual}" for r in range(world_size))
            assert name == "GroupMismatchError", (rank, case, name, message)
            assert f"disagree on {field}: {values}; nothing was written to the output" in message, (rank, case, message)
            assert untouched and again, (rank, case, untouched, again)


@pytest.mark.parametrize("ending", ["killed", "left"])
@pytest.mark.parametrize(
    "paths",
    [["oneshot"], ["oneshot", "oneshot/pull", "twoshot"], ["oneshot", "oneshot/pull", "twoshot", "dma"]],
    ids=["pushed", "kernels", "every-path"],
)
def test_an_abort_drains_a_stream_of_queued_collectives(cuda_daemon, spawn_ranks, paths, ending):
    """200 all-reduces queued on rank 0's stream wait for rank 1, which is then killed or leaves:
    the stream drains once the group is aborted, every queued kernel giving up (the time is
    printed, for the record: a bench figure, not an assertion). A killed rank's CUDA context is
    torn down meanwhile on the GPU the ranks share here; one that leaves lives on."""
    context = mp.get_context("spawn")
    report, leave = context.Queue(), (context.Event() if ending == "left" else None)
    group = spawn_ranks(cuda_ranks.drain_after_abort, 2, 2, cuda_daemon.socket, 200, paths, report, leave, timeout=180)
    assert sorted(report.get(timeout=120) for _ in range(2)) == ["away", "queued"]
    if leave is None:
        group.kill(1, signal.SIGKILL)
    else:
        leave.set()
    status, outcome = group.results()[0]
    assert status == "ok" and "drain_s" in outcome, outcome
    # The abort is rank 1's doing, and the first kernel recorded that it gave up for it (a kernel
    # that took rank 1's absence for another call would abort the group itself, as a mismatch).
    expected = _native.AbortReason.PEER_LOST if ending == "killed" else _native.AbortReason.PEER_LEFT
    assert (outcome["reason"], outcome["record"]) == (expected, _native.KernelError.ABORTED), outcome
    print(
        f"\n200 queued all-reduces over {paths}, rank 1 {ending}: drained {outcome['drain_s'] * 1e3:.3f} ms after "
        f"the abort (the waiting kernel noticed it after {outcome['noticed_s'] * 1e3:.3f} ms)"
    )
