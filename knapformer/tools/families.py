"""One small adapter per model family: how the tools build a model, make its inputs from a
synthetic batch, run it through an executor, and time its blocks.

The simulator, the calibrator and the tests dispatch through :func:`family_for` instead of
``isinstance`` chains, so adding a family (e.g. another diffusers model) is one class here.
Every adapter follows the one integration seam: the caller plans the step once with
``seq_lens(inputs)`` and passes the planned executor to ``forward``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn as nn

from knapformer.data.batches import Batch
from knapformer.integrations.diffusers import DiffusersFluxConfig
from knapformer.integrations.wan import DiffusersWanConfig
from knapformer.model_configs import MMDiTConfig, TransformerConfig
from knapformer.models import MMDiT, Transformer
from knapformer.models.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.models.mmdit import token_meta

__all__ = ["BlockRunner", "Family", "family_for"]

BlockRunner = tuple[str, int, Callable[[Sequence[int], bool], Callable[[], None]]]
"""(block type, layers of that type, make(seq_lens, backward) -> a callable running one block)."""


@dataclass(frozen=True)
class StepInputs:
    """What one rank feeds its model in one step (built once per step, used by both runs)."""

    seq_lens: list[int]
    """Lengths to plan the step with (tokens per sample, as the model lays them out)."""
    args: Any
    """The family's own inputs (a batch, or diffusers samples)."""
    target: torch.Tensor
    """Rows the output is compared with, in the output's order."""


class Family(ABC):
    """Adapter interface (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def build(self, cfg: Any) -> nn.Module:
        """A freshly initialised model of ``cfg`` (on CPU; the caller moves it)."""

    def inputs(self, batch: Batch, cfg: Any) -> StepInputs:
        """This step's inputs from a synthetic batch (the reference models take it as is)."""
        return StepInputs(seq_lens=list(batch.seq_lens), args=batch, target=batch.target)

    @abstractmethod
    def forward(self, model: nn.Module, inputs: StepInputs, executor: TokenExecutor) -> torch.Tensor:
        """Output rows aligned with ``inputs.target``, through an executor planned for the step."""

    def blocks(self, cfg: Any, device: torch.device, dtype: torch.dtype, causal: bool) -> list[BlockRunner]:
        raise ValueError(f"timing blocks of {self.name} models is not supported")


def _runner(forward: Callable[[], torch.Tensor], backward: bool) -> Callable[[], None]:
    if not backward:

        def run():
            with torch.no_grad():
                forward()

        return run

    def run():
        out = forward()
        out.backward(torch.ones_like(out))

    return run


class TransformerFamily(Family):
    name = "transformer"

    def build(self, cfg: TransformerConfig) -> nn.Module:
        return Transformer(cfg)

    def forward(self, model, inputs, executor):
        b = inputs.args
        return model(b.x, b.seq_lens, executor=executor)

    def blocks(self, cfg, device, dtype, causal):
        block = Transformer(replace(cfg, causal=causal)).to(device, dtype).blocks[0]

        def make(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            x = torch.randn(sum(seq_lens), cfg.dim, device=device, dtype=dtype, requires_grad=backward)
            _, pos = local_positions(seq_lens, device)
            return _runner(lambda: block(x, pos, ex), backward)

        return [("transformer", cfg.num_layers, make)]


class MMDiTFamily(Family):
    name = "mmdit"

    def build(self, cfg: MMDiTConfig) -> nn.Module:
        return MMDiT(cfg)

    def forward(self, model, inputs, executor):
        b = inputs.args
        return model(b.x, b.seq_lens, b.txt_lens, b.t, b.vec, executor=executor)

    def blocks(self, cfg, device, dtype, causal):
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
                return _runner(lambda: block(x, c, meta, ex), backward)

            return make

        return [
            ("double", cfg.num_double, make_for(model.double_blocks[0])),
            ("single", cfg.num_single, make_for(model.single_blocks[0])),
        ]


class DiffusersFluxFamily(Family):
    name = "diffusers-flux"

    def build(self, cfg) -> nn.Module:
        from knapformer.integrations.diffusers import build_flux

        return build_flux(cfg)

    def inputs(self, batch, cfg):
        """Flux samples of a batch and the targets of their image rows (the loss is on images)."""
        from knapformer.integrations.diffusers import flux_seq_lens, samples_from_batch

        samples = samples_from_batch(batch, cfg, seed=0)
        rows, start = [], 0
        for n, t in zip(batch.seq_lens, batch.txt_lens.tolist()):
            rows.append(batch.target[start + t : start + n])
            start += n
        target = torch.cat(rows) if rows else batch.target[:0]
        return StepInputs(seq_lens=flux_seq_lens(samples), args=samples, target=target)

    def forward(self, model, inputs, executor):
        from knapformer.integrations.diffusers import packed_flux_forward

        core = getattr(model, "module", model)
        return packed_flux_forward(core, inputs.args, executor).flat


class DiffusersWanFamily(Family):
    name = "diffusers-wan"

    def build(self, cfg) -> nn.Module:
        from knapformer.integrations.wan import build_wan

        return build_wan(cfg)

    def inputs(self, batch, cfg):
        """Wan samples of a batch (visual rows as videos, text rows as text) and the targets of
        their video rows (text is context, not output)."""
        from knapformer.integrations.wan import samples_from_batch

        samples = samples_from_batch(batch, cfg, seed=0)
        lens = [int(math.prod(s.latents.shape[1:])) // math.prod(cfg.patch_size) for s in samples]
        rows, start = [], 0
        for n, t, v in zip(batch.seq_lens, batch.txt_lens.tolist(), lens):
            rows.append(batch.target[start + t : start + t + v] if n > t else batch.target.new_zeros(1, cfg.out_dim))
            start += n
        target = torch.cat(rows) if rows else batch.target[:0]
        return StepInputs(seq_lens=lens, args=samples, target=target)

    def forward(self, model, inputs, executor):
        from knapformer.integrations.wan import packed_wan_forward

        core = getattr(model, "module", model)
        return packed_wan_forward(core, inputs.args, executor).flat

    def blocks(self, cfg, device, dtype, causal):
        """One stock ``WanTransformerBlock`` on packed tokens of the given lengths, each sequence
        cross-attending to ``cfg.context_len`` text tokens (what the planner's term assumes)."""
        if causal:
            raise ValueError("--causal applies to the transformer presets only (Wan attention is bidirectional)")
        from knapformer.integrations.wan import _CrossPacked, _rope_tables, _SelfPacked, build_wan, prepare_wan

        model = build_wan(replace(cfg, num_layers=1)).to(device)
        if dtype != torch.float32:  # (a dtype argument, even float32, makes diffusers warn)
            model = model.to(dtype)
        prepare_wan(model)
        block = model.blocks[0]

        def make(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            T, D = sum(seq_lens), cfg.dim
            x = torch.randn(1, T, D, device=device, dtype=dtype, requires_grad=backward)
            temb = torch.randn(1, T, 6, D, device=device, dtype=dtype)
            ctx = torch.randn(cfg.context_len * len(seq_lens), D, device=device, dtype=dtype)
            text = ex.route_context(ctx, [cfg.context_len] * len(seq_lens))
            _, pos = local_positions(seq_lens, device)
            grid = torch.stack([pos // 4096, (pos // 64) % 64, pos % 64], dim=1)
            cos, sin = _rope_tables(model, grid)
            cross = _CrossPacked(executor=ex, text=text, image=None)
            selfp = _SelfPacked(executor=ex, cos=cos, sin=sin)
            return _runner(lambda: block(x, cross, temb, selfp), backward)

        return [("wan", cfg.num_layers, make)]


def family_for(cfg: Any) -> Family:
    """The adapter of a model config (reference presets and integration configs)."""
    if isinstance(cfg, MMDiTConfig):
        return MMDiTFamily()
    if isinstance(cfg, TransformerConfig):
        return TransformerFamily()
    if isinstance(cfg, DiffusersFluxConfig):
        return DiffusersFluxFamily()
    if isinstance(cfg, DiffusersWanConfig):
        return DiffusersWanFamily()
    raise ValueError(f"no model family for config {type(cfg).__name__}")
