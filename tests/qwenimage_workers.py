"""Shared helpers for the diffusers Qwen-Image tests (tiny random models, samples, the stock
per-sample reference, and the 2-rank worker: every multi-rank case in one spawn)."""

from __future__ import annotations

import copy
import math

import torch

from knapformer.testing import gradient_error, relative_error

TINY = dict(
    patch_size=2,
    in_channels=8,
    out_channels=2,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=6,
    axes_dims_rope=(2, 2, 4),
)
VARIANTS = {
    "plain": {},
    "edit-zero-cond-t": {"zero_cond_t": True},
    "layered": {"use_layer3d_rope": True, "use_additional_t_cond": True},
}


def tiny_qwen(variant: str = "plain", seed: int = 0, **kw):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(**{**TINY, **VARIANTS[variant], **kw}).double()


def make_sample(shapes, txt: int, seed: int, *, refs: int = 0, pad: int = 0, holes: bool = False, extra=None):
    """A sample with image grids ``shapes`` (the last ``refs`` of them reference images), ``txt``
    kept text tokens and ``pad`` masked-out ones after them (``holes``: some masked in the middle)."""
    from knapformer.integrations.qwenimage import QwenImageSample

    g = torch.Generator().manual_seed(seed)
    n = [math.prod(s) for s in shapes]
    n_ref = sum(n[len(n) - refs :]) if refs else 0
    lat = torch.randn(sum(n), 8, generator=g, dtype=torch.float64)
    mask = None
    if pad or holes:
        mask = torch.tensor([True] * txt + [False] * pad)
        if holes and txt > 2:
            mask = torch.tensor([True, False] * txt)[: txt + pad]
    return QwenImageSample(
        latents=lat[: sum(n) - n_ref],
        img_shapes=[tuple(s) for s in shapes],
        text=torch.randn(txt + pad, 6, generator=g, dtype=torch.float64),
        timestep=torch.rand((), generator=g, dtype=torch.float64),
        text_mask=mask,
        ref_latents=lat[sum(n) - n_ref :] if refs else None,
        additional_t_cond=extra,
    )


def stock_forward(model, s):
    """The stock forward of one sample (reference tokens after the image, outputs sliced off, as
    the edit pipelines do; a sample without text gets one masked-out padding token, the only
    text-free input the stock RoPE accepts)."""
    lat = s.latents if s.ref_latents is None else torch.cat([s.latents, s.ref_latents])
    text, mask = s.text, s.text_mask
    if text.shape[0] == 0:
        text, mask = torch.zeros(1, text.shape[1], dtype=text.dtype), torch.zeros(1, dtype=torch.bool)
    extra = None if s.additional_t_cond is None else torch.tensor([s.additional_t_cond])
    out = model(
        hidden_states=lat[None],
        encoder_hidden_states=text[None],
        encoder_hidden_states_mask=None if mask is None else mask[None],
        timestep=s.timestep[None],
        img_shapes=[list(s.img_shapes)],
        additional_t_cond=extra,
        return_dict=False,
    )[0]
    return out[0, : s.latents.shape[0]]


def targets(samples, seed: int = 99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.latents.shape[0], 8, generator=g, dtype=torch.float64) for s in samples]


rel = relative_error  # the shipped measures (knapformer.testing)
grad_error = gradient_error


OUT_TOL = 1e-12
"""Outputs: the stock RoPE rotates in fp32, but on identical inputs, so outputs agree to fp64 rounding."""
RING_OUT_TOL = 1e-7
"""Outputs under a ring plan: its online-softmax merge differs from one attention call in the
last fp64 bit, and the next layer's fp32 rotation can round that bit either way (measured ~9e-10)."""
GRAD_TOL = 1e-5
"""Gradients: the rotation's backward casts to fp32 and the packed backward sums in another
order, so fp32 rounding shows (measured ~1e-7)."""

# name -> (layout, per-rank samples: (shapes, text, refs, pad), model variant, heads, wrapper)
CASES = {
    "auto": ("auto", [[((1, 12, 10),), 5, 0, 2], [((1, 2, 2),), 3, 0, 0], [((1, 1, 1),), 1, 0, 0]], "plain", 2, ""),
    "auto-empty-rank": ("auto", [[((1, 8, 8),), 4, 0, 0]], "plain", 2, ""),
    "ring": ("auto", [[((1, 16, 14),), 6, 0, 0], [((1, 2, 3),), 2, 0, 0]], "plain", 1, ""),
    "edit-fsdp-checkpointing": ("auto", [[((1, 6, 6), (1, 4, 3)), 3, 1, 0]], "edit-zero-cond-t", 2, "fsdp+ckpt"),
    "g1n2-idle-rank": ("g1n2", [[((1, 3, 4),), 2, 0, 0]], "plain", 2, ""),  # rank 1 holds no token at all
    "fsdp-checkpointing-empty-rank": ("auto", [[((1, 10, 8),), 3, 0, 0]], "plain", 2, "fsdp+ckpt"),
}
_RANK1 = {  # rank 1's samples per case ("auto-empty-rank": none)
    "auto": [[((1, 2, 4),), 0, 0, 0]],
    "auto-empty-rank": [],
    "ring": [[((1, 3, 1),), 1, 0, 0]],
    "edit-fsdp-checkpointing": [[((1, 2, 2), (1, 2, 1)), 2, 1, 0]],
    "g1n2-idle-rank": [],
    "fsdp-checkpointing-empty-rank": [],
}


def _spec_samples(spec, seed: int, variant: str):
    extra = 1 if variant == "layered" else None
    return [make_sample(sh, t, seed + i, refs=r, pad=p, extra=extra) for i, (sh, t, r, p) in enumerate(spec)]


def check_qwen_cases(rank: int, world: int) -> dict:
    """Every 2-rank case: outputs == the stock per-sample forward, all-reduced gradients of
    every parameter == the stock gradients of all samples; plans made by ``auto`` with a link
    model (``ring``: one head, so a long sample can only spread as a ring)."""
    from knapformer import BalancerConfig, SequenceBalancer
    from knapformer.integrations.qwenimage import packed_qwenimage_forward, qwenimage_seq_lens, qwenimage_workload
    from knapformer.plan.cost import LinkModel

    report = {}
    for name, (layout, spec0, variant, heads, wrapper) in CASES.items():
        per_rank = [_spec_samples(spec0, 0, variant), _spec_samples(_RANK1[name], 100, variant)]
        flat = [s for r in per_rank for s in r]
        tg = targets(flat)
        ref = tiny_qwen(variant, num_attention_heads=heads)
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
        bal = SequenceBalancer(BalancerConfig(layout=layout, cost=qwenimage_workload(model), link=link))
        mine = per_rank[rank]
        first = len(per_rank[0]) if rank else 0
        plan = bal.plan(qwenimage_seq_lens(model, mine))
        outs = packed_qwenimage_forward(model, mine, bal)
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
    """A malformed sample on rank 1 (wrong latent width; img_shapes that do not match the
    tokens) raises BalancerInputError on every rank; the next, good step runs."""
    from knapformer import SequenceBalancer
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.qwenimage import packed_qwenimage_forward, qwenimage_seq_lens, qwenimage_workload

    model = tiny_qwen()
    bal = SequenceBalancer("g2n1", qwenimage_workload(model))
    out = []
    for case in ("width", "shapes"):
        samples = [make_sample(((1, 2, 3),), 2, seed=rank)]
        if rank == 1 and case == "width":
            samples[0].latents = torch.randn(6, 5, dtype=torch.float64)
        if rank == 1 and case == "shapes":
            samples[0].img_shapes = [(1, 2, 2)]
        bal.plan(qwenimage_seq_lens(model, samples))
        try:
            packed_qwenimage_forward(model, samples, bal)
            out.append(("ok", ""))
        except BalancerInputError as exc:
            out.append(("BalancerInputError", str(exc)))
        good = [make_sample(((1, 2, 2),), 1, seed=rank)]
        bal.plan(qwenimage_seq_lens(model, good))
        packed_qwenimage_forward(model, good, bal)[0].sum().backward()
    return out
