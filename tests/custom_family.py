"""A user's own model family, reached by the tools through ``--model tests.custom_family:make``
without any registry line: a small pre-norm Transformer with its own block."""

from __future__ import annotations

import torch
import torch.nn as nn

from knapformer.executor import LocalExecutor, local_positions
from knapformer.integrations.family import ModelDims, ModelFamily, block_runner


class TinyDiT(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2, io: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.inp, self.out = nn.Linear(io, dim), nn.Linear(dim, io)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))

    def block(self, i, h, ex):
        q, k, v = self.qkv[i](h).unflatten(1, (3, self.heads, -1)).unbind(1)
        return h + ex.attention(q, k, v).flatten(1)

    def forward(self, x, seq_lens, executor=None):
        ex = executor if executor is not None else LocalExecutor(seq_lens)
        h = ex.route(self.inp(x), seq_lens=seq_lens)
        for i in range(len(self.qkv)):
            h = self.block(i, h, ex)
        return ex.reverse_route(self.out(h))


class TinyFamily(ModelFamily):
    name = "tiny-dit"

    def dims(self) -> ModelDims:
        return ModelDims(dim=32, num_heads=2, num_kv_heads=None, num_layers=2, in_dim=8, vec_dim=1, out_dim=8)

    def build(self):
        return TinyDiT()

    def forward(self, model, inputs, executor):
        return model(inputs.args.x, inputs.args.seq_lens, executor=executor)

    def blocks(self, device, dtype, causal):
        model = TinyDiT().to(device, dtype)

        def make(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            x = torch.randn(sum(seq_lens), 32, device=device, dtype=dtype, requires_grad=backward)
            local_positions(seq_lens, device)
            return block_runner(lambda: model.block(0, x, ex), backward)

        return [("tiny", 2, make)]


def make() -> TinyFamily:
    return TinyFamily(config=None)
