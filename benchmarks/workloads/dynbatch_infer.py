"""Inference of a small transformer encoder on requests of changing batch size
and length, as a server batching whatever arrived: short-lived activations of a
new shape for every request, no gradients.

    pyalloc record -o benchmarks/traces/encoder-dynbatch-infer.pickle.gz -- \
        python benchmarks/workloads/dynbatch_infer.py
"""
import argparse
import random

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pool = nn.Linear(d, d)

    def forward(self, idx: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        x = self.encoder(x, src_key_padding_mask=pad)
        return torch.tanh(self.pool(x[:, 0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    shapes = random.Random(args.seed)
    vocab, max_len = 4096, 256
    model = Encoder(vocab, d=128, layers=3, heads=4, max_len=max_len).eval()
    with torch.inference_mode():
        for _ in range(args.requests):
            batch, length = shapes.randint(1, 24), shapes.randrange(8, max_len + 1, 8)
            idx = torch.randint(vocab, (batch, length))
            lengths = torch.randint(1, length + 1, (batch,))
            pad = torch.arange(length)[None, :] >= lengths[:, None]
            model(idx, pad)


if __name__ == "__main__":
    main()
