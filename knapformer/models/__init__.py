"""Reference DiT models written as user code (no torch.distributed).

Main API: :class:`Transformer`, :class:`MMDiT`, their configs, :func:`preset` (``tiny``,
``small``, ``flux``) and :func:`build_model`. The executor they call lives in
:mod:`knapformer.executor`; ``LocalExecutor``, ``TokenExecutor`` and ``local_positions`` are
re-exported here for code written against the old location.
"""

from __future__ import annotations

import torch.nn as nn

from knapformer.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.model_configs import PRESETS, MMDiTConfig, TransformerConfig, preset
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


def build_model(cfg: MMDiTConfig | TransformerConfig) -> nn.Module:
    """The reference model of a config (integrated models are built by their integration)."""
    if isinstance(cfg, MMDiTConfig):
        return MMDiT(cfg)
    if isinstance(cfg, TransformerConfig):
        return Transformer(cfg)
    raise TypeError(f"no reference model for {type(cfg).__name__}; integrated models have their own builders")
