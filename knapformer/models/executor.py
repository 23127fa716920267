"""The handle a model calls for token movement and attention.

``SequenceBalancer`` (``knapformer.distributed``) implements it over torch.distributed; the
:class:`LocalExecutor` here implements it for one process with no balancing, so the same
model code runs both ways and the models never import torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from knapformer.attention import varlen_attention

__all__ = ["TokenExecutor", "LocalExecutor", "local_positions"]


class TokenExecutor(Protocol):
    def route(self, x: torch.Tensor, *features: torch.Tensor, seq_lens: Sequence[int] | None = None): ...
    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor): ...
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor: ...
    def routed_positions(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def gather_sequences(self, *per_seq: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def local_positions(seq_lens: Sequence[int], device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq id, position) of each token of sequences packed in order."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    seq_id = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - starts[seq_id]
    return seq_id.to(device), pos.to(device)


class LocalExecutor:
    """No balancing: tokens stay in place; attention runs over this process's sequences."""

    def __init__(self, seq_lens: Sequence[int], attn_backend: str = "auto") -> None:
        self.seq_lens = [int(v) for v in seq_lens]
        self.attn_backend = attn_backend
        self._cu = torch.tensor(
            [0, *torch.tensor(self.seq_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32
        )

    def route(self, x, *features, seq_lens=None):
        if seq_lens is not None and [int(n) for n in seq_lens] != self.seq_lens:
            raise ValueError(f"tensors laid out as sequences {list(seq_lens)}, this executor has {self.seq_lens}")
        return x if not features else (x, *features)

    def reverse_route(self, y, *features):
        return y if not features else (y, *features)

    def attention(self, q, k, v, causal: bool = False):
        return varlen_attention(
            q, k, v, self._cu.to(q.device), max(self.seq_lens, default=0), causal=causal, backend=self.attn_backend
        )

    def routed_positions(self, device=None):
        return local_positions(self.seq_lens, device)

    def gather_sequences(self, *per_seq):
        return tuple(per_seq)
