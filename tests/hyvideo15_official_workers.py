"""Shared helpers for the tests of the official-class HunyuanVideo 1.5 adapter: tiny models of
the test fixture (:mod:`tests.hyvideo15_reference`), samples, the stock per-sample forward and
the 2-rank worker (every multi-rank case in one spawn)."""

from __future__ import annotations

import copy

import torch

from tests.hunyuanvideo15_workers import GRAD_TOL, OUT_TOL, RING_OUT_TOL, grad_error, rel

__all__ = ["CASES", "GRAD_TOL", "OUT_TOL", "RING_OUT_TOL", "check_official_cases", "make_sample", "stock_forward"]


def tiny(seed: int = 0, **kw):
    """The fixture's tiny official class in fp64 (hidden 32, 4 heads, 2 double blocks)."""
    from tests.hyvideo15_reference import HunyuanVideo_1_5_DiffusionTransformer

    torch.manual_seed(seed)
    return HunyuanVideo_1_5_DiffusionTransformer(**kw).double()


def make_sample(f, h, w, txt, seed, *, pad=0, glyph=0, glyph_pad=0, image=0, r=False, patch=(1, 1, 1), c=4):
    """A sample of f×h×w latent patches, ``txt`` kept MLLM rows (+ ``pad`` masked), ``glyph`` kept
    byT5 rows (+ ``glyph_pad``; no byT5 input when both are 0) and ``image`` SigLIP rows (0: T2V)."""
    from knapformer.integrations.hunyuanvideo15_official import OfficialSample

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    mask = lambda n, p: torch.tensor([True] * n + [False] * p) if p else None  # noqa: E731
    return OfficialSample(
        latents=rnd(2 * c + 1, f * patch[0], h * patch[1], w * patch[2]),
        timestep=torch.rand((), generator=g, dtype=torch.float64) * 1000,
        text=rnd(txt + pad, 12),
        text_mask=mask(txt, pad),
        byt5=rnd(glyph + glyph_pad, 10) if glyph + glyph_pad else None,
        byt5_mask=mask(glyph, glyph_pad),
        vision=rnd(image, 14) if image else None,
        timestep_r=torch.rand((), generator=g, dtype=torch.float64) * 1000 if r else None,
    )


def stock_forward(model, s):
    """The official forward of one sample, called the way ``train.py`` calls it (a batch of one,
    masks of ones where the sample has none, no byT5 rows where it has none, ``mask_type`` from
    whether its vision states are all zero)."""
    ones = lambda n: torch.ones(n, dtype=torch.long)  # noqa: E731
    extra = None
    if model.glyph_byT5_v2:
        b5 = s.byt5 if s.byt5 is not None else torch.zeros(0, model.byt5_in.fc1.in_features, dtype=torch.float64)
        m5 = ones(b5.shape[0]) if s.byt5_mask is None else s.byt5_mask.long()
        extra = {"byt5_text_states": b5[None], "byt5_text_mask": m5[None]}
    tm = ones(s.text.shape[0]) if s.text_mask is None else s.text_mask.long()
    i2v = s.vision is not None and bool(s.vision.ne(0).any())
    out, _ = model(
        s.latents[None],
        s.timestep[None],
        s.text[None],
        None,
        tm[None],
        timestep_r=None if s.timestep_r is None else s.timestep_r[None],
        vision_states=None if s.vision is None else s.vision[None],
        mask_type="i2v" if i2v else "t2v",
        extra_kwargs=extra,
    )
    return out[0]


def targets(samples, out_channels: int = 4, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(out_channels, *s.latents.shape[1:], generator=g, dtype=torch.float64) for s in samples]


# name -> (layout, model kwargs, wrapper, per-rank samples as make_sample kwargs)
CASES = {
    "auto": (
        "auto",
        {},
        "",
        [[dict(f=5, h=6, w=5, txt=4, glyph=2)], [dict(f=1, h=2, w=3, txt=3, image=2), dict(f=1, h=1, w=1, txt=1)]],
    ),
    "auto-empty-rank-i2v": ("auto", {}, "", [[dict(f=3, h=6, w=6, txt=3, pad=2, image=4)], []]),
    "ring": (
        "auto",
        {"heads_num": 1, "rope_dim_list": (8, 8, 16)},
        "",
        [[dict(f=4, h=8, w=7, txt=5, pad=2)], [dict(f=1, h=2, w=2, txt=2)]],
    ),
    "fsdp-checkpointing": (
        "auto",
        {},
        "fsdp+ckpt",
        [[dict(f=4, h=5, w=6, txt=2, image=2)], [dict(f=1, h=3, w=2, txt=1, glyph=1, glyph_pad=1)]],
    ),
    # issue 59, item 1: root and blocks sharded, checkpointing, rank 1 without a sample (it
    # deadlocked: FSDP2 hooked the root's backward all-gather on rank 0's per-sample outputs only)
    "fsdp-checkpointing-empty-rank": ("auto", {}, "fsdp+ckpt", [[dict(f=3, h=6, w=6, txt=3, glyph=1)], []]),
}


def check_official_cases(rank: int, world: int) -> dict:
    """Every 2-rank case: outputs == the official per-sample forward, all-reduced gradients of
    every parameter == the official gradients of all samples; plans made by ``auto`` with a link
    model (``ring``: one head, so a long video can only spread as a ring); then a bad sample on
    rank 1."""
    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.integrations.hunyuanvideo15_official import (
        official_seq_lens,
        official_workload,
        packed_official_forward,
    )
    from knapformer.plan.cost import LinkModel

    report = {}
    for name, (layout, model_kw, wrapper, spec) in CASES.items():
        per_rank = [[make_sample(seed=100 * r + i, **kw) for i, kw in enumerate(spec[r])] for r in range(world)]
        flat = [s for r in per_rank for s in r]
        tg = targets(flat)
        ref = tiny(**model_kw)
        model = copy.deepcopy(ref)
        sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
        if "ckpt" in wrapper:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, b in enumerate(model.double_blocks):
                model.double_blocks[i] = checkpoint_wrapper(b)
        if "fsdp" in wrapper:
            from torch.distributed.fsdp import fully_shard

            for b in model.double_blocks:
                fully_shard(b)
            fully_shard(model)
        link = LinkModel(intra_bw=3e7, inter_bw=3e7, gpus_per_node=world, units_per_second=1e9)
        bal = SequenceBalancer(BalancerConfig(layout=layout, cost=official_workload(model), link=link))
        mine = per_rank[rank]
        first = len(per_rank[0]) if rank else 0
        plan = bal.plan(official_seq_lens(model, mine))
        outs = packed_official_forward(model, mine, bal)
        with torch.no_grad():
            out_err = max([rel(o, stock_forward(ref, s)) for o, s in zip(outs, mine)], default=0.0)
        loss = sum(((o * t).sum() for o, t in zip(outs, tg[first : first + len(mine)])), 0 * outs.flat.sum())
        loss.backward()
        worst, missing = grad_error(_unwrapped(model), _unwrapped(ref), world)
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


def _unwrapped(model):
    """Parameter names without the checkpoint wrapper's prefix (the gradients' owners)."""

    class Named:
        def named_parameters(self):
            for n, p in model.named_parameters():
                yield n.replace("_checkpoint_wrapped_module.", ""), p

    return Named()


def _bad_sample_everywhere(rank: int) -> list:
    """A malformed sample on rank 1 (latents with the wrong channels; byT5 states of the wrong
    width) raises BalancerInputError on every rank; the next, good step runs."""
    from knapformer import SequenceBalancer
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.hunyuanvideo15_official import (
        official_seq_lens,
        official_workload,
        packed_official_forward,
    )

    model = tiny()
    bal = SequenceBalancer("g2n1", official_workload(model))
    out = []
    for case in ("channels", "byt5"):
        samples = [make_sample(1, 2, 3, 2, seed=rank)]
        if rank == 1 and case == "channels":
            samples[0].latents = torch.randn(4, 1, 2, 3, dtype=torch.float64)
        if rank == 1 and case == "byt5":
            samples[0].byt5 = torch.randn(2, 7, dtype=torch.float64)
        bal.plan(official_seq_lens(model, samples))
        try:
            packed_official_forward(model, samples, bal)
            out.append(("ok", ""))
        except BalancerInputError as exc:
            out.append(("BalancerInputError", str(exc)))
        good = [make_sample(1, 2, 2, 1, seed=rank)]
        bal.plan(official_seq_lens(model, good))
        packed_official_forward(model, good, bal)[0].sum().backward()
    return out
