"""Rank programs for groups across nodes (tests/test_across_nodes.py): every rank's daemon socket
stands for its node; the test process hosts the job's TCPStore, as torchrun's agent does (a rank
that hosted it would take it along when it dies). Importable by spawned children."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import nodecomm
from nodecomm.client.across_nodes_forms import AcrossNodesForms
from nodecomm.evidence import LivePolicy
from ranks import BITS, DTYPES, rank_input

HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # relative
SMALLEST = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}  # subnormal step


def nodes_of(sockets: list[str]) -> list[list[int]]:
    """Ranks by node, nodes ordered by their lowest rank (as NodeLayout orders them)."""
    order: dict[str, list[int]] = {}
    for rank, socket in enumerate(sockets):
        order.setdefault(socket, []).append(rank)
    return list(order.values())


def hierarchical_sum(inputs: list[torch.Tensor], nodes: list[list[int]]) -> torch.Tensor:
    """Each node's sum in fp32 in rank order, rounded once to the dtype; those summed in fp32 in
    node order, rounded once."""
    partials = []
    for ranks in nodes:
        acc = inputs[ranks[0]].float().clone()
        for r in ranks[1:]:
            acc += inputs[r].float()
        partials.append(acc.to(inputs[0].dtype))
    total = partials[0].float().clone()
    for partial in partials[1:]:
        total += partial.float()
    return total.to(inputs[0].dtype)


def error_bound(inputs: list[torch.Tensor], nodes: list[list[int]]) -> torch.Tensor:
    """What the hierarchical sum may differ from the exact one by, per element: fp32's rounding at
    each of the n - 1 additions (at most 2^-24 of the magnitudes summed), half a dtype ulp at each
    node's rounding and at the last one (twice, as the rounded values may exceed the exact ones),
    and a subnormal step."""
    dtype = inputs[0].dtype
    magnitudes = torch.stack([x.double().abs() for x in inputs]).sum(0)
    partial_sizes = torch.stack([torch.stack([inputs[r].double() for r in ranks]).sum(0).abs() for ranks in nodes])
    exact = torch.stack([x.double() for x in inputs]).sum(0).abs()
    return (
        (len(inputs) - 1) * 2.0**-24 * magnitudes
        + HALF_ULP[dtype] * 2 * (partial_sizes.sum(0) + exact)
        + SMALLEST[dtype]
    )


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def exact_across_nodes(rank: int, world_size: int, sockets: list[str], port: int, cases: list[tuple[str, int]]) -> dict:
    """Every case's all_reduce (in the table's form, and forced flat and sharded) and all_gather:
    the hierarchical reference's bits, within the bound of the exact sum; returns the problems
    found, a digest of every result's bits and the table the probe gave."""
    nodes = nodes_of(sockets)
    problems, digest = [], hashlib.sha256()
    store = _store(port)
    with nodecomm.connect_across_nodes("span", rank, world_size, store=store, socket=sockets[rank], timeout=60) as comm:
        table = comm.table
        for seed, (dtype_name, count) in enumerate(cases):
            dtype = DTYPES[dtype_name]
            inputs = [rank_input(r, count, dtype, seed) for r in range(world_size)]
            expected = hierarchical_sum(inputs, nodes)
            for form in (None, "flat", "sharded"):
                y = comm.all_reduce(inputs[rank], form=form)
                if not torch.equal(y.view(BITS[dtype]), expected.view(BITS[dtype])):
                    wrong = int((y.view(BITS[dtype]) != expected.view(BITS[dtype])).sum())
                    problems.append(f"all_reduce {dtype_name} count={count} form={form}: {wrong} elements differ")
            exact = torch.stack([x.double() for x in inputs]).sum(0)
            if count and not bool(((y.double() - exact).abs() <= error_bound(inputs, nodes)).all()):
                problems.append(f"all_reduce {dtype_name} count={count}: past the bound")
            rows = comm.all_gather(inputs[rank])
            if not torch.equal(rows.view(BITS[dtype]), torch.stack(inputs).view(BITS[dtype])):
                problems.append(f"all_gather {dtype_name} count={count}: rows differ")
            digest.update(y.view(torch.uint8).numpy().tobytes())
        out = torch.empty(3)
        comm.all_reduce(torch.full((3,), float(rank)), out=out)
        if out.tolist() != [float(sum(range(world_size)))] * 3:
            problems.append(f"all_reduce into out: {out.tolist()}")
        try:
            comm.all_reduce(out, form="ring")
            problems.append("form='ring' was accepted")
        except nodecomm.InvalidArgumentError as error:
            if "expected 'flat' or 'sharded'" not in str(error):
                problems.append(f"form='ring': {error}")
        comm.barrier()
        layout = [list(ranks) for ranks in comm.layout.nodes]
    return {"problems": problems, "digest": digest.hexdigest(), "layout": layout, "table": table}


def live_table_across_nodes(rank: int, world_size: int, sockets: list[str], port: int, count: int) -> dict:
    """Start with every size flat (up to 64 MiB) and all-reduce `count` float32s until the live
    timings move the boundary, exploring every 2nd call and agreeing every 8th; returns the tables
    every rank held after each agreement and a digest of every result's bits."""
    store = _store(port)
    tables, digest = [], hashlib.sha256()
    with nodecomm.connect_across_nodes(
        "moving", rank, world_size, store=store, socket=sockets[rank], timeout=60, flat_max_bytes=64 << 20
    ) as comm:
        quick = LivePolicy(explore_period=2, switch_period=8, min_samples=3)
        comm.forms = AcrossNodesForms(comm.table, policy=quick, calls=comm.forms.calls)
        x = rank_input(rank, count, torch.float32, 0)
        for call in range(1, 65):
            digest.update(comm.all_reduce(x).view(torch.uint8).numpy().tobytes())
            if call % 8 == 0:
                tables.append(comm.table)
            if comm.table.epoch and call % 8 == 0:
                break
    return {"tables": tables, "digest": digest.hexdigest()}


def reduce_through(rank: int, world_size: int, sockets: list[str], port: int, count: int, report, commands) -> dict:
    """All-reduce in a loop, each sum checked, until a rank is told "stop" (every rank stops after
    the same call: the one whose sum says a rank asked to); rank 0 says when 20 calls are done.
    Returns the calls, the failed and the wrong ones, and the first error. `commands`: every
    rank's queue."""
    store = _store(port)
    calls, failed, wrong, first = 0, 0, 0, None
    with nodecomm.connect_across_nodes(
        "riding", rank, world_size, store=store, socket=sockets[rank], timeout=60
    ) as comm:
        leaving = False
        while True:
            calls += 1
            x = torch.ones(count)
            x[-1] = float(leaving)
            try:
                summed = comm.all_reduce(x)
            except nodecomm.NodecommError as error:
                failed, first = failed + 1, f"{type(error).__name__}: {error}"
                break
            wrong += not bool((summed[:-1] == world_size).all())
            if summed[-1] > 0:
                break
            if calls == 20 and rank == 0:
                report.put(rank)
            if not leaving and not commands[rank].empty():
                leaving = commands[rank].get() == "stop"
    return {"calls": calls, "failed": failed, "wrong": wrong, "error": first}


def reduce_until_error(rank: int, world_size: int, sockets: list[str], port: int, count: int, report) -> tuple:
    """All-reduce in a loop until a call raises; rank 0 says when 20 calls are done. Returns
    (error class, message, when it was raised)."""
    store = _store(port)
    with nodecomm.connect_across_nodes(
        "doomed", rank, world_size, store=store, socket=sockets[rank], timeout=60
    ) as comm:
        x = torch.ones(count)
        for call in range(10**9):
            try:
                comm.all_reduce(x)
            except nodecomm.NodecommError as error:
                try:
                    comm.all_reduce(x)
                    again = "no error"
                except nodecomm.NodecommError as later:
                    again = type(later).__name__
                return type(error).__name__, str(error), time.time(), again
            if call == 20 and rank == 0:
                report.put(rank)
    raise AssertionError("unreachable")
