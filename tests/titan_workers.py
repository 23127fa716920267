"""Helpers and gloo workers for the torchtitan Flux tests: a tiny random ``FluxModel`` (fp64),
samples of several resolutions, the stock per-sample forward (the reference) and the balanced
runs on 2 ranks (plain, torchtitan's own FSDP2 and activation checkpointing)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

TOL = 1e-6
"""Relative tolerance of packed vs stock in fp64: the stock model computes RoPE in fp32 even in
an fp64 model (``rope`` returns ``.float()``, ``apply_rope`` upcasts to fp32), so two runs whose
q/k differ in the last fp64 bit (matmuls of other row counts) can round one element to a
neighbouring fp32 value; everything else is fp64. A wrong modulation row or attention span
errs by O(1)."""

CFG = dict(num_heads=4, head_dim=16, num_double=1, num_single=1, in_dim=16, text_dim=32, vec_dim=24)


def tiny_titan_flux(seed: int = 0, **overrides):
    """fp64 FluxModel whose every weight is random (no zero-initialised modulation)."""
    from knapformer.integrations.torchtitan_flux import TitanFluxConfig, build_titan_flux

    torch.manual_seed(seed)
    return build_titan_flux(TitanFluxConfig(**{**CFG, **overrides})).double()


def make_sample(h: int, w: int, txt: int, seed: int):
    from knapformer.integrations.torchtitan_flux import TitanFluxSample

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(h, w, 3, dtype=torch.float64)
    ids[..., 1] = torch.arange(h, dtype=torch.float64)[:, None]
    ids[..., 2] = torch.arange(w, dtype=torch.float64)[None, :]
    return TitanFluxSample(
        latents=torch.randn(h * w, CFG["in_dim"], generator=g, dtype=torch.float64),
        text=torch.randn(txt, CFG["text_dim"], generator=g, dtype=torch.float64),
        pooled=torch.randn(CFG["vec_dim"], generator=g, dtype=torch.float64),
        timestep=torch.rand((), generator=g, dtype=torch.float64),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(txt, 3, dtype=torch.float64),
    )


def stock_forward(model, s) -> torch.Tensor:
    """torchtitan's own forward on one sample (batch of one): (T_img, C)."""
    out = model(
        img=s.latents[None],
        img_ids=s.img_ids[None],
        txt=s.text[None],
        txt_ids=s.txt_ids[None],
        timesteps=torch.as_tensor(s.timestep).reshape(1),
        y=s.pooled[None],
    )
    return out[0]


def targets(samples, seed: int = 99) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.latents.shape[0], CFG["in_dim"], generator=g, dtype=torch.float64) for s in samples]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def grad_error(model, ref, reduce: str) -> tuple[float, list[str]]:
    """Worst relative gradient error against ``ref`` (after summing over ranks) and the names of
    parameters without a gradient."""
    ref_p = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in ref.named_parameters()}
    worst, missing = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()  # FSDP2 summed it (torchtitan disables the division)
        elif reduce == "sum":
            g = g.clone()
            dist.all_reduce(g)
        r = ref_p[name.replace("_checkpoint_wrapped_module.", "")].grad
        worst = max(worst, (g - r).abs().max().item() / max(r.abs().max().item(), 1e-12))
    return worst, missing


# (h, w, text) per sample, per rank: two resolutions, one-token text, a sample long enough
# that auto splits it, and (in "empty") a rank with no sample at all
RANK_SAMPLES = {
    "mixed": ("auto", [[(6, 8, 5), (2, 2, 1)], [(3, 3, 2), (4, 2, 1), (2, 3, 7)]]),
    "empty": ("auto", [[(5, 6, 3), (1, 1, 1)], []]),
    # one sample in the group and no splitting: rank 1 routes nothing, yet joins every exchange
    "idle": ("g1n2", [[(3, 4, 2)], []]),
}


def check_balanced(rank: int, world: int, case: str, wrapper: str) -> dict:
    """``auto`` on 2 ranks: outputs equal the stock per-sample forward and gradients (summed
    over ranks) equal the stock per-sample gradients. ``wrapper``: "none", or "fsdp" for
    torchtitan's own ``apply_ac`` + ``apply_fsdp`` (FSDP2 with its gradient division off, as
    ``parallelize_flux`` leaves it)."""
    from knapformer import SequenceBalancer
    from knapformer.integrations.torchtitan_flux import (
        packed_titan_flux_forward,
        titan_flux_seq_lens,
        titan_flux_workload,
    )

    layout, spec = RANK_SAMPLES[case]
    every = [[make_sample(h, w, t, seed=100 * r + i) for i, (h, w, t) in enumerate(spec[r])] for r in range(world)]
    flat = [s for r in every for s in r]
    tg = targets(flat)
    ref = tiny_titan_flux()
    model = copy.deepcopy(ref)
    sum((stock_forward(ref, s) * t).sum() for s, t in zip(flat, tg)).backward()
    if wrapper == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.models.flux.parallelize import apply_ac, apply_fsdp

        apply_ac(model)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        apply_fsdp(model, mesh, param_dtype=torch.float64, reduce_dtype=torch.float64)
    bal = SequenceBalancer(layout, titan_flux_workload(model), link="free")  # free: samples split
    mine = every[rank]
    first = sum(len(r) for r in every[:rank])
    plan = bal.plan(titan_flux_seq_lens(model, mine))
    outs = packed_titan_flux_forward(model, mine, bal)
    with torch.no_grad():
        for o, s in zip(outs, mine):
            err = relative_error(o, stock_forward(ref, s))
            assert err < TOL, f"rank {rank}: balanced output differs by {err:.2e} (relative)"
    my_t = torch.cat(tg[first : first + len(mine)]) if mine else torch.zeros(0, CFG["in_dim"], dtype=torch.float64)
    (outs.flat * my_t).sum().backward()  # an empty rank joins the backward exchanges through .flat
    worst, missing = grad_error(model, ref, "sum")
    assert not missing, f"rank {rank}: parameters without gradient: {missing[:4]}"
    assert worst < TOL, f"{case}/{wrapper}: gradient relative error {worst:.2e}"
    return {"grad_err": worst, "sizes": sorted(set(plan.group_sizes().tolist())), "routed": int(bal.spec.num_routed)}


def check_bad_sample(rank: int, world: int) -> str:
    """Rank 1 hands a sample whose text has the wrong width: every rank raises the same error."""
    from knapformer import SequenceBalancer
    from knapformer.distributed import BalancerInputError
    from knapformer.integrations.torchtitan_flux import (
        packed_titan_flux_forward,
        titan_flux_seq_lens,
        titan_flux_workload,
    )

    model = tiny_titan_flux()
    samples = [make_sample(3, 3, 2, seed=rank)]
    if rank == 1:
        samples[0].text = samples[0].text[:, :-1]
    bal = SequenceBalancer("auto", titan_flux_workload(model), link="free")
    bal.plan(titan_flux_seq_lens(model, samples))
    try:
        packed_titan_flux_forward(model, samples, bal)
    except BalancerInputError as exc:
        return str(exc)
    raise AssertionError("a malformed sample was accepted")


def check_all(rank: int, world: int) -> dict:
    """Every multi-rank check in one spawn (torchtitan's import is the slow part of a start)."""
    out = {f"{case}/{wrapper}": check_balanced(rank, world, case, wrapper) for case, wrapper in RUNS}
    out["bad"] = check_bad_sample(rank, world)
    return out


RUNS = [("mixed", "none"), ("empty", "none"), ("idle", "none"), ("mixed", "fsdp"), ("empty", "fsdp")]
