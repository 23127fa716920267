"""Balancing a stock diffusers HunyuanVideo15Transformer3DModel: the packed forward equals the
stock per-sample forward (fp64, outputs and every parameter gradient) for images (1 frame) and
videos of several sizes and aspect ratios, 1x1x1 latents, a long video, one-token and masked
MLLM text, byT5 glyph text, I2V image tokens, T2V, MeanFlow reference timesteps and a temporal
patch; packed FLOPs match stock; on 2 gloo ranks (one spawn) ``auto`` with a link model, an
empty rank, a ring plan, FSDP2 + checkpointing, and a bad sample on one rank raising on both;
the tools run its preset."""

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
pytest.importorskip(
    "diffusers.models.transformers.transformer_hunyuan_video15", reason="this diffusers has no HunyuanVideo 1.5"
)

from knapformer.testing import run_distributed  # noqa: E402
from tests import hunyuanvideo15_workers as W  # noqa: E402


def _samples(r=False, **kw):
    t2v = W.make_sample(1, 2, 3, 2, 6, **kw)
    t2v.image_embeds = torch.zeros(4, 3, dtype=torch.float64)  # the T2V pipeline's zero SigLIP rows
    return [
        t2v,
        W.make_sample(3, 4, 5, 4, 1, glyph=2, r=r, **kw),  # video, byT5 glyph text
        W.make_sample(1, 1, 1, 1, 2, **kw),  # an image of 1x1 latents, one text token
        W.make_sample(1, 3, 7, 2, 3, image=3, r=r, **kw),  # a wide image, I2V
        W.make_sample(2, 6, 2, 3, 4, pad=2, glyph=1, glyph_pad=2, image=3, **kw),  # masked text and glyph, tall
        W.make_sample(17, 3, 4, 2, 5, pad=1, **kw),  # a long video (17 latent frames)
    ]


@pytest.mark.parametrize("variant", ["plain", "meanflow", "temporal-patch"])
def test_packed_forward_equals_stock_per_sample(variant):
    """Measured: outputs ~4e-16, gradients ~1e-14 relative."""
    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    kw = {"use_meanflow": True} if variant == "meanflow" else {}
    if variant == "temporal-patch":
        kw = {"patch_size_t": 2, "patch_size": 2}
    ref = W.tiny_hv(**kw)
    model = copy.deepcopy(ref)
    patch = (2, 2) if variant == "temporal-patch" else (1, 1)
    samples = _samples(r=variant == "meanflow", patch=patch)
    tg = W.targets(samples)
    outs = packed_hunyuanvideo15_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    for o, r in zip(outs, stock):
        assert o.shape == r.shape and W.rel(o, r) < W.OUT_TOL, (o.shape, r.shape, W.rel(o, r))
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    worst, missing = W.grad_error(model, ref, 1)
    assert not missing and worst < W.GRAD_TOL, (worst, missing)


def test_a_sample_without_mllm_text():
    """A sample whose MLLM text is empty (all masked): outputs equal stock; the stock refiner
    averages over no token (0/0), so its gradients are NaN, while the packed refiner runs on no
    token (its gradients are zeros: the sample does not reach it); every other gradient equals
    stock."""
    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    ref = W.tiny_hv()
    model = copy.deepcopy(ref)
    s = W.make_sample(1, 3, 2, 0, 3, glyph=2)
    out = packed_hunyuanvideo15_forward(model, [s])[0]
    stock = W.stock_forward(ref, s)
    assert W.rel(out, stock) < W.OUT_TOL
    tg = W.targets([s])[0]
    (out * tg).sum().backward()
    (stock * tg).sum().backward()
    assert torch.isnan(ref.context_embedder.proj_in.weight.grad).all()
    assert not model.context_embedder.proj_in.weight.grad.any()
    worst, missing = W.grad_error(model, ref, 1, skip="context_embedder.")
    assert not missing and worst < W.GRAD_TOL


def test_packed_flops_match_stock():
    """FLOPs of the packed forward + backward (all samples in one pass) <= 1.01x the stock
    per-sample passes. No byT5 text here: its fixed 2048-wide projection would dwarf the rest."""
    from torch.utils.flop_counter import FlopCounterMode

    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    samples = [W.make_sample(3, 4, 5, 4, 1), W.make_sample(1, 3, 7, 2, 3, image=3), W.make_sample(9, 2, 3, 1, 5)]
    model = W.tiny_hv()

    def count(fn):
        with FlopCounterMode(display=False) as fc:
            fn().sum().backward()
        return fc.get_total_flops()

    packed = count(lambda: packed_hunyuanvideo15_forward(model, samples).flat)
    stock = sum(count(lambda s=s: W.stock_forward(model, s)) for s in samples)
    assert stock > 0 and packed <= 1.01 * stock, (packed, stock)


def test_stock_api_unchanged_and_processors_reinstalled():
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward
    from knapformer.integrations.hunyuanvideo15_attention import prepare_hunyuanvideo15

    ref = W.tiny_hv()
    model = copy.deepcopy(ref)
    prepare_hunyuanvideo15(model)
    s = W.make_sample(2, 3, 4, 3, 0, pad=2, glyph=1, image=2)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))
        for b in model.transformer_blocks:
            b.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
        for b in model.context_embedder.token_refiner.refiner_blocks:
            b.attn.set_processor(AttnProcessor2_0())
        assert W.rel(packed_hunyuanvideo15_forward(model, [s])[0], W.stock_forward(ref, s)) < W.OUT_TOL


def test_empty_sample_list_runs_locally():
    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    model = W.tiny_hv(use_meanflow=True)
    out = packed_hunyuanvideo15_forward(model, [])
    assert list(out) == [] and out.flat.shape == (0, 2)
    out.flat.sum().backward()  # connected: an empty rank joins the backward
    # every parameter gets a gradient but those the stock model leaves without one too (the last
    # block's context outputs feed nothing)
    dead = ("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.ff_context.")
    assert {n for n, p in model.named_parameters() if p.grad is None} == {
        n for n, _ in model.named_parameters() if n.startswith(dead)
    }


@pytest.mark.parametrize(
    "case, match",
    [
        ("channels", r"latents must be \(5, F, H, W\)"),
        ("odd-size", "multiples of the patch size"),
        ("text", r"text must be \(L, 6\)"),
        ("glyph", r"text_2 must be \(L, 4\)"),
        ("image", r"image_embeds must be \(L, 3\)"),
        ("mask", r"the mask of text must be \(2,\)"),
        ("timestep_r", "no MeanFlow embedder"),
    ],
)
def test_bad_samples_are_clear_errors(case, match):
    from knapformer.integrations.hunyuanvideo15 import packed_hunyuanvideo15_forward

    model = W.tiny_hv(patch_size=2) if case == "odd-size" else W.tiny_hv()
    s = W.make_sample(1, 2, 4, 2, 0)
    if case == "channels":
        s.latents = torch.randn(4, 1, 2, 4, dtype=torch.float64)
    elif case == "odd-size":
        s.latents = torch.randn(5, 1, 3, 4, dtype=torch.float64)
    elif case == "text":
        s.text = torch.randn(2, 5, dtype=torch.float64)
    elif case == "glyph":
        s.text_2 = torch.randn(2, 5, dtype=torch.float64)
    elif case == "image":
        s.image_embeds = torch.randn(2, 5, dtype=torch.float64)
    elif case == "mask":
        s.text_mask = torch.ones(3, dtype=torch.bool)
    elif case == "timestep_r":
        s.timestep_r = torch.tensor(3.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        packed_hunyuanvideo15_forward(model, [s])


def test_balanced_equals_stock_on_two_ranks():
    """One spawn: ``auto`` with a link model (a long video split over both ranks next to whole
    samples), an I2V video next to an empty rank, a ring plan (one head: the long video can
    only spread as a ring), FSDP2 + checkpointing; then a bad sample on rank 1 raises on both."""
    res = run_distributed(W.check_hv_cases, 2, timeout=240)
    for rank in res:
        for case in W.CASES:
            r = rank[case]
            assert not r["missing"], (case, r["missing"][:3])
            tol = W.RING_OUT_TOL if r["rings"] else W.OUT_TOL
            assert r["out_err"] < tol and r["grad_err"] < W.GRAD_TOL, (case, r)
    assert 2 in res[0]["auto"]["sizes"] and res[1]["auto-empty-rank-i2v"]["routed"] > 0
    assert res[0]["ring"]["rings"] == [2], res[0]["ring"]
    assert all(r["fsdp-checkpointing"]["routed"] > 0 for r in res)
    assert res[1]["g1n2-idle-rank"]["routed"] == 0
    for case in range(2):
        assert [r["bad"][case][0] for r in res] == ["BalancerInputError"] * 2, [r["bad"][case] for r in res]
        assert all("bad input on rank(s) [1]" in r["bad"][case][1] for r in res)
    assert "latents must be" in res[0]["bad"][0][1] and "text_2 must be" in res[0]["bad"][1][1]


def test_simulator_calibrator_and_cluster_know_the_presets():
    from knapformer.cluster import ModelShape
    from knapformer.integrations.registry import model_config, preset_names
    from knapformer.tools.calibrate import calibrate
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    assert {"diffusers-hunyuanvideo15-tiny", "diffusers-hunyuanvideo15-8.3b"} <= set(preset_names())
    big = model_config("diffusers-hunyuanvideo15-8.3b")
    assert (big.dim, big.num_heads, big.num_layers, big.in_dim, big.out_dim) == (2048, 16, 54, 65, 32)
    assert ModelShape.from_config(big).workload().num_layers == 54  # what `knapformer cluster --model` reads
    rep = simulate(
        SimConfig(
            ranks=2,
            model="diffusers-hunyuanvideo15-tiny",
            mix="g1b2i128f1s0,g1b1i256f1s0",
            bags="auto",
            scale=2,
            steps=1,
            warmup=0,
            peak_tflops=0.01,
            progress=False,
        )
    )
    assert rep["loss_match"] and rep["modes"]["balanced"]["plans_per_rank_step"] == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny blocks: threads spinning on a loaded 2-vCPU box swamp the timings
    try:
        profile, report = calibrate(
            "diffusers-hunyuanvideo15-tiny",
            lengths=[32, 128, 512],  # long enough to grow past per-call overhead on a busy VM
            holdout=[256],
            fit_mixes=[[32] * 4, [128, 128]],
            holdout_mixes=[[32, 256]],
            repeats=1,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    assert set(report["blocks"]) == {"hunyuanvideo15"} and profile.linear_coef + profile.quadratic > 0
