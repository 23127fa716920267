"""Shared helpers for the diffusers Wan tests (tiny random model, samples, stock reference)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=3,
    out_channels=3,
    text_dim=8,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=64,
)
I2V = dict(image_dim=6, added_kv_proj_dim=24)
I2V_TEXT = 512  # the stock I2V processor splits image from text assuming 512 text tokens


def tiny_wan(i2v: bool = False, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TINY, **(I2V if i2v else {})).double()


def make_sample(f: int, h: int, w: int, txt: int, seed: int, *, i2v: bool = False, per_token: bool = False):
    """A sample of f latent frames of h×w latents (tokens: f·h/2·w/2) and ``txt`` text tokens."""
    from knapformer.integrations.wan import WanSample

    g = torch.Generator().manual_seed(seed)
    n = f * (h // 2) * (w // 2)
    ts = torch.rand(n if per_token else (), generator=g, dtype=torch.float64) * 1000
    return WanSample(
        latents=torch.randn(3, f, h, w, generator=g, dtype=torch.float64),
        text=torch.randn(I2V_TEXT if i2v else txt, 8, generator=g, dtype=torch.float64),
        timestep=ts,
        image=torch.randn(5, 6, generator=g, dtype=torch.float64) if i2v else None,
    )


def stock_forward(model, s):
    return model(
        hidden_states=s.latents[None],
        timestep=s.timestep[None],
        encoder_hidden_states=s.text[None],
        encoder_hidden_states_image=None if s.image is None else s.image[None],
        return_dict=False,
    )[0][0]


def targets(samples, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.latents.shape, generator=g, dtype=torch.float64) for s in samples]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


OUT_TOL = 1e-9
"""Outputs: measured ~5e-16 (the fp32 norms see identical inputs, so round identically)."""
GRAD_TOL = 1e-5
"""Gradients: measured ~1e-7 — the stock norms and residual adds run in fp32 even in an fp64
model, and the packed backward sums gradients in another order, so fp32 rounding shows."""

# name -> (layout, per-rank (f, h, w, text) samples, wrapper, options)
CASES = {
    "g2n1-split-and-empty": ("g2n1", [[(3, 4, 6, 5)], []], "none", {}),
    "g1n2-one-sample-rank": ("g1n2", [[(1, 2, 2, 3), (2, 4, 4, 2)], [(3, 4, 4, 6)]], "none", {}),
    "g1n2-empty-rank": ("g1n2", [[(2, 4, 4, 3)], []], "none", {}),
    "auto": ("auto", [[(4, 8, 8, 4)], [(1, 2, 2, 2), (1, 2, 4, 3)]], "none", {}),
    "g2n1-fsdp": ("g2n1", [[(2, 4, 4, 3)], [(1, 2, 2, 2)]], "fsdp", {}),
    "g2n1-checkpointing": ("g2n1", [[(2, 4, 4, 3)], [(1, 2, 2, 0)]], "checkpointing", {}),
    "auto-fsdp-checkpointing": ("auto", [[(4, 8, 8, 4)], []], "fsdp+checkpointing", {}),
    "g2n1-i2v": ("g2n1", [[(2, 4, 4, 0)], [(1, 2, 2, 0)]], "none", {"i2v": True}),
    "g2n1-per-token-timesteps": ("g2n1", [[(2, 4, 4, 3)], [(1, 4, 2, 2)]], "none", {"per_token": True}),
    # per-token timesteps on one rank only: next to a rank without samples, and next to scalar ones
    "g2n1-per-token-next-to-empty": ("g2n1", [[(2, 4, 4, 3)], []], "none", {"per_token_ranks": (0,)}),
    "g1n2-per-token-and-scalar": ("g1n2", [[(2, 4, 4, 3)], [(1, 4, 2, 2)]], "none", {"per_token_ranks": (0,)}),
    "auto-scalar-and-per-token": ("auto", [[(4, 8, 8, 4)], [(1, 2, 2, 2)]], "none", {"per_token_ranks": (1,)}),
}
CASES_3_RANKS = {  # 2 heads, 3 ranks: a large video on 3 (a ring of pairs) or on 2 of the 3 (noring)
    "auto-3-ranks": ("auto", [[(4, 8, 8, 4)], [], [(1, 2, 2, 2), (1, 2, 4, 3)]], "none", {}),
    "auto-3-ranks-i2v": ("auto", [[(1, 2, 2, 0)], [(3, 8, 8, 0)], []], "none", {"i2v": True}),
    "noring-3-ranks": ("auto:noring", [[(4, 8, 8, 4)], [], [(1, 2, 2, 2), (1, 2, 4, 3)]], "none", {}),
}


def check_wan_balanced(rank: int, world: int, names: list[str]) -> dict:
    """For each case: balanced outputs == stock per-sample outputs, all-reduced gradients ==
    the stock gradients of all samples, no parameter without a gradient."""
    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.integrations.wan import packed_wan_forward, wan_seq_lens, wan_workload

    report = {}
    for name in names:
        layout, spec, wrapper, opts = {**CASES, **CASES_3_RANKS}[name]
        i2v = opts.get("i2v", False)
        per_token = [opts.get("per_token", False) or r in opts.get("per_token_ranks", ()) for r in range(world)]
        all_samples = [
            [
                make_sample(f, h, w, t, seed=100 * r + i, i2v=i2v, per_token=per_token[r])
                for i, (f, h, w, t) in enumerate(s)
            ]
            for r, s in enumerate(spec)
        ]
        flat = [s for r in all_samples for s in r]
        tg = targets(flat)
        ref = tiny_wan(i2v)
        model = copy.deepcopy(ref)
        sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
        if "checkpointing" in wrapper:
            model.enable_gradient_checkpointing()
        if "fsdp" in wrapper:
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)  # the root too, as FSDP2 trainers do (issue 58)
        bal = SequenceBalancer(BalancerConfig(layout=layout, cost=wan_workload(model, context_len=8), link="free"))
        mine = all_samples[rank]
        first = sum(len(r) for r in all_samples[:rank])
        plan = bal.plan(wan_seq_lens(model, mine))
        outs = packed_wan_forward(model, mine, bal)
        with torch.no_grad():
            out_err = max([rel(o, stock_forward(ref, s)) for o, s in zip(outs, mine)], default=0.0)
        assert out_err < OUT_TOL, (name, out_err)
        loss = sum(((o * t).sum() for o, t in zip(outs, tg[first : first + len(mine)])), 0 * outs.flat.sum())
        loss.backward()
        ref_p = dict(ref.named_parameters())
        missing, worst = [], 0.0
        for n, p in model.named_parameters():
            if p.grad is None:
                missing.append(n)
                continue
            g = p.grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor() * world  # FSDP averages
            else:
                g = g.clone()
                dist.all_reduce(g)
            worst = max(worst, rel(g, ref_p[n].grad))
        assert not missing, (name, rank, missing[:4])
        assert worst < GRAD_TOL, (name, worst)
        report[name] = {
            "routed": int(bal.spec.num_routed),
            "out_err": out_err,
            "grad_err": worst,
            "sizes": sorted(set(plan.group_sizes().tolist())),
        }
    return report


def check_bad_sample_on_one_rank(rank: int, world: int) -> list:
    """A malformed sample on rank 1 (Wan: wrong channels, a video larger than the RoPE table;
    Flux: no guidance for a guidance-distilled model) raises BalancerInputError on every rank
    before any data moves; the next, good step still runs."""
    from knapformer import BalancerConfig, SequenceBalancer, WorkloadModel
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.diffusers import flux_seq_lens, packed_flux_forward
    from knapformer.integrations.wan import packed_wan_forward, wan_seq_lens, wan_workload
    from tests import flux_workers as F

    out = []
    model = tiny_wan()
    bal = SequenceBalancer(BalancerConfig(layout="g2n1", cost=wan_workload(model, context_len=8)))
    for case in ("channels", "rope"):
        samples = [make_sample(2, 4, 4, 3, seed=rank)]
        if rank == 1 and case == "channels":
            samples[0].latents = torch.randn(5, 2, 4, 4, dtype=torch.float64)
        if rank == 1 and case == "rope":
            samples[0].latents = torch.randn(3, 1, 2, 2 * 70, dtype=torch.float64)
        bal.plan(wan_seq_lens(model, samples))
        try:
            packed_wan_forward(model, samples, bal)
            out.append(("ok", ""))
        except BalancerInputError as exc:
            out.append(("BalancerInputError", str(exc)))
        good = [make_sample(1, 2, 4, 2, seed=rank)]
        bal.plan(wan_seq_lens(model, good))
        packed_wan_forward(model, good, bal)[0].sum().backward()
    flux = F.tiny_flux(guidance=True)
    fbal = SequenceBalancer("g2n1", WorkloadModel(d_model=16))
    samples = [F.make_sample(2, 2, 2, seed=rank, guidance=rank == 0)]
    fbal.plan(flux_seq_lens(flux, samples))
    try:
        packed_flux_forward(flux, samples, fbal)
        out.append(("ok", ""))
    except BalancerInputError as exc:
        out.append(("BalancerInputError", str(exc)))
    return out
