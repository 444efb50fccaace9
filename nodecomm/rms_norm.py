"""The numerics of all_reduce_rms_norm, stated as a torch computation with every rounding written
out: the reference that the fused kernels (native/rms_norm.h on the host, native/cuda/rms_norm.cuh
on the GPU) give the same bits as, on every rank and every path.

Per row of `hidden` elements, after the all-reduce's sum (fp32 in rank order, one rounding):
  residual_out = round(float(sum) + float(residual))
  sum of squares: lane l of NORM_LANES takes the elements of chunks l, l + NORM_LANES, ... (a chunk
    is NORM_CHUNK consecutive elements), in increasing order, and adds float(residual_out)**2 to
    its fp32 partial (the product rounded, then the sum: never a fused multiply-add); then, for
    offset NORM_LANES/2, ..., 2, 1, every lane l adds lane l ^ offset's partial to its own
  inverse = 1 / sqrt(squares / hidden + eps), every operation in fp32, correctly rounded (eps
    rounded to fp32 first)
  out = round((float(residual_out) * inverse) * float(weight))
where round is the element type's round-to-nearest-even, and fp32 inputs are not rounded again.
"""

from __future__ import annotations

import math
import struct

import torch

# What the CUDA kernels' blocks are made of (kThreads, 16-byte packs of bfloat16): the order is
# chosen so that a block of NORM_LANES threads keeps it while loading a chunk at a time.
NORM_LANES = 512
NORM_CHUNK = 8


def add_rms_norm(
    reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out) of rows `reduced` (the all-reduce's result) and `residual`, both
    [..., hidden], with `weight` [hidden], computed on the CPU in the stated order. Slow and
    exact: what the fused paths are checked against."""
    dtype, shape = reduced.dtype, reduced.shape
    hidden = shape[-1]
    summed = reduced.detach().reshape(-1, hidden).float().cpu()
    residual_out = (summed + residual.detach().reshape(-1, hidden).float().cpu()).to(dtype)
    value = residual_out.float()
    chunks = -(-hidden // NORM_CHUNK)
    rounds = -(-chunks // NORM_LANES)
    padded = torch.zeros(value.shape[0], rounds * NORM_LANES * NORM_CHUNK)
    padded[:, :hidden] = value * value
    # [rows, round, lane, element of the chunk] -> each lane's terms in the order it adds them.
    terms = (
        padded.view(-1, rounds, NORM_LANES, NORM_CHUNK).permute(0, 2, 1, 3).reshape(-1, NORM_LANES, rounds * NORM_CHUNK)
    )
    partial = torch.zeros(value.shape[0], NORM_LANES)
    for k in range(terms.shape[-1]):
        partial = partial + terms[:, :, k]
    lanes = torch.arange(NORM_LANES)
    offset = NORM_LANES // 2
    while offset:
        partial = partial + partial[:, lanes ^ offset]
        offset //= 2
    # Row by row in Python floats, each operation rounded to fp32: correctly rounded, as the
    # kernels' are (torch's own float32 sqrt need not be: 1 ulp off on AVX-512 machines).
    eps32 = _fp32(eps)
    inverse = torch.tensor([_inverse_rms(squares, hidden, eps32) for squares in partial[:, 0].tolist()]).view(-1, 1)
    out = ((value * inverse) * weight.detach().float().cpu()).to(dtype)
    return out.reshape(shape), residual_out.reshape(shape)


def _inverse_rms(squares: float, hidden: int, eps: float) -> float:
    root = _fp32(math.sqrt(_fp32(_fp32(squares / hidden) + eps)))
    return math.inf if root == 0 else _fp32(1.0 / root)


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 (a double result of one fp32 +, -, *, / or sqrt so rounded is
    that operation's correctly rounded fp32 result)."""
    return struct.unpack("f", struct.pack("f", x))[0]
