"""Cross-rank agreement: one small all-reduce that every rank joins before data moves.

A problem only one rank can see (its lengths, the rows of its tensor, a plan it was handed)
must not make that rank leave the collective the others are entering: every rank would hang,
or gloo would abort on mismatched buffers. So each entry point of the balancer first joins
:func:`agree`: an ``all_reduce(MAX)`` of ``[error flag, v, -v, ...]`` for the values that must
be equal everywhere (the plan digest, dtype and trailing-shape signatures). The maxima say at
once whether any rank failed or any value differs; only then (the error path) does a second
collective gather who failed or differs, so the message can name the ranks. Every rank takes
the same branch, so all raise together.

Values are 62-bit digests (:func:`digest62`) so that ``-v`` fits an int64.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from knapformer.distributed.errors import BalancerInputError, PlanMismatchError

__all__ = ["agree", "digest62", "group_device"]


def digest62(text: str | bytes) -> int:
    """A non-negative 62-bit digest (negatable within int64)."""
    data = text.encode() if isinstance(text, str) else text
    return int(hashlib.sha256(data).hexdigest()[:15], 16) >> 2


def group_device(group) -> torch.device:
    """Where small control tensors of ``group`` live (CUDA for NCCL, else CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, where: str, error: str = "", values: dict[str, int] | None = None) -> None:
    """Raise on every rank if any rank reports ``error`` or any of ``values`` differs.

    ``values`` maps a name (what the message calls the value) to this rank's 62-bit digest of
    it; every rank must pass the same names in the same order."""
    values = values or {}
    names = list(values)
    row = [1 if error else 0]
    for n in names:
        row += [values[n], -values[n]]
    device = group_device(group)
    t = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    m = t.cpu().tolist()
    failed = m[0] > 0
    differs = [n for i, n in enumerate(names) if m[1 + 2 * i] != -m[2 + 2 * i]]
    if not failed and not differs:
        return
    # error path: a second collective tells every rank who failed and who differs
    size = dist.get_world_size(group)
    mine = torch.tensor([row[0]] + [values[n] for n in names], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()
    me = dist.get_rank(group)
    if failed:
        bad = [r for r in range(size) if table[r][0]]
        detail = error or f"see the error raised on rank {bad[0]}"
        raise BalancerInputError(f"{where}: bad input on rank(s) {bad} (this is rank {me}): {detail}")
    parts = []
    for n in differs:
        col = 1 + names.index(n)
        ref = table[0][col]
        parts.append(f"{n} differs on rank(s) {[r for r in range(size) if table[r][col] != ref]} from rank 0")
    cls = PlanMismatchError if any(n == "plan" for n in differs) else BalancerInputError
    raise cls(f"{where}: ranks disagree before data moves: {'; '.join(parts)} (this is rank {me})")
