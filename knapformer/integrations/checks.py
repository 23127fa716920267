"""The family seam's bad-input checks: every field of a sample checked before any rank embeds
it, the first problem named by sample and field, and raised on every rank of the group.

A malformed sample found inside the embedders would raise on its own rank only, and the other
ranks would wait in the step's first exchange until a timeout. So each family's ``problem``
function composes these checks into one message ("" when every sample is fine) and the seam
hands it to :func:`raise_problem` before anything runs: the balancer raises it on every rank
(the others are entering the same agreement), a local run raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from knapformer.executor import TokenExecutor

__all__ = [
    "begin",
    "first",
    "grid_problem",
    "mask_problem",
    "raise_problem",
    "rows_problem",
    "safe_lens",
    "scalar_problem",
    "shape_problem",
]


def first(problems: Iterable[str]) -> str:
    """The first non-empty problem ("" if none)."""
    return next((p for p in problems if p), "")


def _shape(t) -> tuple | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def rows_problem(i: int, name: str, t, width: int, *, optional: bool = False, rows: str = "L") -> str:
    """Sample ``i``'s ``name`` must be a (rows, width) tensor (None allowed when ``optional``)."""
    if t is None and optional:
        return ""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != width:
        return f"sample {i}: {name} must be ({rows}, {width}), got {_shape(t) if t is not None else None}"
    return ""


def shape_problem(i: int, name: str, t, shape: Sequence[int]) -> str:
    """Sample ``i``'s ``name`` must be a tensor of exactly ``shape``."""
    return "" if _shape(t) == tuple(shape) else f"sample {i}: {name} must be {tuple(shape)}, got {_shape(t)}"


def grid_problem(i: int, name: str, t, channels: int, patch: Sequence[int], axes: str, most: int | None = None) -> str:
    """Sample ``i``'s ``name`` must be a (channels, *axes) latent in whole patches: each size a
    positive multiple of its ``patch`` (and at most ``most``)."""
    shape, patch = _shape(t), tuple(patch)
    ok = shape is not None and len(shape) == len(patch) + 1 and shape[0] == channels
    ok = ok and all(n > 0 and n % k == 0 and (most is None or n <= most) for n, k in zip(shape[1:], patch))
    limit = "" if most is None else f", each at most {most}"
    return "" if ok else f"sample {i}: {name} must be ({channels}, {axes}) in whole patches {patch}{limit}, got {shape}"


def mask_problem(i: int, name: str, mask, n: int) -> str:
    """Sample ``i``'s optional ``name`` mask must hold one value per row (``n``)."""
    if mask is None:
        return ""
    shape = tuple(torch.as_tensor(mask).shape)
    return "" if shape == (n,) else f"sample {i}: {name} must be ({n},), got {shape}"


def scalar_problem(i: int, name: str, value, counts: Sequence[int] = (1,)) -> str:
    """Sample ``i``'s ``name`` must hold one of ``counts`` values (one, by default)."""
    try:
        n = torch.as_tensor(value).numel()
    except (TypeError, ValueError, RuntimeError):
        return f"sample {i}: {name} must be a number or a tensor, got {type(value).__name__}"
    if n in counts:
        return ""
    want = "one value" if tuple(counts) == (1,) else " or ".join(str(c) for c in counts) + " values"
    return f"sample {i}: {name} must be {want}, got {n}"


def safe_lens(count: Callable[[object], int], samples: Sequence) -> list[int]:
    """``count(sample)`` per sample, 0 for one that cannot be counted: a lengths function
    never raises for a malformed sample (the forward reports it on every rank of the group, so
    no rank is left waiting in ``plan``)."""
    out = []
    for s in samples:
        try:
            out.append(int(count(s)))
        except (AttributeError, IndexError, RuntimeError, TypeError, ValueError):
            out.append(0)
    return out


def raise_problem(executor: TokenExecutor | None, problem: str) -> None:
    """Raise a malformed sample's ``problem``: on every rank of a balancer's group (the others
    are entering the step's first exchange), or here as a ``ValueError``; nothing when empty."""
    if not problem:
        return
    if executor is not None:
        executor.raise_everywhere(problem)
    raise ValueError(problem)


def begin(model, samples: Sequence, executor: TokenExecutor | None, prepare, problem, weight: torch.Tensor):
    """What every packed forward does first: ``prepare(model)`` (its processors and hooks on
    this instance), then every sample checked (``problem(model, samples)``, raised on every
    rank). Returns (``model.config``, the device and dtype of ``weight``: where it computes)."""
    prepare(model)
    raise_problem(executor, problem(model, samples))
    return getattr(model, "config", None), weight.device, weight.dtype
