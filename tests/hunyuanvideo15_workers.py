"""Shared helpers for the diffusers HunyuanVideo 1.5 tests (tiny random models, samples, the
stock per-sample reference, and the 2-rank worker: every multi-rank case in one spawn)."""

from __future__ import annotations

import copy

import torch

from knapformer.testing import gradient_error, relative_error

TINY = dict(
    in_channels=5,
    out_channels=2,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=6,
    text_embed_2_dim=4,
    image_embed_dim=3,
    rope_axes_dim=(2, 2, 4),
)


def tiny_hv(seed: int = 0, **kw):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(**{**TINY, **kw}).double()


def make_sample(f, h, w, txt, seed, *, pad=0, glyph=0, glyph_pad=0, image=0, r=False, ch=5, patch=(1, 1)):
    """A sample of f×h×w latent tokens, ``txt`` kept MLLM rows (+ ``pad`` masked), ``glyph`` kept
    byT5 rows (+ ``glyph_pad``; none at all when both are 0) and ``image`` SigLIP rows (0: T2V)."""
    from knapformer.integrations.hunyuanvideo15 import HunyuanVideo15Sample

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    mask = lambda n, p: torch.tensor([True] * n + [False] * p) if p else None  # noqa: E731
    return HunyuanVideo15Sample(
        latents=rnd(ch, f * patch[0], h * patch[1], w * patch[1]),
        text=rnd(txt + pad, 6),
        timestep=torch.rand((), generator=g, dtype=torch.float64) * 1000,
        text_mask=mask(txt, pad),
        text_2=rnd(glyph + glyph_pad, 4) if glyph + glyph_pad else None,
        text_2_mask=mask(glyph, glyph_pad),
        image_embeds=rnd(image, 3) if image else None,
        timestep_r=torch.rand((), generator=g, dtype=torch.float64) * 1000 if r else None,
    )


def stock_forward(model, s):
    """The stock forward of one sample: masks of ones where the sample has none, zero rows
    where it has no byT5 text or no image tokens (the stock forward needs all three inputs), and
    one masked-out row where it has no MLLM text (zero rows would make the stock processor's
    ``[:-0]`` slice drop every video token when the sample has no other context)."""
    c = model.config
    ones = lambda n: torch.ones(n, dtype=torch.bool)  # noqa: E731
    text, mask = s.text, s.text_mask if s.text_mask is not None else ones(s.text.shape[0])
    if text.shape[0] == 0:
        text, mask = torch.zeros(1, text.shape[1], dtype=text.dtype), ~ones(1)
    t2 = s.text_2 if s.text_2 is not None else torch.zeros(0, c.text_embed_2_dim, dtype=torch.float64)
    m2 = s.text_2_mask if s.text_2_mask is not None else ones(t2.shape[0])
    img = s.image_embeds if s.image_embeds is not None else torch.zeros(0, c.image_embed_dim, dtype=torch.float64)
    return model(
        hidden_states=s.latents[None],
        timestep=s.timestep[None],
        encoder_hidden_states=text[None],
        encoder_attention_mask=mask[None],
        encoder_hidden_states_2=t2[None],
        encoder_attention_mask_2=m2[None],
        image_embeds=img[None],
        timestep_r=None if s.timestep_r is None else s.timestep_r[None],
        return_dict=False,
    )[0][0]


def targets(samples, out_channels: int = 2, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(out_channels, *s.latents.shape[1:], generator=g, dtype=torch.float64) for s in samples]


rel = relative_error  # the shipped measures (knapformer.testing), under the tests' short names
grad_error = gradient_error


OUT_TOL = 1e-12
"""Outputs: the stock RoPE rotates in fp32, but on identical inputs (measured ~5e-16)."""
RING_OUT_TOL = 1e-7
"""Outputs under a ring plan: its online-softmax merge differs from one attention call in the
last fp64 bit, and the next layer's fp32 rotation can round that bit either way."""
GRAD_TOL = 1e-9
"""Gradients (measured ~4e-15, the ring plan too)."""

# name -> (layout, heads, wrapper, per-rank samples as make_sample kwargs)
CASES = {
    "auto": (
        "auto",
        2,
        "",
        [[dict(f=5, h=6, w=5, txt=4, glyph=2)], [dict(f=1, h=2, w=3, txt=3), dict(f=1, h=1, w=1, txt=1)]],
    ),
    "auto-empty-rank-i2v": ("auto", 2, "", [[dict(f=3, h=6, w=6, txt=3, image=4)], []]),
    "ring": ("auto", 1, "", [[dict(f=4, h=8, w=7, txt=5, pad=2)], [dict(f=1, h=2, w=2, txt=2)]]),
    "g1n2-idle-rank": ("g1n2", 2, "", [[dict(f=2, h=2, w=3, txt=2, glyph=1, image=1)], []]),  # rank 1: no token
    "fsdp-checkpointing": (
        "auto",
        2,
        "fsdp+ckpt",
        [[dict(f=4, h=5, w=6, txt=2, image=2)], [dict(f=1, h=3, w=2, txt=1, glyph=1)]],
    ),
    "fsdp-checkpointing-empty-rank": ("auto", 2, "fsdp+ckpt", [[dict(f=3, h=6, w=6, txt=3, glyph=1)], []]),
}


def check_hv_cases(rank: int, world: int) -> dict:
    """Every 2-rank case: outputs == the stock per-sample forward, all-reduced gradients of
    every parameter == the stock gradients of all samples; plans made by ``auto`` with a link
    model (``ring``: one head, so a long video can only spread as a ring)."""
    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.integrations.hunyuanvideo15 import (
        hunyuanvideo15_seq_lens,
        hunyuanvideo15_workload,
        packed_hunyuanvideo15_forward,
    )
    from knapformer.plan.cost import LinkModel

    report = {}
    for name, (layout, heads, wrapper, spec) in CASES.items():
        per_rank = [[make_sample(seed=100 * r + i, **kw) for i, kw in enumerate(spec[r])] for r in range(world)]
        flat = [s for r in per_rank for s in r]
        tg = targets(flat)
        ref = tiny_hv(num_attention_heads=heads, attention_head_dim=16 // heads, rope_axes_dim=(4, 4, 16 // heads - 8))
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
        bal = SequenceBalancer(BalancerConfig(layout=layout, cost=hunyuanvideo15_workload(model), link=link))
        mine = per_rank[rank]
        first = len(per_rank[0]) if rank else 0
        plan = bal.plan(hunyuanvideo15_seq_lens(model, mine))
        outs = packed_hunyuanvideo15_forward(model, mine, bal)
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
    """A malformed sample on rank 1 (wrong latent channels; a byT5 width that does not match)
    raises BalancerInputError on every rank; the next, good step runs."""
    from knapformer import SequenceBalancer
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.hunyuanvideo15 import (
        hunyuanvideo15_seq_lens,
        hunyuanvideo15_workload,
        packed_hunyuanvideo15_forward,
    )

    model = tiny_hv()
    bal = SequenceBalancer("g2n1", hunyuanvideo15_workload(model))
    out = []
    for case in ("channels", "glyph"):
        samples = [make_sample(1, 2, 3, 2, seed=rank)]
        if rank == 1 and case == "channels":
            samples[0].latents = torch.randn(4, 1, 2, 3, dtype=torch.float64)
        if rank == 1 and case == "glyph":
            samples[0].text_2 = torch.randn(2, 7, dtype=torch.float64)
        bal.plan(hunyuanvideo15_seq_lens(model, samples))
        try:
            packed_hunyuanvideo15_forward(model, samples, bal)
            out.append(("ok", ""))
        except BalancerInputError as exc:
            out.append(("BalancerInputError", str(exc)))
        good = [make_sample(1, 2, 2, 1, seed=rank)]
        bal.plan(hunyuanvideo15_seq_lens(model, good))
        packed_hunyuanvideo15_forward(model, good, bal)[0].sum().backward()
    return out
