"""Packing variable-length samples into one ``(sum L, C)`` tensor plus ``seq_lens``.

The balancer (and the packed reference models) take a rank's sequences concatenated along the
token axis with their lengths, not padded ``(B, L_max, C)`` batches: padding a 256-token image
to a 65k-token video's length would waste 99% of the work. :class:`PackedCollate` is a
``collate_fn`` that builds that form from a ``Dataset`` whose items are dicts of tensors. It is
a plain picklable class, so it works with ``DataLoader(num_workers > 0)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch

__all__ = ["PackedCollate"]


class PackedCollate:
    """``collate_fn`` for samples that are dicts of tensors (or bare ``(L_i, ...)`` tensors,
    packed under the first key).

    ``packed``: the keys whose tensors are ``(L_i, ...)`` per sample (their first dimension
    varies); they are concatenated along dimension 0, and the first key's lengths become
    ``"seq_lens"`` (a list of ints). Further packed keys of other lengths (text tokens of their
    own length, say) get ``"<key>_lens"`` next to them. Every other tensor is per-sample
    conditioning (a timestep, a pooled embedding, a label) and is stacked to ``(S, ...)``.
    Python numbers (an ``int`` frame count or text length, a ``float``, a ``bool`` flag) become an
    ``(S,)`` tensor too, as ``torch.tensor(values)`` makes it (int64, the default float dtype,
    bool), so a model can index or move them like any other field; other values (strings, say)
    are returned as lists.

    A rank that gets an empty batch (see :class:`~knapformer.data.TokenBudgetBatchSampler`)
    needs tensors with no rows of the right trailing shape and dtype: pass ``example`` (one
    sample, e.g. ``dataset[0]``) to take them from.
    """

    def __init__(
        self, packed: Sequence[str] = ("tokens",), *, example: Mapping[str, Any] | torch.Tensor | None = None
    ) -> None:
        if isinstance(packed, str) or not packed:
            raise ValueError("packed must be a non-empty sequence of keys, e.g. ('latents',)")
        self.packed = tuple(packed)
        self.example = example

    def __call__(self, samples: Sequence[Mapping[str, Any]] | Sequence[torch.Tensor]) -> dict[str, Any]:
        if not samples:
            return self._empty()
        if all(isinstance(s, torch.Tensor) for s in samples):  # bare (L_i, ...) tensors
            samples = [{self.packed[0]: s} for s in samples]
        keys = list(samples[0])
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping):
                raise TypeError(f"sample {i} is a {type(s).__name__}; PackedCollate takes dicts of tensors")
            if s.keys() != samples[0].keys():
                raise ValueError(f"sample {i} has keys {sorted(s)}, sample 0 has {sorted(keys)}")
        missing = [k for k in self.packed if k not in keys]
        if missing:
            raise KeyError(f"packed keys {missing} are not in the samples (keys: {keys})")
        out: dict[str, Any] = {}
        for j, key in enumerate(self.packed):
            parts = [s[key] for s in samples]
            for i, p in enumerate(parts):
                if not isinstance(p, torch.Tensor) or p.dim() < 1:
                    raise ValueError(f"sample {i}'s {key!r} must be a tensor with a token dimension first")
                if p.shape[1:] != parts[0].shape[1:]:
                    raise ValueError(
                        f"sample {i}'s {key!r} has shape {tuple(p.shape)}, sample 0's {tuple(parts[0].shape)}: "
                        "only the first (token) dimension may differ"
                    )
            out[key] = torch.cat(parts)
            out["seq_lens" if j == 0 else f"{key}_lens"] = [int(p.shape[0]) for p in parts]
        for key in keys:
            if key in self.packed:
                continue
            vals = [s[key] for s in samples]
            if all(isinstance(v, torch.Tensor) for v in vals):
                try:
                    out[key] = torch.stack(vals)
                except RuntimeError as exc:
                    raise ValueError(
                        f"{key!r} differs in shape between samples, so it cannot be stacked; list it in "
                        f"packed=... if its first dimension is per token ({exc})"
                    ) from exc
            elif all(_is_number(v) for v in vals):
                out[key] = torch.tensor(vals)
            else:
                out[key] = list(vals)
        return out

    def _empty(self) -> dict[str, Any]:
        if self.example is None:
            raise ValueError(
                "an empty batch (a rank with no samples this step) needs PackedCollate(example=dataset[0]) "
                "to know the shapes and dtypes of its empty tensors"
            )
        out: dict[str, Any] = {}
        example = self.example
        if isinstance(example, torch.Tensor):
            example = {self.packed[0]: example}
        for j, key in enumerate(self.packed):
            t = example[key]
            out[key] = t.new_empty((0, *t.shape[1:]))
            out["seq_lens" if j == 0 else f"{key}_lens"] = []
        for key, t in example.items():
            if key not in self.packed:
                if isinstance(t, torch.Tensor):
                    out[key] = t.new_empty((0, *t.shape))
                else:  # a number: an empty tensor of the dtype a batch would have; other values: a list
                    out[key] = torch.tensor([t])[:0] if _is_number(t) else []
        return out


def _is_number(v: Any) -> bool:
    """A Python (or numpy) int, float or bool: collated into a tensor."""
    return isinstance(v, Real)
