"""Balancing a stock diffusers WanTransformer3DModel (video, 3-D RoPE, cross-attention to
per-sample text, I2V image context): packed forward == stock per-sample forward (outputs and
every parameter gradient), balanced == unbalanced on 2 gloo ranks (g1n2, g2n1, auto; FSDP2;
gradient checkpointing), clear errors, the simulator and the calibrator on the tiny preset."""

import copy

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")

from knapformer.testing import run_distributed  # noqa: E402
from tests import wan_workers as W  # noqa: E402


def _compare(model, ref, samples, executor=None):
    from knapformer.integrations.wan import packed_wan_forward

    outs = packed_wan_forward(model, samples, executor)
    tg = W.targets(samples)
    sum((o * t).sum() for o, t in zip(outs, tg)).backward()
    stock = [W.stock_forward(ref, s) for s in samples]
    sum((o * t).sum() for o, t in zip(stock, tg)).backward()
    out_err = max(W.rel(a, b) for a, b in zip(outs, stock))
    ref_p = dict(ref.named_parameters())
    missing = [n for n, p in model.named_parameters() if p.grad is None and ref_p[n].grad is not None]
    used = [(p, ref_p[n]) for n, p in model.named_parameters() if ref_p[n].grad is not None and p.grad is not None]
    assert len(used) >= len(ref_p) // 2
    grad_err = max(W.rel(p.grad, r.grad) for p, r in used)
    return out_err, grad_err, missing, outs


SHAPES = [(3, 4, 6, 5), (1, 2, 2, 3), (2, 6, 4, 7), (1, 4, 4, 0)]  # (frames, h, w, text); one without text


@pytest.mark.parametrize("variant", ["t2v", "i2v", "per-token-timesteps", "fused", "no-cross-norm", "temporal-patch"])
def test_packed_forward_equals_stock_per_sample(variant):
    """fp64 model: outputs to 1e-9 (measured ~5e-16), every gradient to 1e-5 relative (measured
    ~1e-7: the stock norms and residual adds run in fp32 even in an fp64 model)."""
    from diffusers import WanTransformer3DModel

    i2v = variant == "i2v"
    if variant in ("no-cross-norm", "temporal-patch"):
        torch.manual_seed(0)
        kw = dict(W.TINY)
        if variant == "no-cross-norm":
            kw.update(cross_attn_norm=False, qk_norm=None)
        else:
            kw.update(patch_size=(2, 2, 2))
        ref = WanTransformer3DModel(**kw).double()
    else:
        ref = W.tiny_wan(i2v)
    model = copy.deepcopy(ref)
    if variant == "fused":  # fused q/k/v (self) and k/v (cross) projections, in both models
        ref.fuse_qkv_projections()
        model = copy.deepcopy(ref)
    shapes = SHAPES if variant != "temporal-patch" else [(4, 4, 6, 5), (2, 2, 2, 3)]
    samples = [
        W.make_sample(f, h, w, t, seed=i, i2v=i2v, per_token=variant == "per-token-timesteps")
        for i, (f, h, w, t) in enumerate(shapes)
    ]
    out_err, grad_err, missing, _ = _compare(model, ref, samples)
    assert not missing, missing[:4]
    assert out_err < W.OUT_TOL and grad_err < W.GRAD_TOL, (out_err, grad_err)


def test_local_executor_equals_no_executor():
    from knapformer.integrations.wan import packed_wan_forward, wan_seq_lens
    from knapformer.models import LocalExecutor

    model = W.tiny_wan()
    samples = [W.make_sample(f, h, w, t, seed=i) for i, (f, h, w, t) in enumerate(SHAPES)]
    with torch.no_grad():
        a = packed_wan_forward(model, samples)
        b = packed_wan_forward(model, samples, LocalExecutor(wan_seq_lens(model, samples)))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(a.flat, b.flat)


def test_stock_api_unchanged_and_processors_reinstalled():
    """The packed processor falls back to stock when not packed; replacing the processors
    after a packed call (set_attn_processor) does not break the next packed call."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from knapformer.integrations.wan import PackedWanAttnProcessor, packed_wan_forward

    fresh = W.tiny_wan()
    model = copy.deepcopy(fresh)
    s = W.make_sample(2, 4, 4, 3, seed=0)
    with torch.no_grad():
        packed_wan_forward(model, [s])
        assert isinstance(model.blocks[0].attn1.processor, PackedWanAttnProcessor)
        assert torch.equal(W.stock_forward(model, s), W.stock_forward(fresh, s))
        model.set_attn_processor(WanAttnProcessor())
        out = packed_wan_forward(model, [s])[0]
    assert W.rel(out, W.stock_forward(fresh, s)) < W.OUT_TOL


def test_empty_sample_list_runs_locally():
    from knapformer.integrations.wan import packed_wan_forward

    out = packed_wan_forward(W.tiny_wan(), [])
    assert list(out) == [] and out.flat.shape == (0, 3 * 4)
    out.flat.sum().backward()  # connected: an empty rank joins the backward


@pytest.mark.parametrize(
    "case, match",
    [
        ("no-image", "needs WanSample.image"),
        ("channels", "channels"),
        ("odd-size", "multiples of the patch size"),
        ("timesteps", "one per video token"),
        ("text-dim", "text must be"),
        ("rope", "RoPE table"),
    ],
)
def test_bad_samples_are_clear_errors(case, match):
    from knapformer.integrations.wan import packed_wan_forward

    model = W.tiny_wan(i2v=case == "no-image")
    s = W.make_sample(1, 4, 4, 3, seed=0)
    if case == "channels":
        s.latents = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    elif case == "odd-size":
        s.latents = torch.randn(3, 1, 5, 4, dtype=torch.float64)
    elif case == "timesteps":
        s.timestep = torch.rand(3, dtype=torch.float64)
    elif case == "text-dim":
        s.text = torch.randn(3, 9, dtype=torch.float64)
    elif case == "rope":
        s.latents = torch.randn(3, 1, 2, 2 * 70, dtype=torch.float64)  # 70 columns > RoPE table of 64
    with pytest.raises(ValueError, match=match):
        packed_wan_forward(model, [s])


def test_balanced_equals_unbalanced_on_two_ranks():
    """g2n1 (a sample split over both ranks, a rank with none), g1n2 (a rank with one sample,
    a rank with none), auto, FSDP2 per block, gradient checkpointing, I2V, per-token
    timesteps: outputs == stock, all-reduced gradients == stock, no parameter without grad."""
    res = run_distributed(W.check_wan_balanced, 2, list(W.CASES), timeout=300)
    assert res[0]["g2n1-split-and-empty"]["routed"] > 0 and res[1]["g2n1-split-and-empty"]["routed"] > 0
    assert res[1]["g1n2-empty-rank"]["routed"] == 0
    auto = [r["auto-fsdp-checkpointing"]["routed"] for r in res]
    assert min(auto) > 0  # auto split the one large video over both ranks


def test_auto_on_three_ranks_runs_a_video_on_several_of_them():
    """3 ranks, 2 heads: ``auto`` runs the large video of each case on a multi-rank group (all
    3 as a ring of Ulysses pairs, or 2), ``auto:noring`` on a 2-rank group, next to whole
    samples and a rank with none; T2V and I2V equal stock."""
    res = run_distributed(W.check_wan_balanced, 3, list(W.CASES_3_RANKS), timeout=300)
    for name in W.CASES_3_RANKS:
        assert max(res[0][name]["sizes"]) >= 2, (name, res[0][name])
        assert all(r[name]["sizes"] == res[0][name]["sizes"] for r in res)
    assert 2 in res[0]["noring-3-ranks"]["sizes"] and 3 not in res[0]["noring-3-ranks"]["sizes"]


def test_workload_has_the_cross_attention_term():
    from knapformer.integrations.wan import wan_workload

    model = W.tiny_wan()
    short, long = wan_workload(model, context_len=8), wan_workload(model, context_len=512)
    d = 24
    assert long.linear_coef - short.linear_coef == pytest.approx(4 * d * (512 - 8))
    assert long.per_seq_coef - short.per_seq_coef == pytest.approx(4 * d * d * (512 - 8))
    assert long.cost(100) > short.cost(100)
    # a split sequence's members each pay the context projection; its tokens' cross term splits
    assert long.chunk_cost(50, 100, 2) * 2 == pytest.approx(long.cost(100) + long.per_seq_coef)


def test_simulator_runs_wan_on_a_joint_image_video_mix():
    from knapformer.tools.sim_config import SimConfig
    from knapformer.tools.simulate import simulate

    rep = simulate(
        SimConfig(
            ranks=2,
            model="diffusers-wan-tiny",
            mix="g1b4i256f1s0,g1b1i256f17s1",
            scale=2,
            steps=1,
            warmup=0,
            peak_tflops=0.01,
            progress=False,
        )
    )
    assert rep["loss_match"] and rep["modes"]["balanced"]["plans_per_rank_step"] == 1
    bal = rep["modes"]["balanced"]
    assert bal["predicted_imbalance_after"] < bal["predicted_imbalance_before"]


def test_calibrate_times_wan_blocks(tmp_path, capsys):
    """knapformer calibrate fits a per-layer profile from stock Wan blocks (cross-attention
    included: the profile's coefficients absorb it, so its context_len is 0)."""
    from knapformer.cli import main
    from knapformer.workload import WorkloadModel

    out = tmp_path / "wan.json"
    args = ["calibrate", "--model", "diffusers-wan-tiny", "--lengths", "32", "128", "256", "--holdout", "64"]
    rc = main([*args, "--repeats", "1", "--output", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    prof = WorkloadModel.from_profile(out)
    assert prof.d_model == 64 and prof.num_layers == 2 and prof.context_len == 0
    assert "held-out" in capsys.readouterr().out


def test_first_last_frame_image_context():
    """FLF2V-style models (a learned position table over two images per sample): a sample's
    image context is its two images' rows, (2·L, dim), joined as the stock embedder does."""
    from diffusers import WanTransformer3DModel

    from knapformer.integrations.wan import packed_wan_forward

    torch.manual_seed(0)
    ref = WanTransformer3DModel(**W.TINY, **W.I2V, pos_embed_seq_len=10).double()
    model = copy.deepcopy(ref)
    samples = [W.make_sample(2, 4, 4, 0, seed=1, i2v=True), W.make_sample(1, 2, 4, 0, seed=2, i2v=True)]
    for s in samples:
        s.image = torch.randn(10, 6, dtype=torch.float64)
    with torch.no_grad():
        outs = packed_wan_forward(model, samples)
        for o, s in zip(outs, samples):
            stock = ref(
                hidden_states=s.latents[None],
                timestep=s.timestep[None],
                encoder_hidden_states=s.text[None],
                encoder_hidden_states_image=s.image.unflatten(0, (2, -1)),
                return_dict=False,
            )[0][0]
            assert W.rel(o, stock) < W.OUT_TOL


def test_bad_sample_on_one_rank_raises_on_every_rank():
    res = run_distributed(W.check_bad_sample_on_one_rank, 2, timeout=120)
    for case in range(3):
        assert [r[case][0] for r in res] == ["BalancerInputError"] * 2, [r[case] for r in res]
        assert all("bad input on rank(s) [1]" in r[case][1] for r in res)
    assert "channels" in res[1][0][1] and "RoPE table" in res[1][1][1] and "guidance" in res[1][2][1]
