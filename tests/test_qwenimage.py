"""Balancing a stock diffusers QwenImageTransformer2DModel: the packed forward equals the stock
per-sample forward (fp64, outputs and every parameter gradient) at several resolutions and
aspect ratios, 1x1 latents, one-token, empty and masked text, edit reference images with
zero-timestep modulation (``zero_cond_t``) and layered models; packed FLOPs match stock; on 2
gloo ranks (one spawn) ``auto`` with a link model, an empty rank, a ring plan, FSDP2 +
checkpointing, and a bad sample on one rank raising on both; the tools run its preset."""

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
pytest.importorskip("diffusers.models.transformers.transformer_qwenimage", reason="this diffusers has no Qwen-Image")

from knapformer.testing import run_distributed  # noqa: E402
from tests import qwenimage_workers as W  # noqa: E402


def _samples(variant):
    extra = 1 if variant == "layered" else None
    return [
        W.make_sample([(1, 4, 6)], 5, 1, extra=extra),  # landscape
        W.make_sample([(1, 7, 3)], 2, 2, extra=extra),  # portrait, odd sides
        W.make_sample([(1, 1, 1)], 1, 3, extra=extra),  # 1x1 latents, one text token
        W.make_sample([(1, 3, 2)], 0, 4, extra=extra),  # no text at all
        W.make_sample([(1, 2, 5)], 4, 5, pad=3, holes=True, extra=extra),  # masked text, holes in the mask
        W.make_sample([(1, 4, 4), (1, 2, 3)], 3, 6, refs=1, extra=extra),  # one reference image
        W.make_sample([(1, 2, 2), (1, 3, 3), (1, 1, 2)], 2, 7, refs=1, extra=extra),  # 2 targets/layers + 1
    ]


@pytest.mark.parametrize("variant", list(W.VARIANTS))
def test_packed_forward_equals_stock_per_sample(variant):
    """Measured: outputs ~4e-16, gradients ~1e-15 relative."""
    from knapformer.integrations.qwenimage import packed_qwenimage_forward

    ref = W.tiny_qwen(variant)
    model = copy.deepcopy(ref)
    samples = _samples(variant)
    tg = W.targets(samples)
    outs = packed_qwenimage_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    for o, r in zip(outs, stock):
        assert o.shape == r.shape and W.rel(o, r) < W.OUT_TOL, (o.shape, r.shape, W.rel(o, r))
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    worst, missing = W.grad_error(model, ref, 1)
    assert not missing and worst < W.GRAD_TOL, (worst, missing)


def test_packed_flops_match_stock():
    """FLOPs of the packed forward + backward (all samples in one pass) <= 1.01x the stock
    per-sample passes: the modulation runs once per sample, as in stock."""
    from torch.utils.flop_counter import FlopCounterMode

    from knapformer.integrations.qwenimage import packed_qwenimage_forward

    samples = [s for s in _samples("edit-zero-cond-t") if s.text.shape[0] and s.text_mask is None]
    model = W.tiny_qwen("edit-zero-cond-t")

    def count(fn):
        with FlopCounterMode(display=False) as fc:
            fn().sum().backward()
        return fc.get_total_flops()

    packed = count(lambda: packed_qwenimage_forward(model, samples).flat)
    stock = sum(count(lambda s=s: W.stock_forward(model, s)) for s in samples)
    assert stock > 0 and packed <= 1.01 * stock, (packed, stock)


def test_stock_api_unchanged_and_processors_reinstalled():
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    from knapformer.integrations.qwenimage import packed_qwenimage_forward, prepare_qwenimage

    ref = W.tiny_qwen("edit-zero-cond-t")
    model = copy.deepcopy(ref)
    prepare_qwenimage(model)
    s = W.make_sample([(1, 3, 4), (1, 2, 2)], 3, 0, refs=1, pad=2)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))
        model.set_attn_processor(QwenDoubleStreamAttnProcessor2_0())
        assert W.rel(packed_qwenimage_forward(model, [s])[0], W.stock_forward(ref, s)) < W.OUT_TOL


def test_empty_sample_list_runs_locally():
    from knapformer.integrations.qwenimage import packed_qwenimage_forward

    out = packed_qwenimage_forward(W.tiny_qwen(), [])
    assert list(out) == [] and out.flat.shape == (0, 8)
    out.flat.sum().backward()  # connected: an empty rank joins the backward


@pytest.mark.parametrize(
    "case, match",
    [
        ("width", r"sample 0: latents must be \(T_img, 8\)"),
        ("shapes", "img_shapes .* hold 4 tokens; latents \\+ ref_latents have 6"),
        ("text", r"text must be \(L_txt, 6\)"),
        ("mask", r"text_mask must be \(2,\)"),
        ("extra", "needs additional_t_cond"),
        ("rope", "exceeds the model's table"),
    ],
)
def test_bad_samples_are_clear_errors(case, match):
    from knapformer.integrations.qwenimage import packed_qwenimage_forward

    model = W.tiny_qwen("layered" if case == "extra" else "plain")
    s = W.make_sample([(1, 2, 3)], 2, 0)
    if case == "width":
        s.latents = torch.randn(6, 5, dtype=torch.float64)
    elif case == "shapes":
        s.img_shapes = [(1, 2, 2)]
    elif case == "text":
        s.text = torch.randn(2, 4, dtype=torch.float64)
    elif case == "mask":
        s.text_mask = torch.ones(3, dtype=torch.bool)
    elif case == "rope":
        s.latents, s.img_shapes = torch.randn(8190, 8, dtype=torch.float64), [(1, 1, 8190)]
    with pytest.raises(ValueError, match=match):
        packed_qwenimage_forward(model, [s])


def test_balanced_equals_stock_on_two_ranks():
    """One spawn: ``auto`` with a link model (a long image split over both ranks next to whole
    ones), an empty rank, a ring plan (one head: the long sample can only spread as a ring),
    an edit model with reference images under FSDP2 + checkpointing; then a bad sample on rank
    1 raises on both ranks."""
    res = run_distributed(W.check_qwen_cases, 2, timeout=240)
    for rank in res:
        for case in W.CASES:
            r = rank[case]
            assert not r["missing"], (case, r["missing"][:3])
            tol = W.RING_OUT_TOL if r["rings"] else W.OUT_TOL
            assert r["out_err"] < tol and r["grad_err"] < W.GRAD_TOL, (case, r)
    assert 2 in res[0]["auto"]["sizes"] and res[1]["auto-empty-rank"]["routed"] > 0
    assert res[0]["ring"]["rings"] == [2], res[0]["ring"]
    assert all(r["edit-fsdp-checkpointing"]["routed"] > 0 for r in res)
    assert res[1]["g1n2-idle-rank"]["routed"] == 0
    for case in range(2):
        assert [r["bad"][case][0] for r in res] == ["BalancerInputError"] * 2, [r["bad"][case] for r in res]
        assert all("bad input on rank(s) [1]" in r["bad"][case][1] for r in res)
    assert "latents must be" in res[0]["bad"][0][1] and "img_shapes" in res[0]["bad"][1][1]


def test_simulator_calibrator_and_cluster_know_the_presets(tmp_path):
    from knapformer.cluster import ModelShape
    from knapformer.integrations.registry import model_config, preset_names
    from knapformer.tools.calibrate import calibrate
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    assert {"diffusers-qwenimage-tiny", "diffusers-qwenimage-20b"} <= set(preset_names())
    big = model_config("diffusers-qwenimage-20b")
    assert (big.dim, big.num_heads, big.num_layers, big.in_dim, big.out_dim) == (3072, 24, 60, 64, 64)
    assert ModelShape.from_config(big).workload().num_layers == 60  # what `knapformer cluster --model` reads
    rep = simulate(
        SimConfig(
            ranks=2,
            model="diffusers-qwenimage-tiny",
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
            "diffusers-qwenimage-tiny",
            lengths=[32, 128, 512],  # long enough to grow past per-call overhead on a busy VM
            holdout=[256],
            fit_mixes=[[32] * 4, [128, 128]],
            holdout_mixes=[[32, 256]],
            repeats=1,
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    assert set(report["blocks"]) == {"qwenimage"} and profile.linear_coef + profile.quadratic > 0
