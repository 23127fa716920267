"""Shared helpers for the diffusers Flux.2 tests (tiny random model, samples, stock reference)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

AXES = (2, 2, 2, 2)
TINY = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=8,
    timestep_guidance_channels=16,
    axes_dims_rope=AXES,
)


def tiny_flux2(guidance: bool = False, seed: int = 0):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(**TINY, guidance_embeds=guidance).double()


def _grid(h: int, w: int, t: int = 0) -> torch.Tensor:
    ids = torch.zeros(h, w, len(AXES), dtype=torch.float64)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h, dtype=torch.float64)[:, None]
    ids[..., 2] = torch.arange(w, dtype=torch.float64)[None, :]
    return ids.reshape(-1, len(AXES))


def make_sample(h: int, w: int, txt: int, seed: int, *, ref: tuple[int, int] | None = None, guidance: bool = False):
    """A sample of an h x w image with ``txt`` text tokens (and an rh x rw reference image)."""
    from knapformer.integrations.flux2 import Flux2Sample

    g = torch.Generator().manual_seed(seed)
    ref_latents = ref_ids = None
    if ref is not None:
        ref_latents = torch.randn(ref[0] * ref[1], 4, generator=g, dtype=torch.float64)
        ref_ids = _grid(*ref, t=10)  # the pipeline's time offset of a reference image
    txt_ids = torch.zeros(txt, len(AXES), dtype=torch.float64)
    txt_ids[:, 3] = torch.arange(txt, dtype=torch.float64)
    return Flux2Sample(
        latents=torch.randn(h * w, 4, generator=g, dtype=torch.float64),
        text=torch.randn(txt, 8, generator=g, dtype=torch.float64),
        timestep=torch.rand((), generator=g, dtype=torch.float64),
        img_ids=_grid(h, w),
        txt_ids=txt_ids,
        guidance=torch.tensor(3.5, dtype=torch.float64) if guidance else None,
        ref_latents=ref_latents,
        ref_ids=ref_ids,
    )


def stock_forward(model, s):
    """The stock forward of one sample (reference tokens appended to the image, as the
    pipeline does, and their outputs sliced off)."""
    latents = s.latents if s.ref_latents is None else torch.cat([s.latents, s.ref_latents])
    img_ids = s.img_ids if s.ref_ids is None else torch.cat([s.img_ids, s.ref_ids])
    out = model(
        hidden_states=latents[None],
        encoder_hidden_states=s.text[None],
        timestep=s.timestep[None],
        img_ids=img_ids,
        txt_ids=s.txt_ids,
        guidance=None if s.guidance is None else s.guidance[None],
        return_dict=False,
    )[0]
    return out[0, : s.latents.shape[0]]


def targets(samples, seed=99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.latents.shape[0], 4, generator=g, dtype=torch.float64) for s in samples]


def grad_error(model, ref, world: int) -> tuple[float, list[str]]:
    """Worst relative error of the all-reduced gradients against the stock ones, and the
    parameters without a gradient."""
    ref_p = dict(ref.named_parameters())
    missing, worst = [], 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        if hasattr(p.grad, "full_tensor"):  # FSDP2: sharded, averaged over the ranks
            g = p.grad.full_tensor() * world
        else:
            g = p.grad.clone()
            if world > 1:
                dist.all_reduce(g)
        r = ref_p[name].grad
        worst = max(worst, (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12))
    return worst, missing


# (h, w, text, reference (h, w) or None) per sample, per rank
CASES = {
    "g1n2": ("g1n2", [[(2, 2, 3, None), (3, 2, 0, (2, 2))], [(1, 1, 2, None)]]),
    "g2n1": ("g2n1", [[(4, 3, 2, (2, 3))], []]),  # one sample over both ranks; rank 1 brings nothing
    "auto": ("auto", [[(1, 1, 0, None), (5, 4, 3, (3, 2)), (2, 2, 1, None)], [(1, 2, 4, None)]]),
    # FSDP2 on the blocks and the root, checkpointing, rank 1 without a sample (issues 58, 59)
    "g2n1-fsdp-checkpointing": ("g2n1", [[(4, 3, 2, (2, 3))], []]),
}


def check_flux2_balanced(rank: int, world: int, case: str) -> dict:
    """Outputs and all-reduced gradients of every parameter equal the stock per-sample forward."""
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.integrations.flux2 import flux2_seq_lens, packed_flux2_forward

    layout, spec = CASES[case]
    all_samples = [
        [make_sample(h, w, t, 100 * r + i, ref=ref) for i, (h, w, t, ref) in enumerate(spec[r])] for r in range(world)
    ]
    flat = [s for r in all_samples for s in r]
    tg = targets(flat)
    ref = tiny_flux2()
    model = copy.deepcopy(ref)
    sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
    if "fsdp" in case:
        from torch.distributed.fsdp import fully_shard

        model.enable_gradient_checkpointing()
        for b in [*model.transformer_blocks, *model.single_transformer_blocks]:
            fully_shard(b)
        fully_shard(model)
    bal = SequenceBalancer(layout, WorkloadModel(d_model=16, num_heads=2), link="free")  # free: samples split
    mine = all_samples[rank]
    first = sum(len(r) for r in all_samples[:rank])
    bal.plan(flux2_seq_lens(model, mine))
    outs = packed_flux2_forward(model, mine, bal)
    out_err = 0.0
    with torch.no_grad():
        for o, s in zip(outs, mine):
            r = stock_forward(ref, s)
            assert o.shape == r.shape
            out_err = max(out_err, (o - r).abs().max().item())
    my_t = torch.cat(tg[first : first + len(mine)]) if mine else torch.zeros(0, 4, dtype=torch.float64)
    (outs.flat * my_t).sum().backward()  # an empty rank joins the backward exchanges through .flat
    worst, missing = grad_error(model, ref, world)
    degrees = sorted({len(g) for g in bal.current_plan.groups})
    return {"out_err": out_err, "grad_err": worst, "missing": missing, "degrees": degrees}


def check_flux2_cases(rank: int, world: int) -> dict:
    """Every case of :data:`CASES` in one spawn (balancers are built in the same order on every rank)."""
    return {case: check_flux2_balanced(rank, world, case) for case in CASES}
