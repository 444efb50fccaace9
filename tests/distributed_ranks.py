"""Rank programs for the torch.distributed backend: run under torchrun (python -m
torch.distributed.run), or by the tests' spawn_ranks with torchrun's environment set."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import nodecomm
import nodecomm.distributed

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

Op = dist.ReduceOp
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def rank_input(rank: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank `rank`'s input, which every rank can compute: floats scaled per rank (the order of a sum
    matters), small integers (products stay exact), bools of varying density."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype == torch.bool:
        return torch.rand(count, generator=generator) < (0.3 + 0.2 * rank)
    if dtype.is_floating_point:
        return (torch.randn(count, generator=generator) * (1.0 + rank / 7.0) + rank * 1e-3).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (count,), generator=generator, dtype=dtype)


def reference(inputs: list[torch.Tensor], op) -> torch.Tensor:
    """The reduction in rank order 0..n-1: 16-bit floats in float32, rounded once."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        combine = {
            Op.SUM: torch.logical_or,
            Op.MAX: torch.logical_or,
            Op.PRODUCT: torch.logical_and,
            Op.MIN: torch.logical_and,
        }[op]
        total = inputs[0]
        for x in inputs[1:]:
            total = combine(total, x)
        return total
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) and op not in (Op.MIN, Op.MAX) else dtype
    total = inputs[0].to(wide)
    for x in inputs[1:]:
        x = x.to(wide)
        if op in (Op.SUM, Op.AVG):
            total = total + x
        elif op == Op.PRODUCT:
            total = total * x
        elif op == Op.MIN:
            total = torch.minimum(total, x)
        elif op == Op.MAX:
            total = torch.maximum(total, x)
        elif op == Op.BAND:
            total = total & x
        elif op == Op.BOR:
            total = total | x
        elif op == Op.BXOR:
            total = total ^ x
    if op == Op.AVG:
        total = total / len(inputs)
    return total.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in BITS:
        return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))
    return torch.equal(a, b)


def ops_for(dtype: torch.dtype) -> list:
    if dtype == torch.bool:
        return [Op.SUM, Op.MAX, Op.MIN, Op.PRODUCT]
    if dtype.is_floating_point:
        return [Op.SUM, Op.AVG, Op.MIN, Op.MAX, Op.PRODUCT]
    return [Op.SUM, Op.MIN, Op.MAX, Op.PRODUCT, Op.BAND, Op.BOR, Op.BXOR]


def check_collectives(group, ranks: list[int], device: torch.device, problems: list[str], label: str) -> None:
    """Every collective on `group` (whose members are the global `ranks`), checked exactly."""
    me, n = dist.get_rank(group), dist.get_world_size(group)

    def expect(name: str, got, want) -> None:
        if not same_bits(got, want):
            problems.append(f"{label} {name}: got {got.flatten()[:6].tolist()}, expected {want.flatten()[:6].tolist()}")

    seed = 0
    for dtype in (*FLOATS, *INTEGERS, torch.bool):
        for op in ops_for(dtype):
            for count in (1, 1001):
                seed += 1
                inputs = [rank_input(r, count, dtype, seed).to(device) for r in range(n)]
                want = reference(inputs, op)
                x = inputs[me].clone()
                dist.all_reduce(x, op=op, group=group)
                expect(f"all_reduce {dtype} {op} {count}", x, want)
                y = inputs[me].clone()
                work = dist.all_reduce(y, op=op, group=group, async_op=True)
                value = work.get_future().wait()[0]
                work.wait()
                expect(f"async all_reduce {dtype} {op} {count}", y, want)
                expect(f"async all_reduce future {dtype} {op} {count}", value, want)
    # SUM of the lossless dtypes: the bits of comm.all_reduce itself, at sizes past one slot too.
    comm = nodecomm.distributed.communicator(group, device)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for count in (0, 7, 300_001, (5 << 20) // 2 + 3):
            seed += 1
            x = rank_input(me, count, dtype, seed).to(device)
            direct = comm.all_reduce(x)
            through = x.clone()
            dist.all_reduce(through, group=group)
            expect(f"all_reduce == comm.all_reduce {dtype} {count}", through, direct)
    # Non-contiguous tensors are reduced where they lie.
    strided = torch.arange(12, dtype=torch.float32, device=device).view(3, 4).t() * (me + 1)
    dist.all_reduce(strided, group=group)
    expect(
        "all_reduce non-contiguous",
        strided.contiguous(),
        torch.arange(12.0, device=device).view(3, 4).t().contiguous() * (n * (n + 1) // 2),
    )

    for root in range(n):
        payload = rank_input(root, 33, torch.float16, 100 + root).to(device)
        b = payload.clone() if me == root else torch.zeros(33, dtype=torch.float16, device=device)
        dist.broadcast(b, src=ranks[root], group=group)
        expect(f"broadcast root {root}", b, payload)
        inputs = [rank_input(r, 17, torch.int64, 200 + root).to(device) for r in range(n)]
        r_ = inputs[me].clone()
        dist.reduce(r_, dst=ranks[root], op=Op.MAX, group=group)
        expect(f"reduce root {root}", r_, reference(inputs, Op.MAX) if me == root else inputs[me])
        s = inputs[me].to(torch.float32)
        dist.reduce(s, dst=ranks[root], group=group)
        if me == root:
            expect(f"reduce SUM root {root}", s, reference([t.float() for t in inputs], Op.SUM))
        out = [torch.empty(5, dtype=torch.int32, device=device) for _ in range(n)] if me == root else None
        dist.gather(torch.full((5,), me, dtype=torch.int32, device=device), out, dst=ranks[root], group=group)
        if me == root:
            expect(
                f"gather root {root}",
                torch.stack(out),
                torch.arange(n, dtype=torch.int32, device=device).repeat_interleave(5).view(n, 5),
            )
        pieces = [torch.full((3,), 10 * r + root, dtype=torch.float64, device=device) for r in range(n)]
        received = torch.empty(3, dtype=torch.float64, device=device)
        dist.scatter(received, pieces if me == root else None, src=ranks[root], group=group)
        expect(f"scatter root {root}", received, pieces[me])

    gathered = [torch.empty(2, 3, dtype=torch.bfloat16, device=device) for _ in range(n)]
    inputs = [rank_input(r, 6, torch.bfloat16, 300).view(2, 3).to(device) for r in range(n)]
    dist.all_gather(gathered, inputs[me], group=group)
    expect("all_gather", torch.stack(gathered), torch.stack(inputs))
    # An asynchronous all_gather's result and future hold the gathered tensors, as gloo's do.
    gathered = [torch.empty(2, 3, dtype=torch.bfloat16, device=device) for _ in range(n)]
    work = dist.all_gather(gathered, inputs[me], group=group, async_op=True)
    for name, value in (("future", work.get_future().wait()), ("result", work.result())):
        if not (isinstance(value, list) and len(value) == n and all(isinstance(t, torch.Tensor) for t in value)):
            problems.append(f"{label} async all_gather {name}: {type(value).__name__} {value!r:.80}")
        else:
            expect(f"async all_gather {name}", torch.stack(value), torch.stack(inputs))
    flat = torch.empty(n * 6, dtype=torch.bfloat16, device=device)
    work = dist.all_gather_into_tensor(flat, inputs[me].flatten(), group=group, async_op=True)
    work.wait()
    expect("all_gather_into_tensor async", flat, torch.cat([t.flatten() for t in inputs]))
    bools = [rank_input(r, 9, torch.bool, 301).to(device) for r in range(n)]
    gathered = [torch.empty(9, dtype=torch.bool, device=device) for _ in range(n)]
    dist.all_gather(gathered, bools[me], group=group)
    expect("all_gather bool", torch.stack(gathered), torch.stack(bools))

    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        blocks = [[rank_input(r, 4, dtype, 400 + d).to(device) for d in range(n)] for r in range(n)]
        want = reference([torch.cat(blocks[r]) for r in range(n)], Op.SUM)[me * 4 : (me + 1) * 4]
        output = torch.empty(4, dtype=dtype, device=device)
        dist.reduce_scatter(output, blocks[me], group=group)
        expect(f"reduce_scatter {dtype}", output, want)
        output = torch.empty(4, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(output, torch.cat(blocks[me]), group=group)
        expect(f"reduce_scatter_tensor {dtype}", output, want)
        if dtype.is_floating_point:
            # Lossless SUM: the same bits as the all-reduce of the whole stack.
            stack = torch.cat(blocks[me])
            expect(
                f"reduce_scatter_tensor == comm.all_reduce slice {dtype}",
                output,
                comm.all_reduce(stack)[me * 4 : (me + 1) * 4],
            )
        output = torch.empty(4, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(output, torch.cat(blocks[me]), op=Op.MAX, group=group)
        expect(
            f"reduce_scatter_tensor MAX {dtype}",
            output,
            reference([torch.cat(blocks[r]) for r in range(n)], Op.MAX)[me * 4 : (me + 1) * 4],
        )

    # all_to_all_single, equal splits then uneven: rank r sends (r + d + 1) rows of 2 to rank d.
    source = torch.arange(n * 2, dtype=torch.float32, device=device).view(n, 2) + 100 * me
    output = torch.empty(n, 2, device=device)
    dist.all_to_all_single(output, source, group=group)
    expect(
        "all_to_all_single",
        output,
        torch.stack([torch.tensor([2.0 * me, 2.0 * me + 1], device=device) + 100 * r for r in range(n)]),
    )
    sends = [me + d + 1 for d in range(n)]
    receives = [r + me + 1 for r in range(n)]
    source = torch.cat(
        [torch.full((k, 2), 1000 * me + d, dtype=torch.int64, device=device) for d, k in enumerate(sends)]
    )
    output = torch.empty(sum(receives), 2, dtype=torch.int64, device=device)
    dist.all_to_all_single(output, source, receives, sends, group=group)
    expect(
        "all_to_all_single uneven",
        output,
        torch.cat(
            [torch.full((k, 2), 1000 * r + me, dtype=torch.int64, device=device) for r, k in enumerate(receives)]
        ),
    )
    outputs = [torch.empty(r + 1, device=device) for r in range(n)]
    dist.all_to_all(outputs, [torch.full((me + 1,), 10.0 * me + d, device=device) for d in range(n)], group=group)
    expect(
        "all_to_all",
        torch.cat(outputs),
        torch.cat([torch.full((r + 1,), 10.0 * r + me, device=device) for r in range(n)]),
    )

    # Coalesced forms.
    tensors = [rank_input(me, count, torch.bfloat16, 500 + count).to(device) for count in (5, 3)]
    wants = [
        reference([rank_input(r, count, torch.bfloat16, 500 + count).to(device) for r in range(n)], Op.SUM)
        for count in (5, 3)
    ]
    dist.all_reduce_coalesced(tensors, group=group)
    for i, (got, want) in enumerate(zip(tensors, wants, strict=True)):
        expect(f"all_reduce_coalesced {i}", got, want)
    outputs = [
        [torch.empty(2, dtype=torch.int64, device=device), torch.empty(3, dtype=torch.int64, device=device)]
        for _ in range(n)
    ]
    dist.all_gather_coalesced(
        outputs,
        [
            torch.full((2,), -me, dtype=torch.int64, device=device),
            torch.full((3,), me, dtype=torch.int64, device=device),
        ],
        group=group,
    )
    for r in range(n):
        expect(f"all_gather_coalesced from {r}", torch.cat(outputs[r]), torch.tensor([-r] * 2 + [r] * 3, device=device))

    # Point to point: a ring both ways (isend first on every rank), then batch_isend_irecv.
    if n > 1:
        right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
        outgoing = torch.full((4,), float(me), device=device)
        incoming = torch.empty(4, device=device)
        works = [dist.isend(outgoing, right, group=group), dist.irecv(incoming, left, group=group)]
        for w in works:
            w.wait()
        expect("ring isend/irecv", incoming, torch.full((4,), float((me - 1) % n), device=device))
        incoming = torch.empty(4, device=device)
        ops = [dist.P2POp(dist.isend, outgoing * 2, left, group), dist.P2POp(dist.irecv, incoming, right, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        expect("batch_isend_irecv", incoming, torch.full((4,), 2.0 * ((me + 1) % n), device=device))
        tagged = torch.empty(2, dtype=torch.int64, device=device)
        if me == 0:
            dist.send(torch.tensor([7, 8], device=device), ranks[1], group=group, tag=5)
        elif me == 1:
            dist.recv(tagged, ranks[0], group=group, tag=5)
            expect("send/recv with a tag", tagged, torch.tensor([7, 8], device=device))
        # Receives from any source: every other rank sends the group's first rank two messages
        # carrying its rank; that rank takes one from each sender by name (an irecv posted before
        # the rest), the others with recv and irecv naming none; each names its sender.
        if me == 0:
            named = torch.empty(3, device=device)
            named_work = dist.irecv(named, group=group, group_src=n - 1, tag=9)
            senders = []
            for i in range(2 * (n - 1) - 1):
                got = torch.empty(3, device=device)
                if i % 2 == 0:
                    sender = dist.recv(got, group=group, tag=9)
                else:
                    work = dist.irecv(got, group=group, tag=9)
                    work.wait()
                    sender = ranks[work._source_rank()]
                senders.append(sender)
                expect(
                    f"receive {i} from any source (from {sender})", got, torch.full((3,), float(sender), device=device)
                )
            named_work.wait()
            expect("a named receive among them", named, torch.full((3,), float(ranks[n - 1]), device=device))
            expected = sorted([r for r in ranks[1:] for _ in range(2)])
            expected.remove(ranks[n - 1])
            if sorted(senders) != expected:
                problems.append(f"{label}: receives from any source came from {sorted(senders)}, expected {expected}")
        else:
            for _ in range(2):
                dist.send(torch.full((3,), float(ranks[me]), device=device), ranks[0], group=group, tag=9)
    dist.barrier(group=group)
    work = dist.barrier(group=group, async_op=True)
    work.wait()


def check_cuda_semantics(device: torch.device, problems: list[str]) -> None:
    """On CUDA: async work is stream-ordered (wait() makes the current stream wait, the host goes
    on), and dist.all_reduce is captured in a CUDA graph and replayed with comm.all_reduce's bits."""
    me = dist.get_rank()
    comm = nodecomm.distributed.communicator(None, device)
    x = rank_input(me, 1 << 16, torch.bfloat16, 900).to(device)
    expected = comm.all_reduce(x)
    side = torch.cuda.Stream(device)
    y = x.clone()
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU cycles ahead of the all-reduce
    work = dist.all_reduce(y, async_op=True)
    if work.is_completed():
        problems.append("async CUDA work completed before its stream reached it")
    with torch.cuda.stream(side):
        work.wait()  # the side stream waits; the host does not
        waited_on_host = torch.cuda.current_stream(device).query()
        result = y.clone()
    if waited_on_host:
        problems.append("work.wait() blocked the host until the stream finished")
    torch.cuda.synchronize(device)
    if not same_bits(result, expected) or not work.is_completed():
        problems.append("async CUDA all_reduce read on another stream after wait() differs")

    # wait(timeout) waits on the host, at most that long, as NCCL's Work does: the native Work
    # (a SUM, enqueued behind ~0.5 s of GPU work, so it must raise) and the Python group's (a MAX,
    # whose composition may have waited for the GPU already: it returns only once complete).
    for op in (Op.SUM, Op.MAX):
        y = x.clone()
        torch.cuda._sleep(1_000_000_000)
        work = dist.all_reduce(y, op=op, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=20))
            if op == Op.SUM or not work.is_completed():
                problems.append(f"{op} wait(timeout=20 ms) returned before the all-reduce completed")
        except Exception as error:
            if "did not finish within wait()'s" not in str(error):
                problems.append(f"{op} wait(timeout=20 ms) raised {type(error).__name__}: {error}")
        if not work.wait(timeout=datetime.timedelta(seconds=30)) or not work.is_completed():
            problems.append(f"{op} wait(timeout=30 s) returned before the all-reduce completed")
        if op == Op.SUM and not same_bits(y, expected):
            problems.append("async CUDA all_reduce waited with a timeout differs")

    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream(device)
    capture.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        dist.all_reduce(static)
        dist.all_reduce(static, op=Op.MAX)  # a composed one, captured too
    for replay in range(3):
        inputs = [rank_input(r, 1 << 16, torch.bfloat16, 910 + replay).to(device) for r in range(dist.get_world_size())]
        static.copy_(inputs[me])
        graph.replay()
        torch.cuda.synchronize(device)
        total = reference(inputs, Op.SUM)
        if not same_bits(static, total):
            problems.append(f"captured dist.all_reduce replay {replay} differs from the reference")


def all_collectives(device_kind: str = "cpu") -> list[str]:
    """torchrun entry: the default group, then sub-groups, every collective checked."""
    dist.init_process_group("nodecomm")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (
        torch.device("cpu")
        if device_kind == "cpu"
        else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count()))
    )
    problems: list[str] = []
    if device.type == "cuda":
        torch.cuda.set_device(device)
        check_cuda_semantics(device, problems)
    check_collectives(None, list(range(world)), device, problems, "world")
    for members in ([0, 1], list(range(1, world)), list(range(world))[::-1]):
        subgroup = dist.new_group(members, backend="nodecomm")
        if rank in members:
            check_collectives(subgroup, sorted(members), device, problems, f"group {members}")
    daemon = nodecomm.distributed.daemon()
    problems.append(f"daemon {daemon.kind} {daemon.socket}")  # read off by the tests, not a problem
    dist.destroy_process_group()
    return problems


def hold_the_job(rank: int, world_size: int, port: int, environment: dict, report) -> None:
    """Join the default group (through whatever daemon $NODECOMM_DAEMON chooses), all-reduce once,
    report the daemon, then wait to be killed."""
    os.environ.update(
        environment, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("nodecomm")
    x = torch.ones(4)
    dist.all_reduce(x)
    daemon = nodecomm.distributed.daemon()
    report.put((rank, daemon.kind, daemon.socket, x.tolist()))
    time.sleep(600)  # killed here by the test


def reduce_until_error(rank: int, world_size: int, socket: str, port: int, report) -> tuple[str, str, float]:
    """torch.distributed all-reduces in a loop until one raises: (error class, message, time)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODECOMM_SOCKET=socket,
    )
    dist.init_process_group("nodecomm")
    x = torch.ones(1 << 14)
    dist.all_reduce(x)
    report.put(("running", rank))
    try:
        while True:
            dist.all_reduce(x)
            x.fill_(1.0)
    except nodecomm.NodecommError as error:
        return type(error).__name__, str(error), time.time()


def outstanding_async_works(rank: int, world_size: int, socket: str, port: int, calls: int) -> dict:
    """`calls` asynchronous CPU all-gathers (the Python group runs them on its worker), each waited
    and dropped, then `calls` more, waited only at the end, then `calls` more from two threads at
    once, each waited, then one all-reduce: how many the
    backend kept outstanding at most, and after each part; and whether every result was right."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODECOMM_SOCKET=socket)  # fmt: skip
    dist.init_process_group("nodecomm")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    want = torch.arange(world_size, dtype=torch.float32).repeat_interleave(4)
    mine = torch.full((4,), float(rank))
    seen, right = {"most": 0}, True
    for _ in range(calls):
        out = torch.empty(4 * world_size)
        dist.all_gather_into_tensor(out, mine, async_op=True).wait()
        right &= torch.equal(out, want)
        seen["most"] = max(seen["most"], backend.outstanding)
    seen["after_waited"] = backend.outstanding
    pending = []
    for _ in range(calls):
        out = torch.empty(4 * world_size)
        pending.append((dist.all_gather_into_tensor(out, mine, async_op=True), out))
        seen["most"] = max(seen["most"], backend.outstanding)
    for work, out in pending:
        work.wait()
        right &= torch.equal(out, want)

    # Two threads calling at once keep the list whole (it is kept under the GIL).
    def gather_in_turn(count: int) -> None:  # the same data on both threads: either pairing is right
        nonlocal right
        for _ in range(count):
            out = torch.empty(4 * world_size)
            dist.all_gather_into_tensor(out, mine, async_op=True).wait()
            right &= torch.equal(out, want)

    threads = [threading.Thread(target=gather_in_turn, args=(calls // 2,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seen["after_two_threads"] = backend.outstanding
    x = torch.ones(8)
    dist.all_reduce(x)  # native: it waits behind the outstanding ones, then drops them
    seen["after_all_reduce"] = backend.outstanding
    seen["right"] = bool(right and torch.equal(x, torch.full((8,), float(world_size))))
    dist.destroy_process_group()
    return seen


def two_threads_then_a_native_call(rank: int, world_size: int, socket: str, port: int, rounds: int) -> list[str]:
    """Each round two threads issue an asynchronous CPU all-reduce (the Python group's worker runs
    them) at once, then this thread waits for the first one's Work only and all-reduces another
    tensor synchronously (the native lane, once nothing is running): the rounds whose sums are
    wrong (a native call that overtook the second thread's on one rank pairs with it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODECOMM_SOCKET=socket)  # fmt: skip
    dist.init_process_group("nodecomm")
    x = torch.ones(4)
    dist.all_reduce(x)  # binds the native lane
    wrong = []

    def issue(meet: threading.Barrier, works: list, tensors: list[torch.Tensor], index: int) -> None:
        meet.wait()
        works[index] = dist.all_reduce(tensors[index], async_op=True)

    for round_ in range(rounds):
        tensors = [torch.full((64,), 10.0 * (rank + 1)) for _ in range(2)]
        works: list = [None, None]
        meet = threading.Barrier(2)
        threads = [threading.Thread(target=issue, args=(meet, works, tensors, index)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        works[0].wait()
        y = torch.full((64,), float(rank + 1))
        dist.all_reduce(y)
        works[1].wait()
        sums = [float(y[0]), float(tensors[0][0]), float(tensors[1][0])]
        if sums != [3.0, 30.0, 30.0]:
            wrong.append(f"round {round_}: {sums}")
    dist.destroy_process_group()
    return wrong


def misuse(rank: int, world_size: int, socket: str, port: int) -> dict[str, str]:
    """Calls the backend must refuse, each with the error class and message it raises."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODECOMM_SOCKET=socket,
    )
    dist.init_process_group("nodecomm")
    seen = {}
    calls = {
        "premul_sum": lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0)),
        "avg_of_ints": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=Op.AVG),
        "band_of_floats": lambda: dist.all_reduce(torch.ones(4), op=Op.BAND),
        "sparse": lambda: dist.all_reduce(torch.ones(4).to_sparse()),
        "uneven_all_to_all": lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3)),
        "pg_options": lambda: dist.new_group([0, 1], backend="nodecomm", pg_options={"socket": "x"}),
        # What gloo refuses before any data moves (nodecomm once moved it, truncated or misplaced).
        "gather_into_other_dtype": lambda: dist.all_gather_into_tensor(
            torch.empty(4, dtype=torch.int32), torch.ones(2)
        ),
        "reduce_scatter_into_other_dtype": lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.int64), torch.ones(4)
        ),
        "all_gather_wrong_size": lambda: dist.all_gather([torch.empty(3), torch.empty(3)], torch.ones(2)),
    }
    for name, call in calls.items():
        try:
            call()
            seen[name] = "no error"
        except Exception as error:
            seen[name] = f"{type(error).__name__}: {error}"
    x = torch.ones(4)
    dist.all_reduce(x)  # the group still works after every refusal
    seen["still_works"] = str(x.tolist())
    group = dist.new_group([0, 1], backend="nodecomm")
    dist.destroy_process_group(group)
    try:
        group.allreduce([x])
        seen["after_destroy"] = "no error"
    except Exception as error:
        seen["after_destroy"] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()
    return seen


def across_nodes() -> list[str]:
    """torchrun entry for a job over stand-in nodes (one torchrun per node, each naming its node's
    daemon in NODECOMM_SOCKET): the default group spans them; every collective checked exactly,
    lossless sums against the hierarchical reference."""
    from node_ranks import hierarchical_sum

    dist.init_process_group("nodecomm")
    world, me = dist.get_world_size(), dist.get_rank()
    problems: list[str] = []
    node_of = [None] * world
    dist.all_gather_object(node_of, os.environ["GROUP_RANK"])
    nodes = [[r for r in range(world) if node_of[r] == n] for n in dict.fromkeys(node_of)]
    layout = [list(ranks) for ranks in nodecomm.distributed.communicator().layout.nodes]
    if layout != nodes:
        problems.append(f"layout {layout}, expected {nodes}")

    def expect(name: str, got, want) -> None:
        if not same_bits(got, want):
            problems.append(f"{name}: got {got.flatten()[:6].tolist()}, expected {want.flatten()[:6].tolist()}")

    for seed, (dtype, count) in enumerate(
        [(torch.float32, 1), (torch.float32, 1001), (torch.float16, 40_003), (torch.bfloat16, 300_001)]
    ):
        inputs = [rank_input(r, count, dtype, seed) for r in range(world)]
        x = inputs[me].clone()
        dist.all_reduce(x)
        expect(f"all_reduce {dtype} {count}", x, hierarchical_sum(inputs, nodes))
        stacked = [torch.cat([rank_input(r, count, dtype, seed + 100 + k) for k in range(world)]) for r in range(world)]
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out, stacked[me])
        expect(f"reduce_scatter {dtype} {count}", out, hierarchical_sum(stacked, nodes)[me * count : (me + 1) * count])
        gathered = torch.empty(world * count, dtype=dtype)
        dist.all_gather_into_tensor(gathered, inputs[me])
        expect(f"all_gather {dtype} {count}", gathered, torch.cat(inputs))
        y = inputs[me].clone()
        dist.broadcast(y, src=world - 1)
        expect(f"broadcast {dtype} {count}", y, inputs[world - 1])
    for dtype, op in ((torch.float32, Op.MAX), (torch.int32, Op.SUM), (torch.float64, Op.SUM)):
        inputs = [rank_input(r, 999, dtype, 7) for r in range(world)]
        z = inputs[me].clone()
        dist.all_reduce(z, op=op)
        expect(f"all_reduce {dtype} {op}", z, reference(inputs, op))
    dist.barrier()
    dist.destroy_process_group()
    return problems


def mixed_backends() -> list[str]:
    """Groups whose backend strings mix nodecomm with gloo: each device type gets the backend its
    string names, and each sums right."""
    dist.init_process_group("nodecomm")
    world = dist.get_world_size()
    default = dist.distributed_c10d._get_default_group()
    problems = []
    cases = {
        None: ("Backend", "Backend"),
        "cpu:gloo,cuda:nodecomm": ("ProcessGroupGloo", "Backend"),
        "cpu:nodecomm,cuda:gloo": ("Backend", "ProcessGroupGloo"),
    }
    for backend, expected in cases.items():
        group = dist.new_group(backend=backend) if backend else default
        served = tuple(type(group._get_backend(torch.device(d))).__name__ for d in ("cpu", "cuda"))
        if served != expected:
            problems.append(f"{backend or 'default'}: cpu and cuda served by {served}, expected {expected}")
        x = torch.ones(3)
        dist.all_reduce(x, group=group)
        if x.tolist() != [world] * 3:
            problems.append(f"{backend or 'default'}: sum {x.tolist()}")
    dist.destroy_process_group()
    return problems


def bound_device() -> list[str]:
    """init_process_group("nodecomm", device_id=cuda:N), then "cpu:gloo,cuda:nodecomm": CUDA and
    CPU tensors sum right, each device type on the backend its string names."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nodecomm", device_id=device)
    world = dist.get_world_size()
    default = dist.distributed_c10d._get_default_group()
    problems = [] if default.bound_device_id == device else [f"bound to {default.bound_device_id}"]
    mixed = dist.new_group(backend="cpu:gloo,cuda:nodecomm")
    for group, name in ((default, "nodecomm"), (mixed, "cpu:gloo,cuda:nodecomm")):
        for tensor in (torch.ones(1024, device=device), torch.ones(3)):
            dist.all_reduce(tensor, group=group)
            if tensor.tolist()[:3] != [world] * 3:
                problems.append(f"{name}, {tensor.device}: sum {tensor.tolist()[:3]}")
    served = type(mixed._get_backend(device)).__name__
    if served != "Backend":
        problems.append(f"the mixed group's cuda backend is {served}")
    # A barrier right after a group's first CPU collective, which joins its CPU node group in the
    # background: rank 0 comes a second later, when its CPU group has joined and rank 1's may not
    # have. Both take the CPU group's barrier (they once took different ones and waited out the
    # timeout).
    fresh = dist.new_group(backend="nodecomm")
    dist.all_reduce(torch.ones(4, device=device), group=fresh)
    gathered = torch.zeros(2 * world)
    pending = dist.all_gather_into_tensor(
        gathered, torch.full((2,), float(dist.get_rank())), group=fresh, async_op=True
    )
    if dist.get_rank() == 0:
        time.sleep(1.0)  # not a wait: rank 0's own work before the barrier
    dist.barrier(group=fresh)  # different barriers raise after the group's timeout
    pending.wait()
    if gathered.tolist() != [float(r) for r in range(world) for _ in range(2)]:
        problems.append(f"all-gather before a barrier: {gathered.tolist()}")
    dist.destroy_process_group()
    return problems


def workloads(device_kind: str = "cpu") -> list[str]:
    """DDP training and DTensor tensor parallelism (parallelize_module), once on the nodecomm group
    and once on a gloo group of the same ranks, from the same seeds: the same bits. On CUDA
    (`device_kind` "cuda") DDP trains 20 steps with its default reduction and with each of
    allreduce_hook and fp16_compress_hook registered: its buckets are asynchronous all-reduces,
    which the C++ backend runs natively and chains the hooks' futures on."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    cuda = device_kind == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nodecomm")
    rank = dist.get_rank()
    groups = {"nodecomm": dist.distributed_c10d._get_default_group(), "gloo": dist.new_group(backend="gloo")}
    hooks = {"default": None, "allreduce_hook": default_hooks.allreduce_hook}
    if cuda:
        hooks["fp16_compress_hook"] = default_hooks.fp16_compress_hook

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).to(device)

    def data(step: int) -> torch.Tensor:
        return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)

    results: dict[str, list[torch.Tensor]] = {}
    problems = []
    for name, group in groups.items():
        trained: list[torch.Tensor] = []
        for hook in hooks.values():
            ddp = DistributedDataParallel(
                model(), process_group=group, bucket_cap_mb=0.01, device_ids=[device] if cuda else None
            )
            if hook is not None:
                ddp.register_comm_hook(group, hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            native = group._get_backend(device) if cuda and name == "nodecomm" else None
            before = native.lane_calls if native is not None else 0
            for step in range(20 if cuda else 3):
                optimizer.zero_grad()
                ddp(data(step)).square().mean().backward()
                optimizer.step()
            if native is not None and native.lane_calls - before < 20:
                problems.append(f"DDP's buckets did not take the native lane: {native.lane_calls - before} calls")
            trained += [p.detach().cpu() for p in ddp.parameters()]
        tp = parallelize_module(
            model(), DeviceMesh.from_group(group, device_kind), {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
        out = tp(data(7))
        out.square().mean().backward()
        grads = [p.grad.full_tensor().cpu() for p in tp.parameters()]
        results[name] = [*trained, out.detach().cpu(), *grads]
    problems += [
        f"tensor {i}: nodecomm and gloo differ"
        for i, (a, b) in enumerate(zip(results["nodecomm"], results["gloo"], strict=True))
        if not same_bits(a, b)
    ]
    dist.destroy_process_group()
    return problems


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    found = {
        "mixed": mixed_backends,
        "across": across_nodes,
        "device_id": bound_device,
        "workloads": workloads,
        "workloads-cuda": lambda: workloads("cuda"),
    }.get(mode, lambda: all_collectives(mode))()
    daemon = [line for line in found if line.startswith("daemon ")]
    found = [line for line in found if not line.startswith("daemon ")][:20]
    report = json.dumps({"rank": int(os.environ["RANK"]), "problems": found, "daemon": daemon[0][7:] if daemon else ""})
    # One write of the line and its newline (atomic on the pipe every rank of the job shares):
    # print() may write the two apart, and another rank's line then lands between them.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (report + "\n").encode())
    sys.exit(1 if found else 0)


def _join_job(rank: int, world_size: int, socket: str, port: int, seconds: float) -> None:
    """This rank's default "nodecomm" group, whose timeout is `seconds`."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        NODECOMM_SOCKET=socket,
    )  # fmt: skip
    dist.init_process_group("nodecomm", timeout=datetime.timedelta(seconds=seconds))


def a_rank_that_leaves_before_its_first_collective(
    rank: int, world_size: int, socket: str, port: int, seconds: float
) -> str:
    """Rank 1 ends right after init_process_group; rank 0's first all-reduce: what it raises, and
    how long it took."""
    _join_job(rank, world_size, socket, port, seconds)
    if rank == 1:
        os._exit(0)  # gone before any nodecomm group was joined
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        return "no error"
    except Exception as error:
        return f"{type(error).__name__} after {time.monotonic() - started:.1f} s: {error}"


def unanswered_send_in_a_subgroup(rank: int, world_size: int, socket: str, port: int, seconds: float) -> str:
    """In a group of global ranks [1, 2], global rank 2 sends to global rank 1, which never
    receives: what dist.send raises on global rank 2 (the others report "")."""
    _join_job(rank, world_size, socket, port, seconds)
    pair = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=seconds))
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=60))
    if rank != 2:
        store.wait(["sent"])  # no collective meanwhile: it would time out while rank 2 sends
        return ""
    try:
        dist.send(torch.ones(4), dst=1, group=pair)
        outcome = "no error"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    store.set("sent", "1")
    return outcome


def unanswered_send(rank: int, world_size: int, socket: str, port: int, seconds: float) -> str:
    """Rank 0 sends to rank 1, which never receives (it waits in a barrier of its own): what
    dist.send raises on rank 0, under a process group whose timeout is `seconds`."""
    _join_job(rank, world_size, socket, port, seconds)
    if rank == 1:
        time.sleep(3 * seconds)  # never receives; the job ends when rank 0 reports
        return ""
    started = time.monotonic()
    try:
        dist.send(torch.ones(4), dst=1)
        return "no error"
    except Exception as error:
        return f"{type(error).__name__} after {time.monotonic() - started:.0f} s: {error}"


def unanswered_receive_from_any(rank: int, world_size: int, socket: str, port: int, seconds: float) -> str:
    """Rank 0 receives from any source; nobody sends (rank 1 sleeps): what dist.recv raises on rank
    0, and after how long, under a process group whose timeout is `seconds`."""
    _join_job(rank, world_size, socket, port, seconds)
    if rank == 1:
        time.sleep(3 * seconds)  # not a wait: the silent peer itself; the job ends when rank 0 reports
        return ""
    started = time.monotonic()
    try:
        dist.recv(torch.ones(4))
        return "no error"
    except Exception as error:
        return f"{type(error).__name__} after {time.monotonic() - started:.1f} s: {error}"


def receives_from_any_of_two_tags(rank: int, world_size: int, socket: str, port: int, seconds: float) -> dict:
    """Rank 0 receives from any source with tag 1, then with tag 2; rank 1 sends tag 2 first: what
    rank 0 received, from whom, and how long it took. Then rank 0 leaves three receives from any
    source that nobody answers and destroys the group: how long that took, and what they raised."""
    _join_job(rank, world_size, socket, port, seconds)
    dist.barrier()
    if rank == 1:
        dist.send(torch.full((2,), 2.0), 0, tag=2)
        dist.send(torch.full((2,), 1.0), 0, tag=1)
        dist.barrier()
        return {}
    started = time.monotonic()
    first, second = torch.zeros(2), torch.zeros(2)
    works = [dist.irecv(first, tag=1), dist.irecv(second, tag=2)]
    for work in works:
        work.wait()
    received = {
        "values": [first.tolist(), second.tolist()],
        "sources": [work._source_rank() for work in works],
        "took": time.monotonic() - started,
    }
    dist.barrier()
    pending = [dist.irecv(torch.zeros(2), tag=7) for _ in range(3)]
    received["pending source"] = pending[0]._source_rank()  # none yet: -1, as gloo says
    started = time.monotonic()
    dist.destroy_process_group()
    left = time.monotonic() - started
    errors = []
    for work in pending:
        try:
            work.wait()
            errors.append("no error")
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
    return {**received, "left": left, "errors": errors}


def aborted_during_all_reduce(
    rank: int, world_size: int, socket: str, port: int, seconds: float, dtype_name: str
) -> dict[str, object]:
    """As unanswered_all_reduce, with the backend's abort() called on another thread a second into
    rank 0's all-reduce of `dtype_name` (float32: the native lane; int64: the Python group), as a
    watchdog does: what that call raises and after how long, how long abort() took, and what the
    next call raises once the group is aborted."""
    _join_job(rank, world_size, socket, port, seconds)
    store = dist.distributed_c10d._get_default_store()
    dtype = getattr(torch, dtype_name)
    dist.all_reduce(torch.ones(4, dtype=dtype))
    dist.all_reduce(torch.ones(4, dtype=dtype))  # the backend's lane is bound after the first
    if rank == 1:
        store.wait(["aborted"], datetime.timedelta(seconds=6 * seconds))  # never comes to the third
        return {}
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    took = {}

    def abort() -> None:
        started = time.monotonic()
        backend.abort()
        took["abort"] = time.monotonic() - started

    aborting = threading.Timer(1.0, abort)
    aborting.start()
    seen: dict[str, object] = {}
    for call in ("first", "next"):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4, dtype=dtype))
            seen[call] = "no error"
        except Exception as error:
            seen[call] = f"{type(error).__name__}: {error}"
        seen[f"{call} took"] = time.monotonic() - started
    aborting.join()
    store.set("aborted", "1")
    return {**seen, "abort took": took.get("abort")}


def failed_future(rank: int, world_size: int, socket: str, port: int, seconds: float) -> list[str]:
    """Rank 0's asynchronous all_gather that rank 1 never joins, under a group timeout of
    `seconds`: what its wait(timeout=200 ms) raises, what its future's wait() and a then() chained
    on it (a DDP comm hook's way) give, and what the Work says of itself after."""
    _join_job(rank, world_size, socket, port, seconds)
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(3 * seconds)  # never comes; the job ends when rank 0 reports
        return []
    work = dist.all_gather([torch.empty(2) for _ in range(world_size)], torch.ones(2), async_op=True)
    seen = []
    try:  # long before the group's timeout
        work.wait(timeout=datetime.timedelta(milliseconds=200))
        seen.append("wait(timeout=200 ms) returned")
    except Exception as error:
        seen.append(f"{type(error).__name__}: {error}")
    future = work.get_future()
    for waited in (future, future.then(lambda done: done.value())):
        try:
            seen.append(f"value {waited.wait()!r:.60}")
        except Exception as error:
            seen.append(f"{type(error).__name__}: {error}")
    error = work.exception()
    seen.append(f"is_success {work.is_success()}, exception {type(error).__name__}: {error}")
    return seen


def all_reduce_beside_a_send(rank: int, world_size: int, socket: str, port: int, seconds: float) -> tuple:
    """After one all-reduce (which binds the native lane), rank 0 all-reduces asynchronously and
    sends before waiting; rank 1 receives, then all-reduces: how long rank 0's asynchronous call
    took to return, the sum, and what rank 1 received (rank 0: its own buffer, [7, 7])."""
    _join_job(rank, world_size, socket, port, seconds)
    x = torch.ones(4)
    dist.all_reduce(x)
    received = torch.full((2,), 7.0) if rank == 0 else torch.zeros(2)
    start = time.monotonic()
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        returned_after = time.monotonic() - start
        dist.send(received, 1)
        work.wait()
    else:
        dist.recv(received, 0)
        dist.all_reduce(x, async_op=True).wait()
        returned_after = time.monotonic() - start
    dist.destroy_process_group()
    return returned_after, x.tolist(), received.tolist()


def unanswered_all_reduce(rank: int, world_size: int, socket: str, port: int, seconds: float) -> str:
    """Both ranks all-reduce once (their group joins); then rank 0 all-reduces alone, natively in
    the C++ backend: what dist.all_reduce raises there, under a group whose timeout is `seconds`."""
    _join_job(rank, world_size, socket, port, seconds)
    dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))  # the backend's lane is bound after the first
    if rank == 1:
        time.sleep(3 * seconds)  # never comes; the job ends when rank 0 reports
        return ""
    try:
        dist.all_reduce(torch.ones(4))
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
