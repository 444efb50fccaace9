"""torch.distributed's collectives, built from a Communicator's own: the lossless all-reduce, the
all-gather (bytes, any dtype) and the barrier. Nothing here reaches another backend.

- SUM of float32 / float16 / bfloat16 (and complex64, as float32 pairs) is `comm.all_reduce`: the
  lossless contract, the same bits as calling it directly.
- Every other reduction gathers the ranks' tensors and reduces them on every rank in rank order
  0..n-1 (float16 / bfloat16 accumulate in float32 and round once), so every rank gets the same
  bits. It moves world_size times the bytes of a reduction, which the fast paths do not.
- broadcast, gather and scatter are all-gathers of which a rank keeps a part.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from nodecomm.errors import InvalidArgumentError, UnsupportedError

RedOp = dist.ReduceOp.RedOpType
# The dtypes Communicator.all_reduce sums (on its paths or over a wire); complex ones go as real pairs.
COMMUNICATOR_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_AS_REAL = {torch.complex64: torch.float32, torch.complex32: torch.float16}
_WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

_COMBINE = {
    RedOp.SUM: torch.add,
    RedOp.AVG: torch.add,
    RedOp.PRODUCT: torch.mul,
    RedOp.MIN: torch.minimum,
    RedOp.MAX: torch.maximum,
    RedOp.BAND: torch.bitwise_and,
    RedOp.BOR: torch.bitwise_or,
    RedOp.BXOR: torch.bitwise_xor,
}
# bool has no arithmetic: a sum is "any", a product "all", as NCCL and gloo define them.
_COMBINE_BOOL = {
    RedOp.SUM: torch.logical_or,
    RedOp.MAX: torch.logical_or,
    RedOp.BOR: torch.logical_or,
    RedOp.PRODUCT: torch.logical_and,
    RedOp.MIN: torch.logical_and,
    RedOp.BAND: torch.logical_and,
    RedOp.BXOR: torch.logical_xor,
}


def reduce_op_type(op: object) -> RedOp:
    """The RedOpType of a ReduceOp (options carry a ReduceOp, Python callers may pass either)."""
    kind = getattr(op, "op", op)
    if not isinstance(kind, RedOp):
        raise InvalidArgumentError(f"reduce op {op!r}: expected a torch.distributed.ReduceOp")
    return kind


def check_reducible(dtype: torch.dtype, op: RedOp) -> None:
    """Raise, before anything moves, if `op` cannot reduce `dtype`."""
    if op == RedOp.SUM and dtype in COMMUNICATOR_DTYPES:
        return  # the common case, checked cheaply
    name = op.name
    if op == RedOp.PREMUL_SUM:
        raise UnsupportedError(
            "ReduceOp.PREMUL_SUM is NCCL's; nodecomm reduces SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR"
        )
    if dtype.is_complex and op not in (RedOp.SUM, RedOp.AVG, RedOp.PRODUCT):
        raise InvalidArgumentError(f"ReduceOp.{name} does not order complex numbers; expected SUM, AVG or PRODUCT")
    if op == RedOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgumentError(f"ReduceOp.AVG needs a floating-point or complex tensor, got {dtype}")
    if op in (RedOp.BAND, RedOp.BOR, RedOp.BXOR) and (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgumentError(f"ReduceOp.{name} needs an integer or bool tensor, got {dtype}")


def is_communicator_sum(dtype: torch.dtype, op: RedOp) -> bool:
    """Whether Communicator.all_reduce runs this reduction (complex dtypes as their real pairs)."""
    return op == RedOp.SUM and (dtype in COMMUNICATOR_DTYPES or dtype in _AS_REAL)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of `tensor` (a copy when it is not contiguous)."""
    return tensor.contiguous().view(-1)


def gather_rows(comm, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor`, flattened: [world_size, numel], row r from rank r."""
    return comm.all_gather(flat(tensor))


def reduce_rows(rows: torch.Tensor, op: RedOp) -> torch.Tensor:
    """Reduce gathered rows in rank order 0..n-1, accumulating 16-bit floats in float32 and
    rounding once; the result has the rows' dtype."""
    if rows.dtype == torch.bool:
        return functools.reduce(_COMBINE_BOOL[op], rows.unbind(0))
    accumulator = rows.dtype if op in (RedOp.MIN, RedOp.MAX) else _WIDENED.get(rows.dtype, rows.dtype)
    combine = _COMBINE[op]
    total = rows[0].to(accumulator)
    for row in rows[1:]:
        total = combine(total, row.to(accumulator))
    if op == RedOp.AVG:
        total = total / rows.shape[0]
    return total.to(rows.dtype)


def all_reduce(comm, tensor: torch.Tensor, op: RedOp) -> None:
    """Reduce `tensor` across the ranks, in place."""
    if op == RedOp.SUM and tensor.dtype in COMMUNICATOR_DTYPES and tensor.is_contiguous():
        comm.all_reduce(tensor, out=tensor)  # the common case, with nothing to reshape
        return
    if is_communicator_sum(tensor.dtype, op):
        values = tensor if tensor.is_contiguous() else tensor.contiguous()
        parts = (torch.view_as_real(values) if values.dtype in _AS_REAL else values).view(-1)
        comm.all_reduce(parts, out=parts)
        if values is not tensor:
            tensor.copy_(values)
        return
    tensor.copy_(reduce_rows(gather_rows(comm, tensor), op).view(tensor.shape))


def reduce(comm, tensor: torch.Tensor, op: RedOp, root: int) -> None:
    """The reduction lands in `tensor` on `root`; the other ranks' tensors are left as they were."""
    if is_communicator_sum(tensor.dtype, op):
        result = tensor.clone()
        all_reduce(comm, result, op)
    else:
        rows = gather_rows(comm, tensor)
        result = reduce_rows(rows, op) if comm.rank == root else None
    if comm.rank == root:
        tensor.copy_(result.view(tensor.shape))


def broadcast(comm, tensor: torch.Tensor, root: int) -> None:
    rows = gather_rows(comm, tensor)
    if comm.rank != root:
        tensor.copy_(rows[root].view(tensor.shape))


def reduce_scatter(comm, output: torch.Tensor, stacked: torch.Tensor, op: RedOp) -> None:
    """`stacked` holds world_size blocks of output.numel() elements; block r's reduction lands in
    rank r's `output`. A lossless SUM reduces the whole stack, so its bits are all_reduce's."""
    count = output.numel()
    if stacked.numel() != count * comm.world_size:
        raise InvalidArgumentError(
            f"reduce_scatter: the input holds {stacked.numel()} elements; expected world_size "
            f"({comm.world_size}) times the output's {count}"
        )
    mine = slice(comm.rank * count, (comm.rank + 1) * count)
    if is_communicator_sum(stacked.dtype, op):
        values = flat(stacked).clone()
        all_reduce(comm, values, op)
        output.copy_(values[mine].view(output.shape))
        return
    rows = gather_rows(comm, stacked)
    output.copy_(reduce_rows(rows[:, mine], op).view(output.shape))


def all_to_all(comm, output: torch.Tensor, source: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
    """torch's all_to_all_single: rows of dim 0 go to the ranks as split (equally where a list is empty).

    A rank that gives no split sizes at all splits equally, as every rank must then (torch's
    contract for a consistent call), and nothing more is exchanged; otherwise the ranks first
    share their split sizes, which on CUDA makes the host wait to read them.
    """
    world, rank = comm.world_size, comm.rank
    if source.dim() == 0 or output.dim() == 0:
        raise InvalidArgumentError("all_to_all: expected tensors of at least one dimension (rows of dim 0 are sent)")
    row_numel = math.prod(source.shape[1:])
    if math.prod(output.shape[1:]) != row_numel:
        raise InvalidArgumentError(
            f"all_to_all: input rows of shape {tuple(source.shape[1:])} and output rows of shape "
            f"{tuple(output.shape[1:])} differ in size"
        )
    given = bool(in_splits) or bool(out_splits)
    sends = list(in_splits) or _equal_split(source.shape[0], world, "input")
    receives = list(out_splits) or _equal_split(output.shape[0], world, "output")
    if sum(sends) != source.shape[0] or sum(receives) != output.shape[0]:
        raise InvalidArgumentError(
            f"all_to_all: split sizes {sends} and {receives} do not add up to the input's {source.shape[0]} "
            f"and the output's {output.shape[0]} rows"
        )
    if given:
        mine = torch.tensor(sends, dtype=torch.int64, device=source.device)
        sizes = gather_rows(comm, mine).cpu()  # [world, world]: rank r sends sizes[r][d] rows to d
        if sizes[:, rank].tolist() != receives:
            raise InvalidArgumentError(
                f"all_to_all: this rank expects {receives} rows from ranks 0..{world - 1}, but they send {sizes[:, rank].tolist()}"
            )
    else:
        sizes = torch.tensor([sends] * world, dtype=torch.int64)
    longest = int(sizes.sum(1).max()) * row_numel
    padded = torch.zeros(longest, dtype=source.dtype, device=source.device)
    padded[: source.numel()] = flat(source)
    rows = comm.all_gather(padded)
    pieces = []
    for peer in range(world):
        start = int(sizes[peer, :rank].sum()) * row_numel
        pieces.append(rows[peer, start : start + int(sizes[peer, rank]) * row_numel])
    output.copy_(torch.cat(pieces).view(output.shape))


def _equal_split(rows: int, world: int, what: str) -> list[int]:
    if rows % world:
        raise InvalidArgumentError(f"all_to_all: the {what}'s {rows} rows do not split equally over {world} ranks")
    return [rows // world] * world
