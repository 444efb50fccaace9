"""The CUDA all-reduce kernels (oneshot, twoshot) across rank processes sharing one GPU, on VMM
buffers passed as descriptors: bit-exact against the fp32 rank-order reference, eager launches
back to back alternating algorithms, CUDA graph replays with a delayed rank, and a peer that
never comes."""

import multiprocessing as mp
import os
import tempfile

import pytest

import descriptor_passing
from nodecomm import _native

pytestmark = pytest.mark.gpu

SLOT_BYTES = 8 << 20
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
ALGORITHMS = {"oneshot": 1, "twoshot": 2}


def _device_for(rank: int) -> int:
    """One rank per GPU where there are several; ranks share the GPU where there is one."""
    import torch

    return rank % torch.cuda.device_count()


def _rank_program(rank, world_size, path, size, cases, delayed_rank, results):
    import torch

    import ranks

    device = _device_for(rank)
    torch.cuda.set_device(device)
    buffers = descriptor_passing.receive_and_map(path, world_size, size, device, results)
    stream = torch.cuda.current_stream().cuda_stream
    problems = []

    def reduce(x, out, algorithm, on=stream):
        code = DTYPE_CODES[str(x.dtype).removeprefix("torch.")]
        _native.cuda_all_reduce(
            buffers, rank, SLOT_BYTES, x.data_ptr(), out.data_ptr(), x.numel(), code, ALGORITHMS[algorithm], 30.0, on
        )

    # Eager: every case through both algorithms, then 8 launches back to back (alternating
    # algorithms) with no host synchronisation.
    for seed, (dtype_name, count) in enumerate(cases):
        dtype = ranks.DTYPES[dtype_name]
        x = ranks.rank_input(rank, count, dtype, seed).cuda()
        expected = ranks.reference_sum(world_size, count, dtype, seed).cuda()
        for algorithm in ALGORITHMS:
            out = torch.empty_like(x)
            reduce(x, out, algorithm)
            torch.cuda.synchronize()
            if not torch.equal(out.view(ranks.BITS[dtype]), expected.view(ranks.BITS[dtype])):
                problems.append(f"eager {algorithm} {dtype_name} count={count} differs")
    count, dtype = 40_003, torch.bfloat16
    inputs = [ranks.rank_input(rank, count, dtype, 100 + k).cuda() for k in range(8)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(8)]
    for k in range(8):
        reduce(inputs[k], outputs[k], "twoshot" if k % 2 else "oneshot")
    torch.cuda.synchronize()
    for k in range(8):
        expected = ranks.reference_sum(world_size, count, dtype, 100 + k).cuda()
        if not torch.equal(outputs[k].view(torch.int16), expected.view(torch.int16)):
            problems.append(f"back-to-back launch {k} differs")

    # Graph: captured once (one rank sleeps inside it; both algorithms), replayed 8 times back
    # to back; each replay's outputs are copied out on the stream and checked after one sync.
    static_in = torch.empty_like(inputs[0])
    static_out = {algorithm: torch.empty_like(inputs[0]) for algorithm in ALGORITHMS}
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):
        with torch.cuda.graph(graph, stream=capture_stream):
            if rank == delayed_rank:
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles, inside the graph
            for algorithm, out in static_out.items():
                reduce(static_in, out, algorithm, capture_stream.cuda_stream)
    history = [{a: torch.empty_like(o) for a, o in static_out.items()} for _ in range(8)]
    for k in range(8):
        static_in.copy_(inputs[k])
        graph.replay()
        for algorithm, out in static_out.items():
            history[k][algorithm].copy_(out)
    torch.cuda.synchronize()
    for k in range(8):
        expected = ranks.reference_sum(world_size, count, dtype, 100 + k).cuda()
        for algorithm, got in history[k].items():
            if not torch.equal(got.view(torch.int16), expected.view(torch.int16)):
                problems.append(f"graph replay {k} {algorithm} differs")
    record = _native.cuda_read_error(buffers[rank])
    if record[0] != 0:
        problems.append(f"error record {record}")
    results.put(("done", rank, problems))


def _stalled_program(rank, world_size, path, size, results):
    import torch

    device = _device_for(rank)
    torch.cuda.set_device(device)
    buffers = descriptor_passing.receive_and_map(path, world_size, size, device, results)
    if rank == 1:
        results.put(("done", rank, None))  # never launches
        return
    x = torch.ones(1024, device="cuda")
    out = torch.empty_like(x)
    _native.cuda_all_reduce(
        buffers, 0, SLOT_BYTES, x.data_ptr(), out.data_ptr(), 1024, 1, 2, 0.5, torch.cuda.current_stream().cuda_stream
    )
    results.put(("done", rank, _native.cuda_read_error(buffers[0])))


def _run(target, world_size, *args):
    size = _native.cuda_vmm_rounded_size(0, _native.cuda_buffer_bytes(SLOT_BYTES))
    allocations = [_native.cuda_vmm_allocate(_device_for(r), size) for r in range(world_size)]
    context = mp.get_context("spawn")
    results = context.Queue()
    directory = tempfile.mkdtemp()
    paths = [os.path.join(directory, f"rank{r}.sock") for r in range(world_size)]
    processes = [
        context.Process(target=target, args=(r, world_size, paths[r], size, *args, results)) for r in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        for _ in range(world_size):
            assert results.get(timeout=120) == "listening"
        for path in paths:
            descriptor_passing.send(path, [fd for fd, _, _ in allocations])
        outcome = {}
        for _ in range(world_size):
            _, rank, value = results.get(timeout=300)
            outcome[rank] = value
        for process in processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        return outcome
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for fd, address, allocated in allocations:
            os.close(fd)
            _native.cuda_vmm_unmap(address, allocated)


CASES = [("float32", 1), ("float32", 1001), ("float16", 7), ("bfloat16", (1 << 20) + 3), ("float32", (2 << 20) - 5)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_bit_exact_eager_and_graph(world_size):
    outcome = _run(_rank_program, world_size, CASES, world_size - 1)
    assert all(problems == [] for problems in outcome.values()), outcome


def test_missing_peer_times_out_with_a_record():
    outcome = _run(_stalled_program, 2)
    code, waited_for, epoch = outcome[0]
    assert (code, waited_for, epoch) == (1, 1, 1)


def _large_offsets_program(rank, world_size, path, size, slot, count, results):
    """bf16 payload past 2 GiB: element offsets beyond 2^31 / 2. Inputs are small integers whose
    sums are exact, and vary with the position, so a truncated offset shows as wrong values."""
    import torch

    device = _device_for(rank)
    torch.cuda.set_device(device)
    buffers = descriptor_passing.receive_and_map(path, world_size, size, device, results)
    positions = torch.arange(count, device="cuda", dtype=torch.int64) % 251
    x = (positions + rank).to(torch.bfloat16)
    expected = (positions * world_size + world_size * (world_size - 1) // 2).to(torch.bfloat16)
    del positions
    wrong = {}
    for algorithm, code in ALGORITHMS.items():
        out = torch.empty_like(x)
        stream = torch.cuda.current_stream().cuda_stream
        _native.cuda_all_reduce(buffers, rank, slot, x.data_ptr(), out.data_ptr(), count, 3, code, 60.0, stream)
        torch.cuda.synchronize()
        wrong[algorithm] = int((out.view(torch.int16) != expected.view(torch.int16)).sum())
        del out
    results.put(("done", rank, wrong))


def test_offsets_past_two_gib():
    import torch

    count = (1 << 30) + 5  # bf16: 2 GiB + 10 bytes per rank
    needed = 2 * count * (8 + 3 * 2 + 2)  # per rank: int64 positions, input, output, expected; buffers
    if torch.cuda.mem_get_info(0)[0] < needed + (8 << 30):
        pytest.skip(f"needs about {needed >> 30} GiB of free GPU memory")
    slot = count * 2
    size = _native.cuda_vmm_rounded_size(0, _native.cuda_buffer_bytes(slot))
    allocations = [_native.cuda_vmm_allocate(_device_for(r), size) for r in range(2)]
    context = mp.get_context("spawn")
    results = context.Queue()
    directory = tempfile.mkdtemp()
    paths = [os.path.join(directory, f"rank{r}.sock") for r in range(2)]
    processes = [
        context.Process(target=_large_offsets_program, args=(r, 2, paths[r], size, slot, count, results))
        for r in range(2)
    ]
    for process in processes:
        process.start()
    try:
        for _ in range(2):
            assert results.get(timeout=120) == "listening"
        for path in paths:
            descriptor_passing.send(path, [fd for fd, _, _ in allocations])
        outcome = {}
        for _ in range(2):
            _, rank, wrong = results.get(timeout=300)
            outcome[rank] = wrong
        assert outcome == {0: {"oneshot": 0, "twoshot": 0}, 1: {"oneshot": 0, "twoshot": 0}}
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        for fd, address, allocated in allocations:
            os.close(fd)
            _native.cuda_vmm_unmap(address, allocated)
