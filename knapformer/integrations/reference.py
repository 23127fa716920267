"""The reference DiTs (:mod:`knapformer.models`) as a model family: what the tools run by default.

Its presets are the reference configs (``mmdit-tiny``, ``mmdit-small``, ``flux``,
``transformer-tiny``: :data:`knapformer.model_configs.PRESETS`), found by their exact names.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from knapformer.executor import LocalExecutor, local_positions
from knapformer.integrations.family import ModelFamily, block_runner
from knapformer.model_configs import PRESETS, MMDiTConfig
from knapformer.models import MMDiT, Transformer, build_model
from knapformer.models.mmdit import token_meta
from knapformer.parallelize import apply_checkpointing

__all__ = ["ReferenceFamily"]


class ReferenceFamily(ModelFamily):
    """The plain ``Transformer`` and the Flux-style ``MMDiT`` of :mod:`knapformer.models`."""

    name = "reference"
    presets = {name: (lambda cfg=cfg: cfg) for name, cfg in PRESETS.items()}

    @property
    def mmdit(self) -> bool:
        return isinstance(self.config, MMDiTConfig)

    def build(self) -> nn.Module:
        return build_model(self.config)

    def forward(self, model, inputs, executor):
        b = inputs.args
        if self.mmdit:
            return model(b.x, b.seq_lens, b.txt_lens, b.t, b.vec, executor=executor)
        return model(b.x, b.seq_lens, executor=executor)

    def enable_checkpointing(self, model: nn.Module) -> nn.Module:
        return apply_checkpointing(model)

    def blocks(self, device, dtype, causal):
        cfg = self.config
        if not self.mmdit:
            block = Transformer(replace(cfg, causal=causal)).to(device, dtype).blocks[0]

            def make(seq_lens, backward):
                ex = LocalExecutor(seq_lens)
                x = torch.randn(sum(seq_lens), cfg.dim, device=device, dtype=dtype, requires_grad=backward)
                _, pos = local_positions(seq_lens, device)
                return block_runner(lambda: block(x, pos, ex), backward)

            return [("transformer", cfg.num_layers, make)]
        if causal:
            raise ValueError("--causal applies to the transformer presets only (MMDiT attention is bidirectional)")
        model = MMDiT(cfg).to(device, dtype)

        def make_for(block):
            def make(seq_lens, backward):
                ex = LocalExecutor(seq_lens)
                x = torch.randn(sum(seq_lens), cfg.dim, device=device, dtype=dtype, requires_grad=backward)
                c = torch.randn(len(seq_lens), cfg.dim, device=device, dtype=dtype)
                seq, pos = local_positions(seq_lens, device)
                txt = torch.tensor([n // 8 for n in seq_lens], dtype=torch.int64, device=device)
                meta = token_meta(seq, pos, txt)
                return block_runner(lambda: block(x, c, meta, ex), backward)

            return make

        return [
            ("double", cfg.num_double, make_for(model.double_blocks[0])),
            ("single", cfg.num_single, make_for(model.single_blocks[0])),
        ]
