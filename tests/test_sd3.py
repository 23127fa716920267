"""Balancing a stock diffusers SD3Transformer2DModel (the family added on the seam in one small
file): the packed forward equals the stock per-sample forward (fp64, outputs and every parameter
gradient) for images of several sizes and aspect ratios, one-patch images and one-token text,
with and without QK norm; the stock forward keeps its behaviour; an empty rank joins the
backward; bad input names the sample and field; on 2 gloo ranks (one spawn) ``auto`` with a link
model, an empty rank, a ring plan, FSDP2 + checkpointing, and a bad sample on one rank raising
on both; the tools run its preset."""

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")

from knapformer.testing import run_distributed  # noqa: E402
from tests import sd3_workers as W  # noqa: E402
from tests.hunyuanvideo15_workers import grad_error, rel  # noqa: E402


def _samples():
    return [
        W.make_sample(4, 6, 3, 1),
        W.make_sample(1, 1, 1, 2),  # one patch, one text token
        W.make_sample(8, 3, 5, 3),  # tall
        W.make_sample(2, 9, 7, 4),  # wide
    ]


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_packed_forward_equals_stock_per_sample(qk_norm):
    """Measured: outputs ~5e-16, gradients ~2e-15 relative."""
    from knapformer.integrations.sd3 import packed_sd3_forward

    ref = W.tiny(qk_norm=qk_norm, num_layers=3)
    model = copy.deepcopy(ref)
    samples = _samples()
    tg = W.targets(samples)
    outs = packed_sd3_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    for o, r in zip(outs, stock):
        assert o.shape == r.shape and rel(o, r) < W.OUT_TOL, (o.shape, r.shape, rel(o, r))
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    worst, missing = grad_error(model, ref, 1)
    assert not missing and worst < W.GRAD_TOL, (worst, missing)


def test_stock_forward_unchanged_and_an_empty_rank_joins_the_backward():
    from knapformer.integrations.sd3 import packed_sd3_forward, prepare_sd3

    ref = W.tiny()
    model = copy.deepcopy(ref)
    prepare_sd3(model)
    s = W.make_sample(3, 2, 4, 0)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))
    out = packed_sd3_forward(model, [])
    assert list(out) == [] and out.flat.shape == (0, 16)
    out.flat.sum().backward()
    W.stock_forward(ref, s).sum().backward()
    # exactly the parameters the stock forward leaves without a gradient have none
    assert {n for n, p in model.named_parameters() if p.grad is None} == {
        n for n, p in ref.named_parameters() if p.grad is None
    }


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("latents", torch.zeros(4, 5, 4), r"sample 1: latents must be \(4, H, W\) in whole patches \(2, 2\)"),
        ("latents", torch.zeros(3, 4, 4), r"latents must be \(4, H, W\) .*got \(3, 4, 4\)"),
        ("latents", torch.zeros(4, 66, 4), r"each at most 64, got \(4, 66, 4\)"),
        ("text", torch.zeros(3, 5), r"sample 1: text must be \(T_txt, 32\)"),
        ("pooled", torch.zeros(3), r"sample 1: pooled must be \(24,\), got \(3,\)"),
        ("timestep", torch.zeros(2), "sample 1: timestep must be one value, got 2"),
    ],
)
def test_bad_samples_name_the_sample_and_field(field, value, match):
    from knapformer.integrations.sd3 import packed_sd3_forward, sd3_seq_lens

    bad = W.make_sample(2, 2, 3, 1)
    setattr(bad, field, value.double())
    model = W.tiny()
    assert len(sd3_seq_lens(model, [bad])) == 1  # planning never raises: the forward names the sample
    with pytest.raises(ValueError, match=match):
        packed_sd3_forward(model, [W.make_sample(2, 3, 2, 0), bad])


def test_dual_attention_layers_are_refused():
    from diffusers import SD3Transformer2DModel

    from knapformer.integrations.sd3 import packed_sd3_forward

    model = SD3Transformer2DModel(
        sample_size=16, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=64, pooled_projection_dim=24, pos_embed_max_size=32,
        dual_attention_layers=(0,),
    )  # fmt: skip
    with pytest.raises(ValueError, match="dual-attention layers"):
        packed_sd3_forward(model.double(), [W.make_sample(2, 2, 2, 0)])


def test_balanced_equals_stock_on_two_ranks():
    """One spawn: ``auto`` with a link model (a large image split over both ranks next to whole
    samples), an empty rank, a ring plan (one head), QK norm under FSDP2 + checkpointing; then a
    bad sample on rank 1 raises on both."""
    res = run_distributed(W.check_sd3_cases, 2, timeout=240)
    for rank in res:
        for case in W.CASES:
            r = rank[case]
            assert not r["missing"], (case, r["missing"][:3])
            tol = W.RING_OUT_TOL if r["rings"] else W.OUT_TOL
            assert r["out_err"] < tol and r["grad_err"] < W.GRAD_TOL, (case, r)
    assert 2 in res[0]["auto"]["sizes"] and res[1]["auto-empty-rank"]["routed"] > 0
    assert res[0]["ring"]["rings"] == [2], res[0]["ring"]
    assert all(r["qk-norm-fsdp-checkpointing"]["routed"] > 0 for r in res)
    for case in range(2):
        assert [r["bad"][case][0] for r in res] == ["BalancerInputError"] * 2, [r["bad"][case] for r in res]
        assert all("bad input on rank(s) [1]" in r["bad"][case][1] for r in res)
    assert "sample 0: latents must be" in res[0]["bad"][0][1] and "sample 0: text must be" in res[0]["bad"][1][1]


def test_the_tools_know_the_presets():
    from knapformer.cluster import ModelShape
    from knapformer.integrations.registry import model_config, preset_names
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    assert {"diffusers-sd3-tiny", "diffusers-sd3-3-medium", "diffusers-sd3-3.5-large"} <= set(preset_names())
    big = model_config("diffusers-sd3-3.5-large")
    assert (big.dim, big.num_heads, big.num_layers, big.in_dim, big.qk_norm) == (2432, 38, 38, 64, "rms_norm")
    assert ModelShape.from_config(big).workload().num_layers == 38
    rep = simulate(
        SimConfig(
            ranks=2,
            model="diffusers-sd3-tiny",
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


def test_seq_lens_take_the_model_and_the_old_form_warns():
    """Every family's lengths function takes the model first (issue 59, item 16): SD3's reads
    the patch size from it, so a patch-1 model cannot be planned for a quarter of its tokens;
    the old one-argument forms still work until 0.4, with a DeprecationWarning."""
    from knapformer.integrations.flux import flux_seq_lens
    from knapformer.integrations.sd3 import sd3_seq_lens

    s = W.make_sample(4, 6, 3, 0)  # (8, 12) latents: 4 × 6 patches of 2, or 8 × 12 of 1
    assert sd3_seq_lens(W.tiny(), [s]) == [4 * 6 + 3]
    assert sd3_seq_lens(W.tiny(patch_size=1), [s]) == [8 * 12 + 3]
    with pytest.raises(ValueError, match="differs from the model's"):
        sd3_seq_lens(W.tiny(), [s], patch_size=1)
    with pytest.warns(DeprecationWarning, match=r"sd3_seq_lens\(model, samples\)"):
        assert sd3_seq_lens([s]) == [4 * 6 + 3]
    with pytest.warns(DeprecationWarning):
        assert sd3_seq_lens([s], 1) == sd3_seq_lens([s], patch_size=1) == [8 * 12 + 3]
    with pytest.warns(DeprecationWarning, match=r"flux_seq_lens\(model, samples\)"):
        assert flux_seq_lens([]) == []
