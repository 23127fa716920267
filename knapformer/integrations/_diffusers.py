"""What the integrations share: the diffusers import check, the packed output, block calls,
the executor default, bad-sample reporting, the sizes of a Flux-style preset, grid ids, and
splitting a synthetic batch into samples.

Private to :mod:`knapformer.integrations`; each integration module (``flux``, ``flux2``,
``wan``, ``torchtitan_flux``) imports these instead of another integration's names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.data.batches import Batch
from knapformer.executor import LocalExecutor, TokenExecutor
from knapformer.integrations.configs import FluxSizes

__all__ = [
    "BatchSample",
    "FluxSizes",
    "PackedOutput",
    "batch_samples",
    "call_block",
    "cat_or_empty",
    "executor_or_local",
    "grid_ids",
    "raise_sample_problem",
    "require_diffusers",
    "stack_scalars",
    "visual_targets",
]

_MIN, _MAX = (0, 35), (0, 43)


def require_diffusers():
    """Import diffusers or raise one clear error naming the extra."""
    try:
        import diffusers
    except ImportError as exc:
        raise ImportError(
            "knapformer's diffusers integrations need diffusers>=0.35,<0.43: pip install 'knapformer[diffusers]'"
        ) from exc
    version = tuple(int(p) for p in diffusers.__version__.split(".")[:2] if p.isdigit())
    if not (_MIN <= version < _MAX):
        raise ImportError(
            f"diffusers {diffusers.__version__} is not supported (need >=0.35,<0.43): "
            "pip install 'knapformer[diffusers]'"
        )
    return diffusers


class PackedOutput(list):
    """Per-sample outputs (a list, original order) plus ``flat``: all of this rank's output rows
    as one tensor. Build the loss from ``flat`` (or add ``0 * flat.sum()`` to a loss built from
    the list): on a rank with no samples ``flat`` is empty but still connected to the step's
    collectives, so ``loss.backward()`` there joins the backward exchanges instead of leaving
    the other ranks waiting."""

    flat: torch.Tensor

    @classmethod
    def of(cls, parts: Sequence[torch.Tensor], flat: torch.Tensor):
        out = cls(parts)
        out.flat = flat
        return out


def grid_ids(n: int, axes: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n, axes) position ids of n image tokens on a near-square grid (the last two axes are
    row and column; the others 0)."""
    w = max(1, int(n**0.5))
    pos = torch.arange(n, dtype=dtype)
    ids = torch.zeros(n, axes, dtype=dtype)
    ids[:, -2], ids[:, -1] = pos // w, pos % w
    return ids


def executor_or_local(executor: TokenExecutor | None, seq_lens: Sequence[int]) -> TokenExecutor:
    """The planned executor, or a :class:`LocalExecutor` of these lengths (no balancing)."""
    return executor if executor is not None else LocalExecutor(seq_lens)


def raise_sample_problem(executor: TokenExecutor | None, error: str) -> None:
    """Raise a malformed sample's ``error``: on every rank of a balancer's group (the others are
    entering the step's first exchange), or here as a ``ValueError``."""
    if not error:
        return
    if executor is not None:
        executor.raise_everywhere(error)
    raise ValueError(error)


def call_block(model, block, *args):
    """``block(*args)``, through the model's activation checkpointing when it is on (the
    recompute sees the packed metadata: it travels in the arguments)."""
    if torch.is_grad_enabled() and getattr(model, "gradient_checkpointing", False):
        return model._gradient_checkpointing_func(block, *args)
    return block(*args)


def cat_or_empty(parts, empty_shape, device, dtype) -> torch.Tensor:
    """``torch.cat(parts)`` on ``device``/``dtype``, or zeros of ``empty_shape`` for no parts."""
    t = torch.cat([p.to(device) for p in parts]) if parts else torch.zeros(empty_shape, device=device)
    return t if dtype is None else t.to(dtype)


def stack_scalars(values, device, dtype) -> torch.Tensor:
    """(n,) from per-sample scalars (tensors or numbers)."""
    if not values:
        return torch.zeros(0, device=device, dtype=dtype)
    return torch.stack([torch.as_tensor(v).reshape(()) for v in values]).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class BatchSample:
    """One sequence of a synthetic batch, split into its text rows and its visual rows."""

    text: torch.Tensor
    visual: torch.Tensor
    target: torch.Tensor
    timestep: torch.Tensor
    vec: torch.Tensor


def batch_samples(batch: Batch) -> list[BatchSample]:
    """The sequences of a synthetic batch (text rows first in each, as the data codes make them)."""
    out, start = [], 0
    for n, t, ts, vec in zip(batch.seq_lens, batch.txt_lens.tolist(), batch.t, batch.vec):
        rows = slice(start + t, start + n)
        out.append(BatchSample(batch.x[start : start + t], batch.x[rows], batch.target[rows], ts, vec))
        start += n
    return out


def visual_targets(batch: Batch, rows: Sequence[int]) -> torch.Tensor:
    """The targets of the first ``rows[i]`` visual rows of each sequence, concatenated (what a
    model that outputs only visual tokens is compared with)."""
    parts = [s.target[:r] for s, r in zip(batch_samples(batch), rows)]
    return torch.cat(parts) if parts else batch.target[:0]
