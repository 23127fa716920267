"""Balancing the *official* HunyuanVideo 1.5 transformer class (the authors' own module, here the
test fixture :mod:`tests.hyvideo15_reference`, a faithful tiny reimplementation from their
public source, since their code is not on the package index): the packed forward equals the
official forward run one sample at a time (fp64, outputs and every parameter gradient) for
images and videos of several sizes, masked MLLM text, byT5 glyph text, I2V vision states, T2V
zero vision states, MeanFlow, guidance embedding, a temporal patch and a model without the
optional inputs; the stock forward keeps its behaviour; an empty rank joins the backward; bad
input is a clear error naming the sample and field; on 2 gloo ranks (one spawn) ``auto`` with a
link model, an empty rank, a ring plan, FSDP2 + checkpoint_wrapper, and a bad sample on one
rank raising on both."""

import copy

import pytest
import torch

from knapformer.integrations.hunyuanvideo15_official import (
    official_seq_lens,
    official_workload,
    packed_official_forward,
    prepare_official,
)
from knapformer.testing import run_distributed
from tests import hyvideo15_official_workers as W
from tests.hunyuanvideo15_workers import grad_error, rel


def _samples(r=False, patch=(1, 1, 1)):
    t2v = W.make_sample(1, 2, 3, 2, 6, patch=patch)
    t2v.vision = torch.zeros(3, 14, dtype=torch.float64)  # the T2V pipeline's zero SigLIP rows
    return [
        t2v,
        W.make_sample(3, 4, 5, 4, 1, glyph=2, r=r, patch=patch),  # video, byT5 glyph text
        W.make_sample(1, 1, 1, 1, 2, patch=patch),  # an image of one latent patch, one text token
        W.make_sample(1, 3, 7, 2, 3, image=3, r=r, patch=patch),  # a wide image, I2V
        W.make_sample(2, 6, 2, 3, 4, pad=2, glyph=1, glyph_pad=2, image=3, patch=patch),  # masks, tall
        W.make_sample(9, 3, 4, 2, 5, pad=1, patch=patch),  # a longer video
    ]


VARIANTS = {
    "plain": {},
    "meanflow": {"use_meanflow": True},
    "guidance": {"guidance_embed": True},
    "temporal-patch": {"patch_size": (2, 2, 2)},
    "no-optional-inputs": {"glyph_byT5_v2": False, "vision_projection": None, "use_cond_type_embedding": False},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_forward_equals_the_official_forward_per_sample(variant):
    """Measured: outputs ~4e-16, gradients ~7e-16 relative (the official RoPE rotates in fp32,
    on identical inputs)."""
    kw = VARIANTS[variant]
    ref = W.tiny(**kw)
    model = copy.deepcopy(ref)
    samples = _samples(r=variant == "meanflow", patch=kw.get("patch_size", (1, 1, 1)))
    if variant == "no-optional-inputs":
        for s in samples:
            s.byt5 = s.byt5_mask = s.vision = None
    tg = W.targets(samples)
    outs = packed_official_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    assert len(outs) == len(samples)
    for o, r in zip(outs, stock):
        assert o.shape == r.shape and rel(o, r) < W.OUT_TOL, (o.shape, r.shape, rel(o, r))
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    worst, missing = grad_error(model, ref, 1)
    assert not missing and worst < W.GRAD_TOL, (worst, missing)


def test_seq_lens_count_what_the_forward_packs():
    """Video patches + kept vision, byT5 and MLLM rows; T2V zero vision rows count nothing."""
    model = W.tiny(patch_size=(1, 2, 2))
    samples = _samples(patch=(1, 2, 2))
    assert official_seq_lens(model, samples) == [6 + 2, 60 + 2 + 4, 1 + 1, 21 + 3 + 2, 24 + 3 + 1 + 3, 108 + 2]
    bad = W.make_sample(1, 2, 2, 1, 0)
    bad.latents = bad.latents[:, :, :1]  # not whole patches: a count to plan with, the forward names it
    bad.text = None
    assert official_seq_lens(model, [bad]) == [0]
    with pytest.raises(ValueError, match="sample 0: latents must be"):
        packed_official_forward(model, [bad])


def test_stock_forward_unchanged_and_packed_again():
    ref = W.tiny()
    model = copy.deepcopy(ref)
    prepare_official(model)
    prepare_official(model)  # idempotent
    s = W.make_sample(2, 3, 4, 3, 0, pad=2, glyph=1, image=2)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))
        assert rel(packed_official_forward(model, [s])[0], W.stock_forward(ref, s)) < W.OUT_TOL


def test_an_empty_rank_joins_the_backward():
    model = W.tiny(use_meanflow=True)
    out = packed_official_forward(model, [])
    assert list(out) == [] and out.flat.shape == (0, 4)
    out.flat.sum().backward()
    ref = W.tiny(use_meanflow=True)
    W.stock_forward(ref, W.make_sample(1, 2, 2, 2, 0, glyph=1, image=1, r=True)).sum().backward()
    # exactly the parameters the official forward leaves without a gradient (the last block's
    # text outputs feed nothing) have none
    assert {n for n, p in model.named_parameters() if p.grad is None} == {
        n for n, p in ref.named_parameters() if p.grad is None
    }


@pytest.mark.parametrize(
    "case, match",
    [
        ("channels", r"sample 0: latents must be \(9, F, H, W\) in whole patches"),
        ("patches", r"sample 0: latents must be .* in whole patches \(1, 2, 2\)"),
        ("text", r"sample 0: text must be \(L, 12\)"),
        ("byt5", r"sample 0: byt5 must be \(L, 10\)"),
        ("vision", r"sample 0: vision must be \(L, 14\)"),
        ("text_mask", r"sample 0: .*text_mask"),
        ("no-text", "sample 0: text_mask keeps no text row"),
        ("timestep", "sample 0: timestep must be one value"),
        ("timestep_r", "sample 0: timestep_r is given but this model has no MeanFlow embedder"),
        ("no-byt5-input", "sample 0: byt5 was given but this model has no byt5 input"),
        ("single-blocks", "double-stream blocks only"),
    ],
)
def test_bad_samples_are_clear_errors(case, match):
    kw = {"patch_size": (1, 2, 2)} if case == "patches" else {}
    kw = {"glyph_byT5_v2": False} if case == "no-byt5-input" else kw
    model = W.tiny(**kw)
    s = W.make_sample(1, 2, 4, 2, 0, glyph=1 if case == "no-byt5-input" else 0)
    if case == "channels":
        s.latents = torch.randn(8, 1, 2, 4, dtype=torch.float64)
    elif case == "patches":
        s.latents = torch.randn(9, 1, 3, 4, dtype=torch.float64)
    elif case == "text":
        s.text = torch.randn(2, 5, dtype=torch.float64)
    elif case == "byt5":
        s.byt5 = torch.randn(2, 7, dtype=torch.float64)
    elif case == "vision":
        s.vision = torch.randn(2, 5, dtype=torch.float64)
    elif case == "text_mask":
        s.text_mask = torch.ones(3, dtype=torch.bool)
    elif case == "no-text":
        s.text_mask = torch.zeros(2, dtype=torch.bool)
    elif case == "timestep":
        s.timestep = torch.ones(2, dtype=torch.float64)
    elif case == "timestep_r":
        s.timestep_r = torch.tensor(3.0, dtype=torch.float64)
    elif case == "single-blocks":
        model.single_blocks.append(torch.nn.Identity())
    with pytest.raises(ValueError, match=match):
        packed_official_forward(model, [s])


def test_the_error_names_the_sample_by_its_index():
    model = W.tiny()
    bad = W.make_sample(1, 2, 2, 1, 3)
    bad.text = torch.randn(2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sample 2: text must be"):
        packed_official_forward(model, [W.make_sample(1, 1, 1, 1, 1), W.make_sample(1, 2, 1, 1, 2), bad])


def test_workload_reads_the_model():
    wl = official_workload(W.tiny(mm_double_blocks_depth=3), gamma=0.5)
    assert (wl.d_model, wl.num_layers, wl.num_heads, wl.gamma) == (32, 3, 4, 0.5)


def test_balanced_equals_the_official_forward_on_two_ranks():
    """One spawn: ``auto`` with a link model (a long video split over both ranks next to whole
    samples), an I2V video next to an empty rank, a ring plan (one head), FSDP2 per block and at
    the root with checkpoint_wrapper; then a bad sample on rank 1 raises on both."""
    res = run_distributed(W.check_official_cases, 2, timeout=240)
    for rank in res:
        for case in W.CASES:
            r = rank[case]
            assert not r["missing"], (case, r["missing"][:3])
            tol = W.RING_OUT_TOL if r["rings"] else W.OUT_TOL
            assert r["out_err"] < tol and r["grad_err"] < W.GRAD_TOL, (case, r)
    assert 2 in res[0]["auto"]["sizes"] and res[1]["auto-empty-rank-i2v"]["routed"] > 0
    assert res[0]["ring"]["rings"] == [2], res[0]["ring"]
    assert all(r["fsdp-checkpointing"]["routed"] > 0 for r in res)
    assert res[1]["fsdp-checkpointing-empty-rank"]["routed"] > 0  # the empty rank holds tokens
    for case in range(2):
        assert [r["bad"][case][0] for r in res] == ["BalancerInputError"] * 2, [r["bad"][case] for r in res]
        assert all("bad input on rank(s) [1]" in r["bad"][case][1] for r in res)
    assert "sample 0: latents must be" in res[0]["bad"][0][1] and "sample 0: byt5 must be" in res[0]["bad"][1][1]
