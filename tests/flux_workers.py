"""Shared helpers for the diffusers Flux tests (tiny random model, samples, stock reference)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

TINY = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=8,
    pooled_projection_dim=8,
    axes_dims_rope=(2, 2, 4),
)


def tiny_flux(guidance: bool = False, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**TINY, guidance_embeds=guidance).double()


def make_sample(h: int, w: int, txt: int, seed: int, guidance: bool = False):
    from knapformer.integrations.diffusers import FluxSample

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(h, w, 3, dtype=torch.float64)
    ids[..., 1] = torch.arange(h, dtype=torch.float64)[:, None]
    ids[..., 2] = torch.arange(w, dtype=torch.float64)[None, :]
    return FluxSample(
        latents=torch.randn(h * w, 4, generator=g, dtype=torch.float64),
        text=torch.randn(txt, 8, generator=g, dtype=torch.float64),
        pooled=torch.randn(8, generator=g, dtype=torch.float64),
        timestep=torch.rand((), generator=g, dtype=torch.float64),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3, dtype=torch.float64),
        guidance=torch.tensor(3.5, dtype=torch.float64) if guidance else None,
    )


def stock_forward(model, s):
    out = model(
        hidden_states=s.latents[None],
        encoder_hidden_states=s.text[None],
        pooled_projections=s.pooled[None],
        timestep=s.timestep[None],
        img_ids=s.img_ids,
        txt_ids=s.txt_ids,
        guidance=None if s.guidance is None else s.guidance[None],
        return_dict=False,
    )[0]
    return out[0]


def targets(samples, seed=99):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.latents.shape[0], 4, generator=g, dtype=torch.float64) for s in samples]


# (h, w, text) per sample, per rank
RANK_SAMPLES = {
    "g2n1": [[(4, 6, 3)], []],  # one sample split over both ranks: rank 1 holds image tokens only
    "g1n2": [[(2, 2, 5), (5, 4, 1)], [(3, 3, 2)]],
}


def check_flux_balanced(rank: int, world: int, layout: str, wrapper: str) -> dict:
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.integrations.diffusers import flux_seq_lens, packed_flux_forward

    spec = RANK_SAMPLES[layout]
    all_samples = [
        [make_sample(h, w, t, seed=100 * r + i) for i, (h, w, t) in enumerate(spec[r])] for r in range(world)
    ]
    flat = [s for r in all_samples for s in r]
    tg = targets(flat)
    ref = tiny_flux()
    model = copy.deepcopy(ref)
    loss = sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg))
    loss.backward()
    if "ckpt" in wrapper:
        model.enable_gradient_checkpointing()
    if "fsdp" in wrapper:
        from torch.distributed.fsdp import fully_shard

        for b in [*model.transformer_blocks, *model.single_transformer_blocks]:
            fully_shard(b)
        fully_shard(model)  # the root too, as FSDP2 trainers do (issue 58)
    bal = SequenceBalancer(layout, WorkloadModel(d_model=16), link="free")  # free: samples split
    mine = all_samples[rank]
    first = sum(len(r) for r in all_samples[:rank])
    bal.plan(flux_seq_lens(model, mine))  # the step's one plan
    outs = packed_flux_forward(model, mine, bal)
    with torch.no_grad():
        for o, s in zip(outs, mine):
            assert torch.allclose(o, stock_forward(ref, s), atol=1e-10), "balanced output differs"
    my_t = torch.cat(tg[first : first + len(mine)]) if mine else torch.zeros(0, 4, dtype=torch.float64)
    (outs.flat * my_t).sum().backward()  # an empty rank joins the backward exchanges through .flat
    ref_p = dict(ref.named_parameters())
    missing, worst = [], 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor() * world  # FSDP averages
        else:
            dist.all_reduce(g)
        r = ref_p[name].grad
        worst = max(worst, (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12))
    assert not missing, f"rank {rank}: parameters without gradient: {missing[:4]}"
    assert worst < 1e-9, f"{layout}/{wrapper}: gradient relative error {worst:.2e}"
    seq_id, pos = bal.routed_positions()
    return {"routed": int(seq_id.numel()), "grad_err": worst}


def check_flux_wrong_plan(rank: int, world: int) -> str:
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.diffusers import packed_flux_forward

    bal = SequenceBalancer("g2n1", WorkloadModel(d_model=16))
    samples = [make_sample(2, 3, 2, seed=rank), make_sample(2, 2, 1, seed=rank + 5)]  # 8 + 5 tokens
    bal.plan([5, 8] if rank == 0 else [8, 5])  # rank 0 planned its samples in the wrong order
    try:
        packed_flux_forward(tiny_flux(), samples, bal)
    except BalancerInputError as exc:
        return str(exc)
    raise AssertionError("a plan for other sequences was accepted")


EDGE_CASES = {
    "g1n2-one-sample": ("g1n2", [[(3, 4, 2)], []]),  # one sample in the whole group: rank 1 routes nothing
    "g2n1-one-token": ("g2n1", [[(1, 1, 0)], []]),  # one 1-token sample split over a 2-rank bag
    "g2n1-no-text": ("g2n1", [[(2, 3, 0)], [(1, 2, 1)]]),
}


def check_flux_edge_cases(rank: int, world: int) -> dict:
    """Ranks with zero routed tokens (or zero of one stream) run every layer on empty inputs
    and equal the stock per-sample forward; every parameter still gets a gradient."""
    from knapformer import SequenceBalancer, WorkloadModel
    from knapformer.integrations.diffusers import flux_seq_lens, packed_flux_forward

    out = {}
    for name, (layout, spec) in EDGE_CASES.items():
        all_samples = [
            [make_sample(h, w, t, seed=50 * r + i) for i, (h, w, t) in enumerate(spec[r])] for r in range(world)
        ]
        flat = [s for r in all_samples for s in r]
        ref = tiny_flux()
        model = copy.deepcopy(ref)
        tg = targets(flat)
        sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
        bal = SequenceBalancer(layout, WorkloadModel(d_model=16), link="free")  # free: samples split
        mine = all_samples[rank]
        first = sum(len(r) for r in all_samples[:rank])
        bal.plan(flux_seq_lens(model, mine))
        outs = packed_flux_forward(model, mine, bal)
        with torch.no_grad():
            for o, s in zip(outs, mine):
                assert torch.allclose(o, stock_forward(ref, s), atol=1e-10), name
        my_t = torch.cat(tg[first : first + len(mine)]) if mine else torch.zeros(0, 4, dtype=torch.float64)
        (outs.flat * my_t).sum().backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, (name, missing[:3])
        worst = 0.0
        ref_p = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            r = ref_p[n].grad
            worst = max(worst, (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12))
        assert worst < 1e-9, (name, worst)
        out[name] = int(bal.spec.num_routed)
    return out
