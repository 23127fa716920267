"""Balancing a stock diffusers FluxTransformer2DModel: packed forward == stock per-sample
forward (fp64, outputs and all gradients); balanced == unbalanced on 2 gloo ranks; FSDP2."""

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")

from knapformer.testing import run_distributed  # noqa: E402
from tests import flux_workers as W  # noqa: E402


@pytest.mark.parametrize("guidance", [False, True])
def test_packed_forward_equals_stock_per_sample(guidance):
    from knapformer.integrations.diffusers import packed_flux_forward

    ref = W.tiny_flux(guidance)
    model = copy.deepcopy(ref)
    # different resolutions, text lengths and timesteps
    samples = [
        W.make_sample(2, 3, 5, 1, guidance),
        W.make_sample(4, 4, 1, 2, guidance),
        W.make_sample(3, 5, 7, 3, guidance),
    ]
    tg = W.targets(samples)
    outs = packed_flux_forward(model, samples)
    stock = [W.stock_forward(ref, s) for s in samples]
    for o, r in zip(outs, stock):
        assert o.shape == r.shape and (o - r).abs().max().item() < 1e-10
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    ref_p = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        r = ref_p[name].grad
        assert (p.grad - r).abs().max().item() <= 1e-9 * max(1.0, r.abs().max().item()), name


def test_stock_api_unchanged_after_prepare():
    from knapformer.integrations.diffusers import prepare_flux

    ref = W.tiny_flux()
    model = copy.deepcopy(ref)
    prepare_flux(model)
    s = W.make_sample(3, 3, 4, 7)
    with torch.no_grad():
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(ref, s))


def test_packing_different_timesteps_needs_per_token_modulation():
    """Sanity check of the premise: one shared temb for two packed samples is wrong."""
    from knapformer.integrations.diffusers import packed_flux_forward

    model = W.tiny_flux()
    a, b = W.make_sample(2, 2, 2, 1), W.make_sample(2, 2, 2, 2)
    b.timestep = a.timestep + 0.5
    outs = packed_flux_forward(model, [a, b])
    with torch.no_grad():
        assert (outs[1] - W.stock_forward(model, b)).abs().max() < 1e-10
        b2 = copy.copy(b)
        b2.timestep = a.timestep
        assert (W.stock_forward(model, b2) - W.stock_forward(model, b)).abs().max() > 1e-4


def test_missing_guidance_is_a_clear_error():
    from knapformer.integrations.diffusers import packed_flux_forward

    with pytest.raises(ValueError, match="every FluxSample needs a guidance value"):
        packed_flux_forward(W.tiny_flux(guidance=True), [W.make_sample(2, 2, 2, 1, guidance=False)])


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("latents", torch.zeros(4, 3), r"sample 1: latents must be \(T_img, 4\)"),
        ("text", torch.zeros(3, 5), r"sample 1: text must be \(T_txt, 8\)"),
        ("img_ids", torch.zeros(5, 3), r"sample 1: img_ids must be \(4, 3\), got \(5, 3\)"),
        ("txt_ids", torch.zeros(3, 2), r"sample 1: txt_ids must be \(3, 3\), got \(3, 2\)"),
        ("pooled", torch.zeros(3), r"sample 1: pooled must be \(8,\), got \(3,\)"),
        ("timestep", torch.zeros(2), "sample 1: timestep must be one value, got 2"),
    ],
)
def test_bad_samples_name_the_sample_and_field(field, value, match):
    """Every field is checked before anything runs (on every rank of a balancer's group: the
    seam's ``raise_problem``), naming the sample and the field."""
    from knapformer.integrations.diffusers import packed_flux_forward

    model = W.tiny_flux()
    bad = W.make_sample(2, 2, 3, 1)
    setattr(bad, field, value.double())
    with pytest.raises(ValueError, match=match):
        packed_flux_forward(model, [W.make_sample(2, 3, 2, 0), bad])


@pytest.mark.parametrize("layout, wrapper", [("g1n2", "none"), ("g2n1", "none"), ("g2n1", "fsdp+ckpt")])
def test_balanced_equals_unbalanced_on_two_ranks(layout, wrapper):
    """Outputs and all-reduced gradients equal the stock per-sample computation; in g2n1 one
    sample is split over both ranks and rank 1 holds image tokens only; no grad is None.
    ``fsdp+ckpt``: FSDP2 on the blocks and the root, activation checkpointing, and rank 1 has
    no sample (issues 58 and 59)."""
    res = run_distributed(W.check_flux_balanced, 2, layout, wrapper, timeout=240)
    assert all(r["routed"] > 0 for r in res)


def test_simulator_runs_the_diffusers_model():
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    rep = simulate(
        SimConfig(
            ranks=2,
            model="diffusers-flux-tiny",
            mix="g1b2i128f1s0,g1b1i256f1s0",
            scale=2,
            steps=1,
            warmup=0,
            peak_tflops=0.01,
            progress=False,
        )
    )
    assert rep["loss_match"] and rep["modes"]["balanced"]["predicted_imbalance_after"] < 0.05
    # one plan per rank per step: the integration uses the step's plan instead of planning again
    assert rep["modes"]["balanced"]["plans_per_rank_step"] == 1


def test_executor_planned_for_other_samples_is_refused_on_every_rank():
    """A balancer planned for other lengths (same token count) is refused before data moves."""
    res = run_distributed(W.check_flux_wrong_plan, 2, timeout=120)
    assert "planned [5, 8]" in res[0] and all("bad input on rank(s) [0]" in m for m in res), res


def test_missing_extra_message(monkeypatch):
    import sys

    from knapformer.integrations import diffusers as integ

    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(ImportError, match=r"pip install 'knapformer\[diffusers\]'"):
        integ.require_diffusers()


def test_empty_sample_list_runs_locally():
    """packed_flux_forward(model, []) (a rank without samples, unbalanced) returns nothing."""
    from knapformer.integrations.diffusers import packed_flux_forward

    out = packed_flux_forward(W.tiny_flux(), [])
    assert list(out) == [] and out.flat.shape == (0, 4)


def test_ranks_with_zero_routed_tokens_equal_stock():
    res = run_distributed(W.check_flux_edge_cases, 2, timeout=240)
    assert 0 in {r["g1n2-one-sample"] for r in res}  # one rank really held nothing after routing


def test_packed_forward_costs_the_stock_flops():
    """Modulation is computed once per sample, not once per token: the packed forward's FLOPs
    are within 1% of the stock per-sample forwards' on the same samples."""
    from torch.utils.flop_counter import FlopCounterMode

    from knapformer.integrations.diffusers import packed_flux_forward

    model = W.tiny_flux()
    samples = [W.make_sample(6, 6, 9, 1), W.make_sample(8, 5, 4, 2), W.make_sample(4, 4, 12, 3)]
    with torch.no_grad():
        with FlopCounterMode(display=False) as stock:
            for s in samples:
                W.stock_forward(model, s)
        with FlopCounterMode(display=False) as packed:
            packed_flux_forward(model, samples)
    assert packed.get_total_flops() <= 1.01 * stock.get_total_flops(), (
        packed.get_total_flops(),
        stock.get_total_flops(),
    )


def test_replacing_attention_processors_after_a_packed_call():
    """set_attn_processor after a packed call: the next packed call installs its processor
    again (it checks the processor, not a flag) and still equals the stock forward."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from knapformer.integrations.diffusers import packed_flux_forward

    ref = W.tiny_flux()
    model = copy.deepcopy(ref)
    samples = [W.make_sample(2, 3, 5, 1), W.make_sample(3, 3, 2, 2)]
    packed_flux_forward(model, samples)
    model.set_attn_processor(FluxAttnProcessor())
    with torch.no_grad():
        for o, s in zip(packed_flux_forward(model, samples), samples):
            assert (o - W.stock_forward(ref, s)).abs().max() < 1e-10
        assert torch.equal(W.stock_forward(model, samples[0]), W.stock_forward(ref, samples[0]))
