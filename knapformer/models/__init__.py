"""Reference DiT models written as user code (no torch.distributed).

Main API: :class:`Transformer`, :class:`MMDiT`, their configs, :func:`preset` (``tiny``,
``small``, ``flux``) and :class:`LocalExecutor` (no balancing).
"""

from __future__ import annotations

from knapformer.model_configs import PRESETS, DiffusersFluxConfig, MMDiTConfig, TransformerConfig, preset
from knapformer.models.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.models.mmdit import MMDiT
from knapformer.models.transformer import Transformer

__all__ = [
    "PRESETS",
    "LocalExecutor",
    "MMDiT",
    "MMDiTConfig",
    "TokenExecutor",
    "Transformer",
    "TransformerConfig",
    "build_model",
    "local_positions",
    "preset",
]


def build_model(cfg):
    """A model for a config; diffusers presets need ``pip install 'knapformer[diffusers]'``."""
    if isinstance(cfg, DiffusersFluxConfig):
        from knapformer.integrations.diffusers import build_flux

        return build_flux(cfg)
    return MMDiT(cfg) if isinstance(cfg, MMDiTConfig) else Transformer(cfg)
