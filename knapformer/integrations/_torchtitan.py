"""Building torchtitan Flux models for :mod:`knapformer.integrations.torchtitan_flux`: the import
check naming the extra, and a small randomly initialised ``FluxModel`` made with torchtitan's
own block configs (the ``torchtitan-flux-tiny`` preset, tests, docs). Private: the integration
module re-exports the public names."""

from __future__ import annotations

import copy
import dataclasses

from knapformer.integrations.configs import TitanFluxConfig

__all__ = ["TESTED", "TitanFluxConfig", "build_titan_flux", "require_torchtitan"]

TESTED = "0.3"
"""The torchtitan release series this integration was tested with (``knapformer[torchtitan]``)."""


def require_torchtitan():
    """Import ``torchtitan.models.flux`` or raise one clear error naming the extra."""
    try:
        import torchtitan
        import torchtitan.models.flux as flux
    except ImportError as exc:
        raise ImportError(
            f"knapformer's torchtitan integration needs torchtitan {TESTED}.x (with triton and transformers, "
            f"which it imports): pip install 'knapformer[torchtitan]' ({exc})"
        ) from exc
    version = getattr(torchtitan, "__version__", "")
    if version and not version.startswith(TESTED + "."):
        raise ImportError(
            f"torchtitan {version} is not supported (tested: {TESTED}.x): pip install 'knapformer[torchtitan]'"
        )
    return flux


def build_titan_flux(cfg: TitanFluxConfig):
    """A ``FluxModel`` of ``cfg``'s sizes: torchtitan's ``flux-debug`` config with its sizes and
    blocks replaced by ones made with torchtitan's own block-config helpers. Weights are
    PyTorch's default initialisation (torchtitan zeroes the modulation and output layers in
    ``init_weights``; a zeroed model would make every packed-vs-stock check trivially true)."""
    flux = require_torchtitan()
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.flux.model.layers import EmbedND, LastLayer, MLPEmbedder

    if sum(cfg.axes_dim) != cfg.head_dim:
        raise ValueError(f"axes_dim {cfg.axes_dim} must add up to head_dim {cfg.head_dim}")
    D = cfg.dim

    def linear(i: int, o: int):
        return Linear.Config(in_features=i, out_features=o, bias=True)

    def embedder(i: int):
        return MLPEmbedder.Config(in_dim=i, hidden_dim=D, in_layer=linear(i, D), out_layer=linear(D, D))

    double = flux._make_double_block_config(
        hidden_size=D, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, qkv_bias=True
    )
    single = flux._make_single_block_config(hidden_size=D, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio)
    config = dataclasses.replace(
        flux.flux_configs["flux-debug"](),
        in_channels=cfg.in_dim,
        out_channels=cfg.in_dim,
        vec_in_dim=cfg.vec_dim,
        context_in_dim=cfg.text_dim,
        hidden_size=D,
        mlp_ratio=cfg.mlp_ratio,
        num_heads=cfg.num_heads,
        depth=cfg.num_double,
        depth_single_blocks=cfg.num_single,
        axes_dim=cfg.axes_dim,
        img_in=linear(cfg.in_dim, D),
        txt_in=linear(cfg.text_dim, D),
        pe_config=EmbedND.Config(dim=cfg.head_dim, theta=10_000, axes_dim=cfg.axes_dim),
        time_in_config=embedder(256),
        vector_in_config=embedder(cfg.vec_dim),
        double_blocks=[copy.deepcopy(double) for _ in range(cfg.num_double)],
        single_blocks=[copy.deepcopy(single) for _ in range(cfg.num_single)],
        final_layer_config=LastLayer.Config(
            hidden_size=D,
            patch_size=1,
            out_channels=cfg.in_dim,
            linear=linear(D, cfg.in_dim),
            adaln_linear=linear(D, 2 * D),
        ),
    )
    return config.build()
