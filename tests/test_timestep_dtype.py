"""Timesteps reach each family's time embedding as the stock model gets them (issue 59, item 2).

A bf16 model, one sample whose fp32 timestep bf16 would round (998.7 -> 1000 in stock units):
the time embedding the packed forward computes equals the stock forward's, on the same fp32
timestep. The packed forwards used to cast timesteps to the weights' dtype before the
sinusoidal embedding (``stack_scalars(..., dtype)``), which SD3, HunyuanVideo 1.5 (diffusers
and official), Wan and torchtitan's Flux do not do: their stock embedding of t = 998.7 differs
from that of 1000 by O(1). Flux, Flux.2 and Qwen-Image cast to the hidden states' dtype in their
stock forward, and still do packed. Stock forwards that cannot take an fp32 timestep with bf16
weights (a Linear of mixed dtypes) run under CPU autocast, as a bf16 trainer runs them; the
packed forward then runs under it too.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")

UNITS_1000 = 998.7  # stock units 0..1000
UNITS_1 = 0.9987  # stock units 0..1 (the model multiplies by 1000)


def _sd3():
    W = importlib.import_module("tests.sd3_workers")
    from knapformer.integrations.sd3 import packed_sd3_forward

    return W.tiny(), W.make_sample(2, 2, 3, 0), W.stock_forward, packed_sd3_forward, UNITS_1000


def _hunyuan():
    W = importlib.import_module("tests.hunyuanvideo15_workers")
    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    s = W.make_sample(1, 2, 2, 3, 0, glyph=2, image=2)
    return W.tiny_hv(), s, W.stock_forward, packed_hunyuanvideo15_forward, UNITS_1000


def _official():
    W = importlib.import_module("tests.hyvideo15_official_workers")
    from knapformer.integrations.hunyuanvideo15_official import packed_official_forward

    return W.tiny(), W.make_sample(1, 2, 2, 3, 0, glyph=2), W.stock_forward, packed_official_forward, UNITS_1000


def _wan():
    W = importlib.import_module("tests.wan_workers")
    from knapformer.integrations.wan import packed_wan_forward

    return W.tiny_wan(), W.make_sample(1, 4, 4, 3, 0), W.stock_forward, packed_wan_forward, UNITS_1000


def _titan():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    W = importlib.import_module("tests.titan_workers")
    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    return W.tiny_titan_flux(), W.make_sample(2, 2, 3, 0), W.stock_forward, packed_titan_flux_forward, UNITS_1


def _flux():
    W = importlib.import_module("tests.flux_workers")
    from knapformer.integrations.flux import packed_flux_forward

    return W.tiny_flux(), W.make_sample(2, 2, 3, 0), W.stock_forward, packed_flux_forward, UNITS_1


def _flux2():
    W = importlib.import_module("tests.flux2_workers")
    from knapformer.integrations.flux2 import packed_flux2_forward

    return W.tiny_flux2(), W.make_sample(2, 2, 3, 0), W.stock_forward, packed_flux2_forward, UNITS_1


def _qwen():
    W = importlib.import_module("tests.qwenimage_workers")
    from knapformer.integrations.qwenimage import packed_qwenimage_forward

    s = W.make_sample([(1, 2, 2)], 3, 0)
    return W.tiny_qwen(), s, W.stock_forward, packed_qwenimage_forward, UNITS_1


# family -> (setup, the module whose output is the time embedding, stock needs autocast,
# stock keeps the fp32 timestep through the sinusoidal embedding)
FAMILIES = {
    "sd3": (_sd3, lambda m: m.time_text_embed.timestep_embedder, False, True),
    "hunyuanvideo15": (_hunyuan, lambda m: m.time_embed.timestep_embedder, True, True),
    "hunyuanvideo15-official": (_official, lambda m: m.time_in, True, True),
    "wan": (_wan, lambda m: m.condition_embedder.time_embedder, False, True),
    "torchtitan-flux": (_titan, lambda m: m.time_in, True, True),
    "flux": (_flux, lambda m: m.time_text_embed.timestep_embedder, False, False),
    "flux2": (_flux2, lambda m: m.time_guidance_embed.timestep_embedder, False, False),
    "qwenimage": (_qwen, lambda m: m.time_text_embed.timestep_embedder, False, False),
}


def _bf16(sample, timestep: float):
    """The sample's float tensors in bf16, its timestep an fp32 scalar (per-token: all equal)."""
    fields = {}
    for f in dataclasses.fields(sample):
        v = getattr(sample, f.name)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.to(torch.bfloat16)
        fields[f.name] = v
    fields["timestep"] = torch.full_like(torch.as_tensor(sample.timestep), timestep, dtype=torch.float32)
    return dataclasses.replace(sample, **fields)


def _first_output(module: torch.nn.Module, run) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(out.detach().float()[:1]))
    try:
        run()
    finally:
        handle.remove()
    assert seen, "the time embedding never ran"
    return seen[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_time_embedding_equals_stock_on_an_fp32_timestep_in_bf16(family):
    setup, embedder, autocast, keeps_fp32 = FAMILIES[family]
    model, sample, stock_forward, packed_forward, t = setup()
    model = model.to(torch.bfloat16)
    s = _bf16(sample, t)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.no_grad
    with torch.no_grad(), ctx():
        stock = _first_output(embedder(model), lambda: stock_forward(model, s))
        packed = _first_output(embedder(model), lambda: packed_forward(model, [s]))
    if keeps_fp32:  # the probe is sharp: the stock embedding of the bf16-rounded timestep is far off
        rounded = _bf16(sample, float(torch.tensor(t, dtype=torch.float32).to(torch.bfloat16)))
        with torch.no_grad(), ctx():
            other = _first_output(embedder(model), lambda: stock_forward(model, rounded))
        assert (other - stock).norm() > 0.05 * stock.norm(), "the probe timestep must round in bf16"
    err = float((packed - stock).norm() / stock.norm())
    assert err < 1e-2, (family, err)
