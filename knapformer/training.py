"""Training-loop helpers for balanced steps: the global-mean loss under any gradient reduction,
a gradient sum whose buffers are safe at exit, and a process group that survives torchrun's
restarts (:func:`init_restartable`).

**The global-mean loss.** Balancing moves tokens between ranks, so "the mean over this rank's
tokens" changes from step to step and weights a token on a rank with few tokens more than one
on a rank with many. The loss that does not depend on where tokens ran is the mean over every
token of every rank: each rank contributes ``local_sum / N`` with ``N`` the token count of the
whole data-parallel world (one all-reduce of a scalar), and the gradients must then be *summed*
over ranks. DDP and FSDP2 *average* gradients (they divide by the world size), so the loss each
rank backpropagates must be ``world · local_sum / N`` — exactly what :func:`global_mean_loss`
returns for ``gradients="mean"`` (the default; FSDP2's ``set_gradient_divide_factor(1.0)``, the
other way, needs a ``PREMUL_SUM`` reduction gloo does not have). With a manual
``all_reduce(SUM)`` of the gradients (:func:`sum_gradients`) pass ``gradients="sum"``.

Gradient accumulation: give ``local_count`` as this rank's tokens of *all* the step's
micro-batches (known before the first backward), and call :func:`global_mean_loss` on each
micro-batch's ``local_sum``: the accumulated gradient is the global mean's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

import knapformer.distributed.lifetime as lifetime
from knapformer.distributed.backends import control_device

__all__ = ["global_mean_loss", "init_restartable", "sum_gradients"]

_REDUCTIONS = ("mean", "sum")


def _count_device(group) -> torch.device:
    """The host when the group has a CPU backend (reading the count back is then no device
    sync), else the group's device."""
    return control_device(group)


def global_mean_loss(
    local_sum: torch.Tensor,
    local_count: int | float | torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    gradients: str = "mean",
) -> torch.Tensor:
    """The loss to backpropagate on this rank so that the gradients, reduced the way
    ``gradients`` says (``"mean"``: DDP or FSDP2, which divide by the world size; ``"sum"``: a
    manual all-reduce SUM), are the gradients of the mean over every token of ``group`` (default:
    the world). ``local_sum``: this rank's summed per-token loss; ``local_count``: the tokens (or
    elements) it summed over. Collective (one all-reduce of the counts); the value returned is
    this rank's share, ``world · local_sum / N`` for ``"mean"``, so the global mean itself is the
    all-reduced mean of the returned values."""
    if gradients not in _REDUCTIONS:
        raise ValueError(f"gradients must be one of {_REDUCTIONS} (how the gradients are reduced), got {gradients!r}")
    if not isinstance(local_sum, torch.Tensor) or local_sum.numel() != 1:
        raise ValueError("local_sum must be a one-element tensor (this rank's summed loss)")
    group = dist.group.WORLD if group is None else group
    count = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).to(_count_device(group))
    lifetime.collective(lambda: dist.all_reduce(count, group=group), (count,), "global_mean_loss", group)
    total = float(count.item())
    if total <= 0:
        raise ValueError(f"the group holds {total:g} tokens in all: nothing to average over")
    scale = dist.get_world_size(group) if gradients == "mean" else 1
    return local_sum * (scale / total)


def sum_gradients(
    params: Iterable[torch.nn.Parameter] | torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    bucket_mb: float = 25.0,
) -> None:
    """All-reduce (SUM) every parameter's gradient over ``group``: plain data parallel, in
    flat buckets of at most ``bucket_mb`` MiB per dtype (what DDP's buckets do: one copy of a
    bucket at a time, not of every gradient), safe at exit (see
    :mod:`knapformer.distributed.lifetime`). Parameters without a gradient are skipped; a
    gradient larger than a bucket is reduced in place on its own."""
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
    limit = bucket_mb * 2**20
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        rows = buckets.setdefault(g.dtype, [[]])
        if rows[-1] and sum(t.numel() for t in rows[-1]) * g.element_size() + g.numel() * g.element_size() > limit:
            rows.append([])
        rows[-1].append(g)
    for rows in buckets.values():
        for grads in rows:
            _reduce_bucket(grads, group)


def _reduce_bucket(grads: list[torch.Tensor], group) -> None:
    if len(grads) == 1 and grads[0].is_contiguous():
        flat = grads[0]
        lifetime.collective(lambda: dist.all_reduce(flat, group=group), (flat,), "sum_gradients", group)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    lifetime.collective(lambda: dist.all_reduce(flat, group=group), (flat,), "sum_gradients", group)
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def init_restartable(backend: str = "gloo", *, timeout_s: float = 600.0) -> int:
    """``init_process_group`` under ``torchrun --max-restarts``, in a key space of the launcher's
    store of its own per restart; returns the restart count (``TORCHELASTIC_RESTART_COUNT``).

    Why: the launcher keeps its store across restarts, and a restarted worker's plain
    ``init_process_group`` read the *previous* attempt's gloo addresses from it — with torch
    2.13 (gloo, CPU) every restart failed in ``connectFullMesh`` ("Connection refused"), with
    or without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``. A prefix per attempt (every worker of a
    restarted group has the same count) keeps the attempts apart. Outside torchrun (no
    ``MASTER_ADDR``/``TORCHELASTIC_RESTART_COUNT``) it is a plain ``init_process_group``."""
    import datetime
    import os

    timeout = datetime.timedelta(seconds=timeout_s)
    env = os.environ
    if "TORCHELASTIC_RESTART_COUNT" not in env or "MASTER_ADDR" not in env:
        dist.init_process_group(backend, timeout=timeout)
        return 0
    attempt = int(env["TORCHELASTIC_RESTART_COUNT"])
    base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"knapformer/attempt{attempt}", base)
    dist.init_process_group(
        backend, store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout
    )
    return attempt
