"""Exactness checks for a packed model family: the packed forward against the stock one.

A family is right when its packed outputs and every parameter's gradient equal the stock
model's, one sample at a time, in fp64 (docs/extending.md). These are the two measures the
project's own family tests use, shipped so that a new family's tests need nothing from
``tests/``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gradient_error", "relative_error"]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0.0 for empty tensors): ~1e-15 for an exact fp64 match."""
    if not b.numel():
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def gradient_error(
    model: torch.nn.Module, ref: torch.nn.Module, world: int = 1, skip: str = ""
) -> tuple[float, list[str]]:
    """(worst error, missing) of ``model``'s gradients against ``ref``'s, parameter by name.

    Each parameter's error is relative to its largest stock gradient but at least 1e-6 of the
    largest of all (a gradient that is zero in exact arithmetic, e.g. a key bias under softmax,
    is rounding noise in both); a NaN counts as inf. A parameter the stock run leaves without a
    gradient must get zeros. ``missing``: the parameters without a gradient where the stock run
    has one (a ``None`` where stock has zeros matters: weight decay skips it). With ``world >
    1`` the gradients are summed over the default process group first (each rank holds its
    samples' share), or, for FSDP2's sharded gradients (averaged), gathered and scaled by
    ``world``. ``skip``: a name prefix left out."""
    ref_p = {n: p for n, p in ref.named_parameters() if not (skip and n.startswith(skip))}
    scale = max((p.grad.abs().max().item() for p in ref_p.values() if p.grad is not None), default=0.0)
    missing, worst = [], 0.0
    for name, p in model.named_parameters():
        if name not in ref_p:
            continue
        r = ref_p[name].grad
        if p.grad is None:
            if r is not None:
                missing.append(name)
            continue
        if hasattr(p.grad, "full_tensor"):  # FSDP2: sharded and averaged over the ranks
            g = p.grad.full_tensor() * world
        else:
            g = p.grad.clone()
            if world > 1:
                dist.all_reduce(g)
        r = torch.zeros_like(g) if r is None else r
        err = (g - r).abs().max().item() / max(r.abs().max().item(), 1e-6 * scale, 1e-300)
        worst = max(worst, err if err == err else float("inf"))
    return worst, missing
