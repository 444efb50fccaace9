"""Stand-in for vLLM 0.34.0's model_executor/layers/sparse_attn_indexer.py: the names nodecomm's
DCP top-k plugin patches and reads. vLLM's own merge is not here: called, it raises, so that a
test sees the plugin did not take it. get_dcp_group() is vLLM's (from
vllm.distributed.parallel_state), here answering the group a rank sets in DCP_GROUP."""

import torch

DCP_GROUP = None  # vLLM's GroupCoordinator of the DCP ranks: cpu_group, world_size, rank_in_group


def get_dcp_group():
    return DCP_GROUP


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
    raise RuntimeError("vLLM's own DCP top-k merge ran: nodecomm's plugin did not take it")


class SparseAttnIndexer:
    """The DCP attributes vLLM's constructor sets (and its other arguments, unread here)."""

    def __init__(self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                 max_total_seq_len, topk_indices_buffer, **others):  # fmt: skip
        self.topk_tokens = topk_tokens
        self.topk_indices_buffer = topk_indices_buffer
        self.dcp_world_size = get_dcp_group().world_size
