"""Shapes and named presets of the reference models (torch-free: the cluster model and the
CLI read them). Presets of integrated third-party models (diffusers) live with their
integration; ``knapformer.integrations.registry`` knows both.

Main API: :class:`MMDiTConfig`, :class:`TransformerConfig`, :data:`PRESETS`, :func:`preset`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MMDiTConfig", "TransformerConfig", "PRESETS", "preset"]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    in_dim: int = 32
    """Input feature size per token."""
    dim: int = 64
    """Model width D."""
    num_heads: int = 4
    """Attention heads (must be divisible by every bag size)."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA when fewer than ``num_heads``, MQA at 1); None = ``num_heads``."""
    num_layers: int = 2
    mlp_ratio: float = 4.0
    out_dim: int = 32
    causal: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.num_heads} must be even for RoPE")
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(f"num_kv_heads {kv} must divide num_heads {self.num_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def num_double(self) -> int:
        return 0

    @property
    def num_single(self) -> int:
        return self.num_layers


@dataclass(frozen=True, kw_only=True)
class MMDiTConfig:
    in_dim: int = 16
    """Features per input token (latent patch or text embedding)."""
    vec_dim: int = 16
    """Pooled (global) conditioning vector size per sequence."""
    dim: int = 64
    num_heads: int = 4
    num_double: int = 2
    num_single: int = 2
    mlp_ratio: float = 4.0
    out_dim: int = 16

    def __post_init__(self) -> None:
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.num_heads} heads of even size")

    @property
    def num_layers(self) -> int:
        return self.num_double + self.num_single


PRESETS: dict[str, MMDiTConfig | TransformerConfig] = {
    "mmdit-tiny": MMDiTConfig(in_dim=16, vec_dim=16, dim=64, num_heads=4, num_double=2, num_single=2, out_dim=16),
    "mmdit-small": MMDiTConfig(in_dim=32, vec_dim=32, dim=128, num_heads=4, num_double=2, num_single=4, out_dim=32),
    "flux": MMDiTConfig(in_dim=64, vec_dim=768, dim=3072, num_heads=24, num_double=19, num_single=38, out_dim=64),
    "transformer-tiny": TransformerConfig(in_dim=16, dim=64, num_heads=4, num_layers=2, out_dim=16),
    "mmdit-2head": MMDiTConfig(in_dim=16, vec_dim=16, dim=64, num_heads=2, num_double=2, num_single=2, out_dim=16),
}
"""Named sizes: ``*-tiny``/``mmdit-small``/``mmdit-2head`` run on CPU in seconds; ``flux`` is the
Flux.1 size. ``mmdit-2head`` has two heads, so a group of more than 2 ranks runs as a ring."""


def preset(name: str) -> MMDiTConfig | TransformerConfig:
    """A reference model's preset by name (``knapformer.integrations.registry.resolve_model`` also knows the
    integrations' presets)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
