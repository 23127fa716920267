"""The integrated families' config dataclasses and their named sizes (torch-free).

The tools that only need a model's sizes — ``knapformer cluster``, ``knapformer plan`` — read
them from here without importing torch or the model's library; the family adapters
(``integrations/flux.py``, ``flux2.py``, ``wan.py``, ``torchtitan_flux.py``) build models from
the same configs. :mod:`knapformer.integrations.registry` finds each family's size table by
name (``CONFIGS`` there).

Sizes of the released models (from their published configs):

- Flux.1 [dev] (diffusers ``FluxTransformer2DModel``; torchtitan ``flux-dev``, ``flux-schnell``):
  19 double + 38 single blocks, 24 heads of 128, 64 latent channels, T5 text of 4,096, pooled
  CLIP of 768, RoPE axes (16, 56, 56).
- Flux.2 [dev] (``Flux2Transformer2DModel``): 8 double + 48 single blocks, 48 heads of 128,
  128 latent channels, text of 15,360, RoPE axes (32, 32, 32, 32), guidance embedding.
- Wan 2.1 T2V 1.3B / 14B (``WanTransformer3DModel``): 12 / 40 heads of 128, 30 / 40 blocks, FFN
  8,960 / 13,824, 16 latent channels, 1×2×2 patches, umT5 text of 4,096, 512 text tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from knapformer.workload import WorkloadModel

__all__ = [
    "FLUX2_PRESETS",
    "FLUX_PRESETS",
    "TITAN_FLUX_PRESETS",
    "WAN_PRESETS",
    "DiffusersFlux2Config",
    "DiffusersFluxConfig",
    "DiffusersWanConfig",
    "FluxSizes",
    "TitanFluxConfig",
    "wan_cost",
]


class FluxSizes:
    """The sizes the tools read from a Flux-style preset config (a dataclass with
    ``num_heads``, ``head_dim``, ``num_double``, ``num_single`` and ``in_dim``)."""

    num_heads: int
    head_dim: int
    num_double: int
    num_single: int
    in_dim: int

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_layers(self) -> int:
        return self.num_double + self.num_single

    @property
    def out_dim(self) -> int:
        return self.in_dim

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        """The planner's cost model: the paper's form (``24·d²`` FLOPs per token and block in
        either stream), every double and single block a layer, the heads bounding the degrees."""
        return WorkloadModel(d_model=self.dim, gamma=gamma, num_layers=self.num_layers, num_heads=self.num_heads)


@dataclass(frozen=True, kw_only=True)
class DiffusersFluxConfig(FluxSizes):
    """A randomly initialised diffusers ``FluxTransformer2DModel`` (no download); the defaults
    are the ``diffusers-flux-tiny`` preset."""

    num_heads: int = 4
    head_dim: int = 32
    num_double: int = 2
    num_single: int = 2
    in_dim: int = 16
    """Latent channels (``in_channels``)."""
    text_dim: int = 32
    """``joint_attention_dim``."""
    vec_dim: int = 32
    """``pooled_projection_dim``."""
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)


@dataclass(frozen=True, kw_only=True)
class DiffusersFlux2Config(FluxSizes):
    """A randomly initialised diffusers ``Flux2Transformer2DModel`` (no download); the defaults
    are the ``diffusers-flux2-tiny`` preset."""

    num_heads: int = 4
    head_dim: int = 16
    num_double: int = 1
    num_single: int = 2
    in_dim: int = 16
    """Latent channels (``in_channels``)."""
    text_dim: int = 32
    """``joint_attention_dim``."""
    axes_dims_rope: tuple[int, ...] = (4, 4, 4, 4)
    guidance: bool = False


@dataclass(frozen=True, kw_only=True)
class TitanFluxConfig(FluxSizes):
    """A randomly initialised torchtitan ``FluxModel`` (no download) built with torchtitan's own
    block configs; the defaults are the ``torchtitan-flux-tiny`` preset."""

    num_heads: int = 4
    head_dim: int = 16
    num_double: int = 2
    num_single: int = 2
    in_dim: int = 16
    """Latent channels of a packed patch (``in_channels`` = ``out_channels``)."""
    text_dim: int = 32
    """``context_in_dim`` (T5 width)."""
    vec_dim: int = 24
    """``vec_in_dim`` (CLIP pooled width)."""
    axes_dim: tuple[int, int, int] = (4, 6, 6)
    mlp_ratio: float = 4.0


def wan_cost(d: int, ffn: int, layers: int, heads: int, context_len: int, gamma: float = 1.0) -> WorkloadModel:
    """Wan's planner cost model. Per token and layer: self-attention q/k/v/o (4·d²),
    cross-attention q/o (2·d²) and the FFN (2·d·ffn) multiply-adds, 2 FLOPs each;
    cross-attention over ``context_len`` tokens."""
    return WorkloadModel(
        d_model=d,
        gamma=gamma,
        num_layers=layers,
        num_heads=heads,
        linear=2.0 * (6.0 * d * d + 2.0 * d * ffn),
        context_len=context_len,
    )


@dataclass(frozen=True, kw_only=True)
class DiffusersWanConfig:
    """A randomly initialised diffusers ``WanTransformer3DModel`` (no download); the defaults
    are the ``diffusers-wan-tiny`` preset (T2V; ``image_dim`` set = I2V)."""

    num_heads: int = 4
    head_dim: int = 16
    num_layers: int = 2
    in_channels: int = 4
    out_channels: int = 4
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 32
    freq_dim: int = 32
    ffn_dim: int = 128
    image_dim: int | None = None
    context_len: int = 32
    """Typical text tokens per sample, for the planner's cross-attention term."""

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def in_dim(self) -> int:
        """Features of one video token before the patch embedding (C·p_t·p_h·p_w)."""
        return self.in_channels * math.prod(self.patch_size)

    @property
    def out_dim(self) -> int:
        return self.out_channels * math.prod(self.patch_size)

    @property
    def vec_dim(self) -> int:
        return 1

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        return wan_cost(self.dim, self.ffn_dim, self.num_layers, self.num_heads, self.context_len, gamma)


_FLUX_DEV = dict(num_heads=24, head_dim=128, num_double=19, num_single=38, in_dim=64, text_dim=4096, vec_dim=768)
"""FLUX.1-dev's sizes (diffusers' and torchtitan's models alike; RoPE axes (16, 56, 56))."""


def _flux_dev() -> DiffusersFluxConfig:
    return DiffusersFluxConfig(**_FLUX_DEV, axes_dims_rope=(16, 56, 56))


def _flux2_dev() -> DiffusersFlux2Config:
    return DiffusersFlux2Config(
        num_heads=48,
        head_dim=128,
        num_double=8,
        num_single=48,
        in_dim=128,
        text_dim=15360,
        axes_dims_rope=(32, 32, 32, 32),
        guidance=True,
    )


def _titan_flux_dev() -> TitanFluxConfig:
    return TitanFluxConfig(**_FLUX_DEV, axes_dim=(16, 56, 56))


def _wan(heads: int, layers: int, ffn: int) -> Callable[[], DiffusersWanConfig]:
    def make() -> DiffusersWanConfig:
        return DiffusersWanConfig(
            num_heads=heads,
            head_dim=128,
            num_layers=layers,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=ffn,
            context_len=512,
        )

    return make


FLUX_PRESETS: dict[str, Callable[[], Any]] = {"tiny": DiffusersFluxConfig, "dev": _flux_dev}
FLUX2_PRESETS: dict[str, Callable[[], Any]] = {"tiny": DiffusersFlux2Config, "dev": _flux2_dev}
TITAN_FLUX_PRESETS: dict[str, Callable[[], Any]] = {
    "tiny": TitanFluxConfig,
    "dev": _titan_flux_dev,
    "schnell": _titan_flux_dev,  # the same sizes; schnell differs in training, not in shape
}
WAN_PRESETS: dict[str, Callable[[], Any]] = {
    "tiny": DiffusersWanConfig,
    "1.3b": _wan(12, 30, 8960),
    "14b": _wan(40, 40, 13824),
}
"""Each family's sizes by name: the preset ``<family>-<size>`` is ``PRESETS[size]()``."""
