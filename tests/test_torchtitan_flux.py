"""Balancing torchtitan's FluxModel: the packed forward equals torchtitan's own forward run one
sample at a time (fp64: outputs and every parameter gradient) at several resolutions and text
lengths; ``auto`` on 2 gloo ranks (plain, with an empty rank, under torchtitan's own FSDP2 and
activation checkpointing) equals it too, gradients summed over ranks; stock FLOPs; bad input on
one rank raises on every rank."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'knapformer[torchtitan]')")

from knapformer.testing import run_distributed  # noqa: E402
from tests import titan_workers as W  # noqa: E402

# (h, w) image patches and text tokens: two resolutions and aspect ratios, one-token text
SAMPLES = [(2, 3, 5), (4, 4, 1), (3, 5, 7), (6, 2, 1)]


def _samples(spec=SAMPLES):
    return [W.make_sample(h, w, t, seed=i + 1) for i, (h, w, t) in enumerate(spec)]


def test_packed_forward_equals_torchtitans_own_forward_per_sample():
    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    ref = W.tiny_titan_flux(num_double=2, num_single=2)
    model = copy.deepcopy(ref)
    samples = _samples()
    outs = packed_titan_flux_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    assert [o.shape for o in outs] == [r.shape for r in stock]
    for o, r in zip(outs, stock):
        assert W.relative_error(o, r) < W.TOL
    tg = W.targets(samples)
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    worst, missing = W.grad_error(model, ref, "none")
    assert not missing and worst < W.TOL, (worst, missing)


def test_each_sample_gets_its_own_timestep_pooled_vector_and_positions():
    """The premise the per-token modulation and RoPE serve: two samples packed together, one
    with another timestep, pooled vector or ids, change only their own output."""
    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    model = W.tiny_titan_flux()
    a, b = _samples(SAMPLES[:2])
    with torch.no_grad():
        base = packed_titan_flux_forward(model, [a, b])
        for change in ("timestep", "pooled", "img_ids"):
            b2 = copy.copy(b)
            setattr(b2, change, getattr(b, change) + 0.5)
            out = packed_titan_flux_forward(model, [a, b2])
            assert torch.equal(out[0], base[0]), change
            assert (out[1] - base[1]).abs().max() > 1e-6, change
            assert W.relative_error(out[1], W.stock_forward(model, b2)) < W.TOL, change


def test_stock_forward_unchanged_after_prepare():
    from knapformer.integrations.torchtitan_flux import PackedTitanAttention, prepare_titan_flux

    ref = W.tiny_titan_flux()
    model = copy.deepcopy(ref)
    prepare_titan_flux(model)
    prepare_titan_flux(model)  # idempotent: one wrapper, one set of hooks
    assert not isinstance(model.double_blocks[0].inner_attention.stock, PackedTitanAttention)
    assert model.state_dict().keys() == ref.state_dict().keys()
    s = W.make_sample(3, 3, 4, 7)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))


def test_packed_forward_costs_the_stock_flops():
    """Modulation runs once per sample, not once per token: the packed forward's FLOPs are within
    1% of torchtitan's per-sample forwards on the same samples."""
    from torch.utils.flop_counter import FlopCounterMode

    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    model = W.tiny_titan_flux()
    samples = _samples([(6, 6, 9), (8, 5, 4), (4, 4, 12), (1, 1, 1)])
    with torch.no_grad():
        with FlopCounterMode(display=False) as stock:
            for s in samples:
                W.stock_forward(model, s)
        with FlopCounterMode(display=False) as packed:
            packed_titan_flux_forward(model, samples)
    assert packed.get_total_flops() <= 1.01 * stock.get_total_flops(), (
        packed.get_total_flops(),
        stock.get_total_flops(),
    )


def test_bad_samples_are_named():
    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    model = W.tiny_titan_flux()
    good = W.make_sample(2, 2, 3, 1)
    cases = {
        "latents must be (T_img, 16)": dict(latents=good.latents[:, :8]),
        "text must be (T_txt, 32)": dict(text=good.text[:, :4]),
        "img_ids must be (4, 3)": dict(img_ids=good.img_ids[:3]),
        "pooled must be (24,)": dict(pooled=good.pooled[:5]),
        "timestep must be one value": dict(timestep=torch.rand(2)),
    }
    for message, change in cases.items():
        bad = copy.copy(good)
        for k, v in change.items():
            setattr(bad, k, v)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            packed_titan_flux_forward(model, [good, bad])


def test_empty_sample_list_runs_locally():
    from knapformer.integrations.torchtitan_flux import packed_titan_flux_forward

    out = packed_titan_flux_forward(W.tiny_titan_flux(), [])
    assert list(out) == [] and out.flat.shape == (0, 16)


def test_missing_extra_message(monkeypatch):
    from knapformer.integrations import torchtitan_flux as integ

    monkeypatch.setitem(sys.modules, "torchtitan", None)
    with pytest.raises(ImportError, match=r"pip install 'knapformer\[torchtitan\]'"):
        integ.require_torchtitan()


def test_the_tools_find_the_family_and_it_runs():
    from knapformer.data.batches import batch_from_lens
    from knapformer.executor import LocalExecutor
    from knapformer.integrations.registry import resolve_model

    family = resolve_model("torchtitan-flux-tiny")
    d = family.dims()
    model = family.build()
    batch = batch_from_lens(
        [40, 9], [5, 3], seed=0, rank=0, step=0, in_dim=d.in_dim, vec_dim=d.vec_dim, out_dim=d.out_dim
    )
    inputs = family.inputs(batch)
    out = family.forward(model, inputs, LocalExecutor(inputs.seq_lens))
    assert out.shape == inputs.target.shape == (35 + 6, d.out_dim)
    assert family.workload().num_layers == 4


def test_balanced_on_two_ranks_equals_torchtitans_own_forward():
    """One spawn, four runs and a bad input: ``auto`` with two resolutions and one-token text
    on both ranks; a rank with no sample; a rank that routes no token; torchtitan's
    ``apply_ac`` + ``apply_fsdp`` (FSDP2, gradient division off as ``parallelize_flux`` leaves
    it) — outputs and gradients summed over ranks equal the stock per-sample run; then rank 1
    hands a malformed sample and both ranks raise naming it."""
    res = run_distributed(W.check_all, 2, timeout=300)
    for r in res:
        assert r["mixed/none"]["routed"] > 0 and r["empty/none"]["routed"] > 0, r  # the empty rank got work
    assert [r["idle/none"]["routed"] for r in res] == [14, 0]  # rank 1 ran every block on no token
    msgs = [r["bad"] for r in res]
    assert all("bad input on rank(s) [1]" in m and "text must be (T_txt, 32), got (2, 31)" in m for m in msgs), msgs


def test_a_packed_step_equals_torchtitans_batched_step_where_that_can_run():
    """flow_matching_sample + the packed forward give torchtitan's own batched step
    (FluxTrainer.forward_backward_step's math: noise, sigmas, pack_latents, position ids, MSE
    over the global element count) on a batch torchtitan can run: equal resolutions, equal
    text lengths."""
    from torchtitan.models.flux.utils import create_position_encoding_for_latents, pack_latents

    from knapformer.integrations.torchtitan_flux import flow_matching_sample, packed_titan_flux_forward

    ref = W.tiny_titan_flux()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(3)
    B, C, H, Wd, T = 3, 4, 6, 4, 5
    x, noise = (torch.randn(B, C, H, Wd, generator=g, dtype=torch.float64) for _ in range(2))
    t5 = torch.randn(B, T, W.CFG["text_dim"], generator=g, dtype=torch.float64)
    clip = torch.randn(B, W.CFG["vec_dim"], generator=g, dtype=torch.float64)
    t = torch.rand(B, generator=g, dtype=torch.float64)
    # torchtitan's batched step
    sig = t.view(-1, 1, 1, 1)
    pred = ref(
        img=pack_latents((1 - sig) * x + sig * noise),
        img_ids=create_position_encoding_for_latents(B, H, Wd, 3),
        txt=t5,
        txt_ids=torch.zeros(B, T, 3),
        timesteps=t,
        y=clip,
    )
    target = pack_latents(noise - x)
    (((pred - target) ** 2).sum() / target.numel()).backward()
    # the same images one by one, packed
    pairs = [flow_matching_sample(x[i], t5[i], clip[i], timestep=t[i], noise=noise[i]) for i in range(B)]
    samples, targets = zip(*pairs)
    out = packed_titan_flux_forward(model, samples)
    assert W.relative_error(out.flat, pred.reshape(-1, pred.shape[-1])) < W.TOL
    tg = torch.cat(targets)
    assert torch.equal(tg, target.reshape(-1, target.shape[-1]))
    (((out.flat - tg) ** 2).sum() / tg.numel()).backward()
    worst, missing = W.grad_error(model, ref, "none")
    assert not missing and worst < W.TOL, (worst, missing)
    with pytest.raises(ValueError, match="H and W even"):
        flow_matching_sample(x[0, :, :5], t5[0], clip[0], timestep=t[0], noise=noise[0, :, :5])
