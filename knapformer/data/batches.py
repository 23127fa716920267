"""Synthetic training batches for the reference models, from data codes.

Deterministic per (seed, rank, step): every rank can rebuild any rank's batch, which is what
the equivalence tests and the simulator's with/without comparison rely on. Needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.data.codes import resolve_mix, sample_batches

__all__ = ["Batch", "make_batch", "batch_from_lens"]


@dataclass
class Batch:
    """One rank's packed samples: text tokens first in each sequence, then visual tokens."""

    seq_lens: list[int]
    txt_lens: torch.Tensor  # (S,) int64
    x: torch.Tensor  # (T, in_dim)
    t: torch.Tensor  # (S,) timesteps in [0, 1]
    vec: torch.Tensor  # (S, vec_dim) pooled conditioning
    target: torch.Tensor  # (T, out_dim)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))


def _generator(seed: int, rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + rank * 10_007 + step) % (2**63 - 1))


def batch_from_lens(
    seq_lens: list[int],
    txt_lens: list[int],
    *,
    seed: int,
    rank: int,
    step: int,
    in_dim: int,
    vec_dim: int,
    out_dim: int,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """Random features for given lengths (text lengths must not exceed sequence lengths)."""
    if len(seq_lens) != len(txt_lens) or any(t < 0 or t > n for n, t in zip(seq_lens, txt_lens)):
        raise ValueError(f"text lengths {txt_lens} do not fit sequence lengths {seq_lens}")
    g = _generator(seed, rank, step)
    T, S = int(sum(seq_lens)), len(seq_lens)
    return Batch(
        seq_lens=[int(n) for n in seq_lens],
        txt_lens=torch.tensor(txt_lens, dtype=torch.int64),
        x=torch.randn(T, in_dim, generator=g).to(dtype),
        t=torch.rand(S, generator=g).to(dtype),
        vec=torch.randn(S, vec_dim, generator=g).to(dtype),
        target=torch.randn(T, out_dim, generator=g).to(dtype),
    )


def make_batch(
    mix: str,
    *,
    rank: int,
    num_ranks: int,
    step: int,
    seed: int = 0,
    scale: int = 1,
    in_dim: int,
    vec_dim: int = 1,
    out_dim: int,
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """Rank ``rank``'s batch of a named mix or data codes (``scale`` divides resolution)."""
    samples = sample_batches(resolve_mix(mix), seed=seed, step=step, scale=scale, num_ranks=num_ranks)[rank]
    return batch_from_lens(
        [v + t for v, t in samples],
        [t for _, t in samples],
        seed=seed,
        rank=rank,
        step=step,
        in_dim=in_dim,
        vec_dim=vec_dim,
        out_dim=out_dim,
        dtype=dtype,
    )
