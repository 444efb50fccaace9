"""vLLM's DCP top-k merge on nodecomm's owner exchange (Exchange.merge), with NODECOMM_DCP_TOPK=1.

With decode context parallelism, each DCP rank of a sparse-attention indexer (DeepSeek V3.2's,
GLM-5.x's) holds its top-k of its own KV shard for every query row, and vLLM's
`_merge_dcp_topk_global` (model_executor/layers/sparse_attn_indexer.py) gives every rank the
global top-k: an all-gather of every rank's candidates (or, with `--dcp-comm-backend a2a`, a
push into every peer's inbox), then every rank selects every row. Here each row goes to one
owner, which selects it, and an int32 all-gather of the owners' rows follows (client/topk_merge.py
says why the sets are vLLM's).

vLLM's general plugin (register() in vllm.py) replaces `_merge_dcp_topk_global` in its module
before the models are imported (glm5next's indexer imports it by name, and so gets this one), and
wraps `SparseAttnIndexer.__init__` so that the DCP group's exchange is opened while the model is
built, as vLLM's own workspace is. glm5next's kpool indexer merges a topk known only per call: its
exchange opens at its first merge, in vLLM's profile run (eager, every DCP rank together), sized
by max_num_batched_tokens. A merge whose group nodecomm cannot serve (ranks across nodes, no
daemon) runs vLLM's own.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import torch

from nodecomm.errors import NodecommError

from . import engine_group
from .engine_switch import DCP_TOPK_VARIABLE, requested

log = logging.getLogger("nodecomm.integrations")

INDEXER_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
MERGE = "_merge_dcp_topk_global"
INDEXER_CLASS = "SparseAttnIndexer"


def score_bits(logits_dtype: torch.dtype) -> int:
    """vLLM's dcp_topk_score_bits: bf16 logits, upcast to fp32, rank on their high 16 bits."""
    return 16 if logits_dtype == torch.bfloat16 else 32


def id_bits(num_positions: int) -> int:
    """vLLM's dcp_topk_id_bits: the bits that hold every position below num_positions."""
    return max(1, min(32, (num_positions - 1).bit_length()))


class DcpTopkWorkspace:
    """One DCP group's exchange for merges of `topk` candidates, up to `max_rows` rows a stage,
    on the rank's device: the ranks join over the group's CPU process group (engine_group.py)
    and open the exchange, every rank or none."""

    def __init__(self, group, device: torch.device, max_rows: int, topk: int):
        self.max_rows, self.topk = max_rows, topk

        def usable(comm) -> str:
            try:
                self._exchange = comm.topk_exchange(max_rows, topk)
            except NodecommError as error:
                return str(error)
            return ""

        self._exchange = None
        joined = engine_group.join(group.cpu_group, device, "dcp-topk", usable)
        self._comm, self.disabled_reason = joined.comm, joined.disabled_reason
        if self._comm is None and self._exchange is not None:
            self._exchange.close()  # opened here, not by every rank
            self._exchange = None

    @property
    def disabled(self) -> bool:
        return self._exchange is None

    def merge(
        self,
        logits: torch.Tensor,
        topk_indices: torch.Tensor,
        cp_interleave: int,
        row_starts: torch.Tensor | None,
        score_bits: int = 32,
        id_bits: int = 32,
    ) -> None:
        """vLLM's DirectDCPTopKWorkspace.merge, on the owner exchange."""
        self._exchange.merge(logits, topk_indices, cp_interleave, row_starts, score_bits, id_bits)

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
        if self._comm is not None:
            self._comm.close()


# One workspace per (DCP group, device, topk), as vLLM caches its own; a larger max_rows asked
# later does not reopen it (merges past max_rows run in stages).
_workspaces: dict[tuple[int, torch.device, int], DcpTopkWorkspace] = {}


def workspace(group, device: torch.device, max_rows: int, topk: int) -> DcpTopkWorkspace:
    """The group's workspace for `topk`, opened on the first call: collective over the group's
    ranks, every one of which must call it in the same order (outside CUDA graph capture)."""
    key = (id(group), device, topk)
    if key not in _workspaces:
        made = _workspaces[key] = DcpTopkWorkspace(group, device, max_rows, topk)
        if made.disabled:
            log.warning(
                f"nodecomm's DCP top-k merge disabled; vLLM's own merge runs: {made.disabled_reason}",
                extra={"switch": DCP_TOPK_VARIABLE},
            )
    return _workspaces[key]


def merging(original):
    """vLLM's `_merge_dcp_topk_global`, with its signature, run on nodecomm's exchange; `original`
    where nodecomm cannot serve the DCP group."""

    @functools.wraps(original)
    def _merge_dcp_topk_global(
        logits: torch.Tensor,
        topk_indices: torch.Tensor,
        topk_tokens: int,
        dcp_rank: int,
        dcp_world_size: int,
        cp_interleave: int,
        row_starts: torch.Tensor | None = None,
        logits_dtype: torch.dtype = torch.float32,
        num_positions: int | None = None,
        direct_max_rows: int = 0,
    ) -> None:
        if dcp_world_size <= 1:
            return
        group = sys.modules[INDEXER_MODULE].get_dcp_group()
        key = (id(group), topk_indices.device, topk_tokens)
        if key not in _workspaces and topk_indices.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "nodecomm's DCP top-k merge of this topk runs eagerly first (vLLM's profile run does): its "
                "exchange opens collectively, which a CUDA graph capture cannot hold"
            )
        rows = max(topk_indices.shape[0], direct_max_rows, _batched_tokens(), 1)
        chosen = workspace(group, topk_indices.device, rows, topk_tokens)
        if chosen.disabled:
            original(
                logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, cp_interleave, row_starts=row_starts,
                logits_dtype=logits_dtype, num_positions=num_positions, direct_max_rows=direct_max_rows,
            )  # fmt: skip
            return
        chosen.merge(
            logits, topk_indices, cp_interleave, row_starts, score_bits(logits_dtype),
            32 if num_positions is None else id_bits(num_positions),
        )  # fmt: skip

    _merge_dcp_topk_global.nodecomm_original = original
    return _merge_dcp_topk_global


def _batched_tokens() -> int:
    """vLLM's max_num_batched_tokens, the most rows a merge sees (0 outside a vLLM config)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        return int(config.scheduler_config.max_num_batched_tokens) if config is not None else 0
    except Exception:  # noqa: BLE001 (no config to read: the call's own rows size the exchange)
        return 0


def opening(original_init):
    """SparseAttnIndexer.__init__, then the DCP group's exchange opened while the model is built,
    sized by the indexer's buffer of top-k rows (the most rows a merge of it sees)."""

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs) -> None:  # noqa: N807 (the method it wraps)
        original_init(self, *args, **kwargs)
        if getattr(self, "dcp_world_size", 1) > 1:
            buffer = self.topk_indices_buffer
            group = sys.modules[INDEXER_MODULE].get_dcp_group()
            workspace(group, buffer.device, buffer.shape[0], self.topk_tokens)

    __init__.nodecomm_original = original_init
    return __init__


def install() -> None:
    """Replace vLLM's merge in its module (and where a module already imported it by name), and
    open the exchange in SparseAttnIndexer's constructor. Again: a no-op."""
    if not requested(DCP_TOPK_VARIABLE):
        return
    try:
        module = importlib.import_module(INDEXER_MODULE)
        original = getattr(module, MERGE)
        if hasattr(original, "nodecomm_original"):
            return
        indexer = getattr(module, INDEXER_CLASS)
    except Exception as error:  # noqa: BLE001 (vLLM loads plugins unguarded: it runs on with its own merge)
        log.warning(
            f"nodecomm cannot take vLLM's DCP top-k merge ({type(error).__name__}: {error}); vLLM's own runs",
            extra={"switch": DCP_TOPK_VARIABLE},
        )
        return
    ours = merging(original)
    for name, loaded in list(sys.modules.items()):
        if name.startswith("vllm.") and loaded.__dict__.get(MERGE) is original:  # imported by name already
            setattr(loaded, MERGE, ours)
    indexer.__init__ = opening(indexer.__init__)
    log.info("nodecomm takes vLLM's DCP top-k merge", extra={"switch": DCP_TOPK_VARIABLE})
