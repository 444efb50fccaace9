"""What a compressed wire promises: the most its sum may differ from the exact sum, per element.
The tests hold every element of a compressed all-reduce to it, and `nodecomm bench --op
wire-error` reports against it (docs/compressed-wires.md)."""

from __future__ import annotations

import torch


def exact_sum(inputs: list):
    """The inputs' sum in float64, element by element (flattened): what the errors are against."""
    return torch.stack([x.double().flatten() for x in inputs]).sum(dim=0)


def error_bound(inputs: list, wire: str):
    """The most a compressed sum may differ from the exact sum of `inputs`, per element (float64):
    each rank's half code step (int8: 1/254 of its block's largest finite magnitude; E4M3: 1/16
    of the value, or half its smallest step, absmax * 2^-10 / 448), then the one rounding to the
    dtype that the lossless sum has too."""
    bound = torch.zeros(inputs[0].numel(), dtype=torch.float64)
    for x in inputs:
        flat = x.double().flatten()
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % 32)).view(-1, 32)
        finite = torch.isfinite(blocks)
        absmax = torch.where(finite, blocks.abs(), torch.zeros_like(blocks)).amax(dim=1, keepdim=True)
        if wire == "int8":
            step = (absmax / 254.0).expand_as(blocks)
        else:
            step = torch.maximum(blocks.abs() / 16.0, absmax / 448.0 * 2.0**-10)
        bound += step.flatten()[: flat.numel()] * 1.0001
    exact = exact_sum(inputs).abs()
    rounding = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[inputs[0].dtype]
    return bound + (exact + bound) * rounding + 2.0**-24
