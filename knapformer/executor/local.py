"""``LocalExecutor``: the executor contract in one process, with no balancing.

Tokens stay where they are and attention runs over this process's own sequences, so a model
written against :class:`~knapformer.executor.protocol.TokenExecutor` runs unchanged without
``torch.distributed`` — and every balanced run is compared with exactly this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import torch

from knapformer.attention.bounds import index_to, upload
from knapformer.attention.varlen import varlen_attention
from knapformer.executor.opaque import attend, owner_handle, register_kind
from knapformer.executor.protocol import (
    RoutedContext,
    VarlenArgs,
    context_problem,
    context_tensors,
    cross_attend,
    cross_attend_tensors,
    cross_problem,
    routed_context,
)

__all__ = ["LocalExecutor", "local_positions"]


def local_positions(seq_lens: Sequence[int], device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq id, position) of each token of sequences packed in order."""
    lens = np.asarray(list(seq_lens), dtype=np.int64)
    seq_id = np.repeat(np.arange(lens.size), lens)
    pos = np.arange(int(lens.sum())) - (np.cumsum(lens) - lens)[seq_id]
    # built on the host and uploaded without waiting for the device
    return index_to(seq_id, device or "cpu"), index_to(pos, device or "cpu")


class LocalExecutor:
    """No balancing: tokens stay in place; attention runs over this process's sequences.

    Errors are plain ``ValueError``: there are no other ranks to tell. ``report_error``
    defers a message to the next call, as a balancer defers it to its next agreement point."""

    def __init__(self, seq_lens: Sequence[int], attn_backend: str = "auto") -> None:
        self.seq_lens = [int(v) for v in seq_lens]
        self.attn_backend = attn_backend
        bounds = np.concatenate([[0], np.cumsum(self.seq_lens, dtype=np.int64)])
        self._host = bounds.tolist()
        # no sequences: one empty segment (flash-attn 2 refuses a batch of zero)
        self._bounds = bounds if len(bounds) > 1 else np.zeros(2, dtype=np.int64)
        self._on: dict[str, torch.Tensor] = {}  # bounds per device, uploaded once
        self._pending = ""
        self._pre_shape: tuple | None = None
        self._opaque = owner_handle(self)  # how the compiled operator finds this executor

    def _cu_on(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._on:
            self._on[key] = upload(self._bounds, device)
        return self._on[key]

    @property
    def num_tokens(self) -> int:
        return self._host[-1]

    def _raise_pending(self) -> None:
        if self._pending:
            message, self._pending = self._pending, ""
            raise ValueError(message)

    def route(self, x, *features, seq_lens=None, names=None):
        self._raise_pending()
        if seq_lens is not None and [int(n) for n in seq_lens] != self.seq_lens:
            raise ValueError(f"tensors laid out as sequences {list(seq_lens)}, this executor has {self.seq_lens}")
        for i, t in enumerate((x, *features)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != self.num_tokens:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"route: argument {i} is {got}; expected {self.num_tokens} token rows")
        return x if not features else (x, *features)

    def reverse_route(self, y, *features, names=None):
        self._raise_pending()
        return y if not features else (y, *features)

    def attention(self, q, k, v, causal: bool = False):
        if torch.compiler.is_compiling():  # one opaque operator: no graph break, no recompile per step
            return attend("local", q, k, v, owner=self._opaque, causal=causal, backend=self.attn_backend)
        self._raise_pending()
        return varlen_attention(
            q, k, v, self._cu_on(q.device), max(self.seq_lens, default=0), causal=causal, backend=self.attn_backend
        )

    def pre_attn(self, q, k, v, causal: bool | None = None) -> VarlenArgs:
        """Every sequence is here: the inputs as they are, with their bounds (queries and keys
        share them; ``causal`` changes nothing)."""
        self._raise_pending()
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"pre_attn: q has {q.shape[0]} rows; this executor has {self.num_tokens} tokens")
        self._pre_shape = (q.shape[0], q.shape[1], v.shape[2])
        cu, mx = self._cu_on(q.device), max(self.seq_lens, default=0)
        return VarlenArgs(q, k, v, cu, cu, mx, mx)

    def post_attn(self, o):
        if self._pre_shape is None:
            raise RuntimeError("LocalExecutor.post_attn: call pre_attn first (post_attn inverts it)")
        expected, self._pre_shape = self._pre_shape, None
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != expected:
            got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"post_attn got {got}, expected {expected} (pre_attn's q rows and heads, v's head dim)")
        return o

    def routed_positions(self, device=None):
        """(seq id, position) of every token, on ``device`` (or a tensor's device)."""
        if isinstance(device, torch.Tensor):
            device = device.device
        return local_positions(self.seq_lens, device)

    def present_sequences(self, device=None):
        """Every sequence with at least one token, and each token's row among them (host-built)."""
        lens = np.asarray(self.seq_lens, dtype=np.int64)
        present = np.flatnonzero(lens > 0)
        slot = np.repeat(np.arange(present.size), lens[present])
        return index_to(present, device or "cpu"), index_to(slot, device or "cpu")

    def gather_sequences(self, *per_seq, names=None):
        self._raise_pending()
        return tuple(per_seq)

    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Every sequence is here: its context stays (checked against the sequences)."""
        self._raise_pending()
        error = context_problem(context, lens, len(self.seq_lens))
        if error:
            raise ValueError(f"route_context: {error}")
        seq, _ = local_positions(self.seq_lens, context.device)
        return routed_context(context, torch.arange(len(self.seq_lens)), lens, seq)

    def cross_attention(self, q, k, v, context: RoutedContext):
        if torch.compiler.is_compiling():
            return attend("cross", q, k, v, context_tensors(context), backend=self.attn_backend)
        error = cross_problem(q, k, v, context, sum(self.seq_lens))
        if error:
            raise ValueError(f"cross_attention: {error}")
        return cross_attend(q, k, v, context, self.attn_backend)

    def report_error(self, message: str) -> None:
        self._pending = self._pending or str(message)

    def raise_everywhere(self, message: str) -> NoReturn:
        self._pending = ""
        raise ValueError(message)


def _local_kind(owner, q, k, v, extra, causal, backend):
    cu, longest = owner._cu_on(q.device), max(owner.seq_lens, default=0)
    return varlen_attention(q, k, v, cu, longest, causal=causal, backend=backend)


register_kind("local", _local_kind)
register_kind("cross", lambda owner, q, k, v, extra, causal, backend: cross_attend_tensors(q, k, v, extra, backend))
