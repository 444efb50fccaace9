"""The element types groups reduce: torch dtypes, their names, and their codes on the wire and in
nodecomm._native (equal to nodecomm.v1.DType values)."""

from __future__ import annotations

import torch

from nodecomm.v1 import control_pb2 as pb

DTYPE_CODES = {torch.float32: pb.FLOAT32, torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16}
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
