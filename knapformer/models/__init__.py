"""Reference DiT models written as user code (no torch.distributed).

Main API: :class:`Transformer`, :class:`MMDiT`, their configs, :func:`preset` (``tiny``,
``small``, ``flux``) and :class:`LocalExecutor` (no balancing).
"""

from __future__ import annotations

from knapformer.models.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.models.mmdit import MMDiT, MMDiTConfig
from knapformer.models.transformer import Transformer, TransformerConfig

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

PRESETS: dict[str, MMDiTConfig | TransformerConfig] = {
    "mmdit-tiny": MMDiTConfig(in_dim=16, vec_dim=16, dim=64, num_heads=4, num_double=2, num_single=2, out_dim=16),
    "mmdit-small": MMDiTConfig(in_dim=32, vec_dim=32, dim=128, num_heads=4, num_double=2, num_single=4, out_dim=32),
    "flux": MMDiTConfig(in_dim=64, vec_dim=768, dim=3072, num_heads=24, num_double=19, num_single=38, out_dim=64),
    "transformer-tiny": TransformerConfig(in_dim=16, dim=64, num_heads=4, num_layers=2, out_dim=16),
}
"""Named sizes: ``*-tiny``/``mmdit-small`` run on CPU in seconds; ``flux`` is the Flux.1 size."""


def preset(name: str) -> MMDiTConfig | TransformerConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None


def build_model(cfg: MMDiTConfig | TransformerConfig):
    return MMDiT(cfg) if isinstance(cfg, MMDiTConfig) else Transformer(cfg)
