"""Sequence bounds on the device *and* on the host, so that no layer reads a device tensor.

Varlen kernels take ``cu_seqlens`` as a device tensor; the per-sequence SDPA fallback and the
bounds checks need the same numbers on the host. Reading them back from the device
(``cu.tolist()``) makes the host wait for the GPU's queue to drain — once per layer, every
step. The balancer builds every bounds tensor once per plan from host numbers it already
has, so it registers the host copy beside the device tensor (:func:`upload`), and the
kernels ask :func:`host_bounds`, which returns the registered copy (and only falls back to
reading the tensor for bounds built elsewhere, e.g. by a user).

A backend that takes bounds as lists (``cross``, ``attend_qk``) receives a :class:`Bounds`: a
plain ``list`` of ints that also carries the device tensor (``.tensor``), so a kernel that
needs it on the device (flash-attn) does not copy it up again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["Bounds", "derived", "host_bounds", "host_values", "index_to", "remember", "to_device", "upload"]

_HOST: dict[int, tuple[weakref.ref, tuple[int, ...]]] = {}
_DERIVED: dict[tuple, tuple[list, object]] = {}


class Bounds(list):
    """Host bounds (a list of ints) that may carry their device tensor as ``tensor``."""

    tensor: torch.Tensor | None = None


def remember(t: torch.Tensor, host: Sequence[int]) -> torch.Tensor:
    """Register ``host`` as the values of bounds tensor ``t`` (for as long as ``t`` lives)."""
    key = id(t)
    _HOST[key] = (weakref.ref(t, lambda _: _HOST.pop(key, None)), tuple(int(x) for x in host))
    return t


def host_bounds(t: torch.Tensor) -> Bounds:
    """The values of bounds tensor ``t`` on the host: registered ones if any (no device read),
    else read from ``t`` (a host-device synchronisation on a GPU)."""
    entry = _HOST.get(id(t))
    if entry is not None and entry[0]() is t:
        out = Bounds(entry[1])
    else:
        out = Bounds(t.tolist())  # on a GPU: a synchronisation (tests count these calls)
    out.tensor = t
    return out


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (on the host) on ``device``: itself on the CPU; elsewhere an asynchronous copy from
    pinned memory (no host-device synchronisation; PyTorch keeps the pinned buffer until the
    copy has run)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    src = t.pin_memory() if torch.cuda.is_available() else t
    return src.to(device, non_blocking=True)


def index_to(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host index array as an int64 tensor on ``device`` (:func:`to_device`: no device
    synchronisation); for index tables built once per plan or step on the host."""
    return to_device(torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64)), device)


def host_values(t: torch.Tensor) -> np.ndarray:
    """The values of a tensor that should be on the host (an executor's routed ids, gathered
    counts), as numpy; a device tensor still works, at the cost of one synchronisation."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def upload(host: Sequence[int] | np.ndarray, device: torch.device | str, dtype=torch.int32) -> torch.Tensor:
    """Bounds ``host`` as a ``dtype`` tensor on ``device`` (:func:`to_device`), with the host
    values registered (:func:`remember`)."""
    values = np.asarray(host, dtype=np.int64)
    t = to_device(torch.from_numpy(values.astype(np.int32 if dtype == torch.int32 else np.int64)), device)
    return remember(t, values.tolist())


def derived(anchors: Sequence[torch.Tensor], key: tuple, build):
    """``build()``, computed once for as long as every tensor of ``anchors`` lives (e.g. index
    tensors derived from a plan's bounds: every layer of the step reuses them)."""
    k = (tuple(id(a) for a in anchors), key)
    entry = _DERIVED.get(k)
    if entry is not None and all(r() is a for r, a in zip(entry[0], anchors)):
        return entry[1]
    value = build()
    _DERIVED[k] = ([weakref.ref(a, lambda _: _DERIVED.pop(k, None)) for a in anchors], value)
    return value
