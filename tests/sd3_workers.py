"""Shared helpers for the diffusers SD3 tests (tiny random models, samples, the stock per-sample
reference, and the 2-rank worker: every multi-rank case in one spawn)."""

from __future__ import annotations

import copy

import torch

from tests.hunyuanvideo15_workers import GRAD_TOL, OUT_TOL, RING_OUT_TOL, grad_error, rel

__all__ = ["CASES", "GRAD_TOL", "OUT_TOL", "RING_OUT_TOL", "check_sd3_cases", "make_sample", "stock_forward", "tiny"]


def tiny(seed: int = 0, **kw):
    """The ``diffusers-sd3-tiny`` preset (4 heads of 16, 2 joint blocks) in fp64."""
    from knapformer.integrations.sd3 import DiffusersSD3Config, build_sd3

    torch.manual_seed(seed)
    return build_sd3(DiffusersSD3Config(**kw)).double()


def make_sample(h, w, txt, seed):
    """A sample of an (h, w)-patch latent (2×2 patches) and ``txt`` text tokens."""
    from knapformer.integrations.sd3 import SD3Sample

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    t = torch.rand((), generator=g, dtype=torch.float64) * 1000
    return SD3Sample(latents=rnd(4, 2 * h, 2 * w), text=rnd(txt, 32), pooled=rnd(24), timestep=t)


def stock_forward(model, s):
    """The stock forward of one sample (a batch of one)."""
    out = model(
        hidden_states=s.latents[None],
        encoder_hidden_states=s.text[None],
        pooled_projections=s.pooled[None],
        timestep=s.timestep[None],
        return_dict=False,
    )
    return out[0][0]


def targets(samples, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s.latents.shape, generator=g, dtype=torch.float64) for s in samples]


# name -> (model kwargs, wrapper, per-rank samples as (h, w, txt))
CASES = {
    "auto": ({}, "", [[(10, 12, 5)], [(2, 3, 3), (1, 1, 1)]]),
    "auto-empty-rank": ({}, "", [[(8, 8, 4)], []]),
    "ring": ({"num_heads": 1, "head_dim": 32}, "", [[(12, 10, 6)], [(2, 2, 2)]]),
    "qk-norm-fsdp-checkpointing": ({"qk_norm": "rms_norm"}, "fsdp+ckpt", [[(6, 9, 2)], [(3, 2, 4)]]),
    "fsdp-checkpointing-empty-rank": ({}, "fsdp+ckpt", [[(10, 8, 4)], []]),
}


def check_sd3_cases(rank: int, world: int) -> dict:
    """Every 2-rank case: outputs == the stock per-sample forward, all-reduced gradients of every
    parameter == the stock gradients of all samples; plans by ``auto`` with a link model
    (``ring``: one head, so a large image can only spread as a ring); then a bad sample on rank 1."""
    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.integrations.sd3 import packed_sd3_forward, sd3_seq_lens, sd3_workload
    from knapformer.plan.cost import LinkModel

    report = {}
    for name, (model_kw, wrapper, spec) in CASES.items():
        per_rank = [[make_sample(*hwt, seed=100 * r + i) for i, hwt in enumerate(spec[r])] for r in range(world)]
        flat = [s for r in per_rank for s in r]
        tg = targets(flat)
        ref = tiny(**model_kw)
        model = copy.deepcopy(ref)
        sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
        if "ckpt" in wrapper:
            model.enable_gradient_checkpointing()
        if "fsdp" in wrapper:
            from torch.distributed.fsdp import fully_shard

            for b in model.transformer_blocks:
                fully_shard(b)
            fully_shard(model)  # the root too, as FSDP2 trainers do (issue 58)
        link = LinkModel(intra_bw=3e7, inter_bw=3e7, gpus_per_node=world, units_per_second=1e9)
        bal = SequenceBalancer(BalancerConfig(layout="auto", cost=sd3_workload(model), link=link))
        mine = per_rank[rank]
        first = len(per_rank[0]) if rank else 0
        plan = bal.plan(sd3_seq_lens(model, mine))
        outs = packed_sd3_forward(model, mine, bal)
        with torch.no_grad():
            out_err = max([rel(o, stock_forward(ref, s)) for o, s in zip(outs, mine)], default=0.0)
        loss = sum(((o * t).sum() for o, t in zip(outs, tg[first : first + len(mine)])), 0 * outs.flat.sum())
        loss.backward()
        worst, missing = grad_error(model, ref, world)
        report[name] = {
            "out_err": out_err,
            "grad_err": worst,
            "missing": missing,
            "sizes": sorted(set(plan.group_sizes().tolist())),
            "rings": sorted(r for r in plan.rings if r > 1),
            "routed": int(bal.spec.num_routed),
        }
    report["bad"] = _bad_sample_everywhere(rank)
    return report


def _bad_sample_everywhere(rank: int) -> list:
    """A malformed sample on rank 1 (an odd latent size; text of the wrong width) raises
    BalancerInputError on every rank; the next, good step runs."""
    from knapformer import SequenceBalancer
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.sd3 import packed_sd3_forward, sd3_seq_lens, sd3_workload

    model = tiny()
    bal = SequenceBalancer("g2n1", sd3_workload(model))
    out = []
    for case in ("latents", "text"):
        samples = [make_sample(2, 3, 2, seed=rank)]
        if rank == 1 and case == "latents":
            samples[0].latents = torch.randn(4, 5, 6, dtype=torch.float64)
        if rank == 1 and case == "text":
            samples[0].text = torch.randn(2, 7, dtype=torch.float64)
        bal.plan(sd3_seq_lens(model, samples))
        try:
            packed_sd3_forward(model, samples, bal)
            out.append(("ok", ""))
        except BalancerInputError as exc:
            out.append(("BalancerInputError", str(exc)))
        good = [make_sample(1, 2, 1, seed=rank)]
        bal.plan(sd3_seq_lens(model, good))
        packed_sd3_forward(model, good, bal)[0].sum().backward()
    return out
