"""Sizes of the Qwen-Image, HunyuanVideo 1.5 and Stable Diffusion 3 families (torch-free): what
``knapformer cluster``/``plan`` read through the registry's size tables; the integrations build
their models from these configs (:mod:`knapformer.integrations.qwenimage`,
:mod:`knapformer.integrations.hunyuanvideo15`, :mod:`knapformer.integrations.sd3`, which export
them)."""

from __future__ import annotations

from dataclasses import dataclass

from knapformer.workload import WorkloadModel

__all__ = [
    "HUNYUANVIDEO15_PRESETS",
    "QWENIMAGE_PRESETS",
    "SD3_PRESETS",
    "DiffusersHunyuanVideo15Config",
    "DiffusersQwenImageConfig",
    "DiffusersSD3Config",
    "hunyuan_workload",
]


@dataclass(frozen=True, kw_only=True)
class _DiTSizes:
    """What both families' configs start with: heads, head width, layers (the tiny presets')."""

    num_heads: int = 4
    head_dim: int = 16
    num_layers: int = 2

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def vec_dim(self) -> int:
        return 1


@dataclass(frozen=True, kw_only=True)
class DiffusersQwenImageConfig(_DiTSizes):
    """A randomly initialised diffusers ``QwenImageTransformer2DModel`` (no download); the
    defaults are the ``diffusers-qwenimage-tiny`` preset."""

    in_channels: int = 16
    """Features of one packed 2×2 latent patch (the VAE's channels × 4)."""
    out_channels: int = 4
    patch_size: int = 2
    text_dim: int = 32
    """``joint_attention_dim`` (the text encoder's width)."""
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    @property
    def in_dim(self) -> int:
        return self.in_channels

    @property
    def out_dim(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        return WorkloadModel(d_model=self.dim, gamma=gamma, num_layers=self.num_layers, num_heads=self.num_heads)


def _qwen_image_20b() -> DiffusersQwenImageConfig:
    """Qwen-Image's released size (20.4B parameters; -Edit, -Edit-2509 and -Layered share it),
    from the ``QwenImageTransformer2DModel`` ``transformer/config.json`` published with the
    models on the Hugging Face Hub, also diffusers' defaults: 60 layers of 24 heads × 128,
    in_channels 64, out_channels 16, patch 2, joint_attention_dim 3584, axes_dims_rope
    (16, 56, 56)."""
    return DiffusersQwenImageConfig(
        num_heads=24,
        head_dim=128,
        num_layers=60,
        in_channels=64,
        out_channels=16,
        text_dim=3584,
        axes_dims_rope=(16, 56, 56),
    )


def hunyuan_workload(d: int, mlp_ratio: float, layers: int, heads: int, gamma: float) -> WorkloadModel:
    """Per token and layer: q/k/v/o (4·d²) and the MLP (2·mlp_ratio·d²) multiply-adds, 2 FLOPs
    each, in either stream (24·d² at the released mlp_ratio 4)."""
    linear = 2.0 * (4.0 + 2.0 * mlp_ratio) * d * d
    return WorkloadModel(d_model=d, gamma=gamma, num_layers=layers, num_heads=heads, linear=linear)


@dataclass(frozen=True, kw_only=True)
class DiffusersHunyuanVideo15Config(_DiTSizes):
    """A randomly initialised diffusers ``HunyuanVideo15Transformer3DModel`` (no download); the
    defaults are the ``diffusers-hunyuanvideo15-tiny`` preset."""

    num_refiner_layers: int = 1
    mlp_ratio: float = 4.0
    in_channels: int = 9
    """Input channels (released: 32 noisy latent + 32 condition latent + 1 mask = 65)."""
    out_channels: int = 4
    patch_size: int = 1
    patch_size_t: int = 1
    text_dim: int = 32
    """MLLM (Qwen2.5-VL) state width, ``text_embed_dim``."""
    text_2_dim: int = 16
    """byT5 state width, ``text_embed_2_dim``."""
    image_dim: int = 12
    """SigLIP state width, ``image_embed_dim``."""
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    use_meanflow: bool = False

    @property
    def in_dim(self) -> int:
        """Features of one video token before the patch embedding (C·p_t·p·p)."""
        return self.in_channels * self.patch_size_t * self.patch_size**2

    @property
    def out_dim(self) -> int:
        return self.out_channels * self.patch_size_t * self.patch_size**2

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        return hunyuan_workload(self.dim, self.mlp_ratio, self.num_layers, self.num_heads, gamma)


def _released() -> DiffusersHunyuanVideo15Config:
    """HunyuanVideo-1.5 (8.3B; the 480p/720p T2V and I2V transformers share these sizes), from
    diffusers' ``scripts/convert_hunyuan_video1_5_to_diffusers.py`` TRANSFORMER_CONFIGS (the
    ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-*`` configs): 54 layers of 16 heads ×
    128, 2 refiner layers, mlp_ratio 4, in 65 / out 32 channels, patch 1×1×1, text 3584, byT5
    1472, image 1152, rope_axes_dim (16, 56, 56)."""
    return DiffusersHunyuanVideo15Config(
        num_heads=16,
        head_dim=128,
        num_layers=54,
        num_refiner_layers=2,
        in_channels=65,
        out_channels=32,
        text_dim=3584,
        text_2_dim=1472,
        image_dim=1152,
        rope_axes_dim=(16, 56, 56),
    )


QWENIMAGE_PRESETS = {"tiny": DiffusersQwenImageConfig, "20b": _qwen_image_20b}
"""Qwen-Image's sizes: the tests' tiny model and the released 20B."""
HUNYUANVIDEO15_PRESETS = {"tiny": DiffusersHunyuanVideo15Config, "8.3b": _released}
"""HunyuanVideo 1.5's sizes: the tests' tiny model and the released 8.3B."""


@dataclass(frozen=True, kw_only=True)
class DiffusersSD3Config(_DiTSizes):
    """A randomly initialised diffusers ``SD3Transformer2DModel`` (no download); the defaults
    are the ``diffusers-sd3-tiny`` preset. Its blocks cost the paper's ``24·d²`` per token."""

    in_channels: int = 4
    patch_size: int = 2
    text_dim: int = 32
    """``joint_attention_dim`` (the T5 + CLIP width)."""
    pooled_dim: int = 24
    """``pooled_projection_dim``."""
    qk_norm: str | None = None
    pos_embed_max_size: int = 32

    @property
    def vec_dim(self) -> int:
        return self.pooled_dim

    @property
    def in_dim(self) -> int:
        """Features of one latent patch (C·p·p)."""
        return self.in_channels * self.patch_size**2

    @property
    def out_dim(self) -> int:
        return self.in_dim

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        return WorkloadModel(d_model=self.dim, gamma=gamma, num_layers=self.num_layers, num_heads=self.num_heads)


def _sd3(heads: int, qk_norm: str | None = None):
    """A released SD3 size (``transformer/config.json`` of stabilityai's models): ``heads``
    heads of 64 and as many layers, 16 latent channels, patch 2, text 4,096, pooled 2,048,
    positional table 192²."""
    return lambda: DiffusersSD3Config(
        num_heads=heads,
        head_dim=64,
        num_layers=heads,
        in_channels=16,
        text_dim=4096,
        pooled_dim=2048,
        qk_norm=qk_norm,
        pos_embed_max_size=192,
    )


SD3_PRESETS = {"tiny": DiffusersSD3Config, "3-medium": _sd3(24), "3.5-large": _sd3(38, "rms_norm")}
"""Stable Diffusion 3's sizes: the tests' tiny model, SD3 Medium (2B) and SD3.5 Large (8B)."""
