"""Stand-in for vLLM 0.34.0's models/glm5next/nvidia/sparse_indexer.py: it imports the merge by
name, as that module does, and calls it as its decode path does (line 706)."""

from vllm.model_executor.layers.sparse_attn_indexer import _merge_dcp_topk_global


def merge_pools(logits, topk_dst, select_k, dcp_rank, dcp_world_size, pool_cp_interleave, logits_dtype, max_pool_len):
    _merge_dcp_topk_global(
        logits,
        topk_dst,
        select_k,
        dcp_rank,
        dcp_world_size,
        pool_cp_interleave,
        logits_dtype=logits_dtype,
        num_positions=max_pool_len,
    )
