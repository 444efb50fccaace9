"""What a collective checks of its tensors before anything runs: a torch.Tensor of one of the
group's dtypes, contiguous, on its device, of the shape asked for. Each refusal says what was
wrong and what was expected."""

from __future__ import annotations

import torch

from nodecomm.errors import InvalidArgumentError

from .transport import Transport


class TensorChecks:
    def __init__(self, dtypes: frozenset[torch.dtype], transport: Transport, where: dict):
        self.dtypes = dtypes
        self._transport = transport
        self._device = transport.device
        self._where = where

    def reducible(self, tensor: torch.Tensor) -> bool:
        """A tensor all_reduce takes: one of the group's dtypes, contiguous, on its device."""
        return tensor.dtype in self.dtypes and tensor.is_contiguous() and self._transport.on_device(tensor)

    def check(self, tensor: torch.Tensor, name: str) -> None:
        if type(tensor) is torch.Tensor and self.reducible(tensor):
            return  # the common case, checked cheaply
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}", **self._where)
        if not self._transport.on_device(tensor):
            raise InvalidArgumentError(
                f"{name} is on {tensor.device}; this rank's group runs on {self._device}", **self._where
            )
        if tensor.dtype not in self.dtypes:
            allowed = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            raise InvalidArgumentError(
                f"{name} has dtype {tensor.dtype}; this group was formed for {allowed}", **self._where
            )
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous", **self._where)

    def output(self, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """`out` checked to be a contiguous tensor of `shape` and `dtype` on this group's device,
        or a new one where it is None."""
        if out is None:
            return torch.empty(shape, dtype=dtype, device=self._device)
        if (
            tuple(out.shape) != shape
            or out.dtype != dtype
            or not out.is_contiguous()
            or not self._transport.on_device(out)
        ):
            raise InvalidArgumentError(
                f"out must be a contiguous tensor on {self._device} of shape {shape} and dtype {dtype}, "
                f"got shape {tuple(out.shape)} dtype {out.dtype} on {out.device}",
                **self._where,
            )
        return out

    def rms_norm_operands(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> int:
        """all_reduce_rms_norm's operands checked: x [..., hidden], residual as x, weight [hidden],
        all of one dtype, eps finite and at least 0. Returns hidden."""
        self.check(x, "x")
        shape, dtype = tuple(x.shape), x.dtype
        if not shape or shape[-1] < 1:
            raise InvalidArgumentError(
                f"x has shape {shape}: expected [..., hidden] with hidden at least 1", **self._where
            )
        hidden = shape[-1]
        for name, tensor, expected in (("residual", residual, shape), ("weight", weight, (hidden,))):
            self.check(tensor, name)
            if tuple(tensor.shape) != expected or tensor.dtype != dtype:
                raise InvalidArgumentError(
                    f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}: expected {expected} and {dtype}",
                    **self._where,
                )
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
            raise InvalidArgumentError(f"eps {eps!r}: expected a finite number, at least 0", **self._where)
        return hidden
