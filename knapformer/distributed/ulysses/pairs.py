"""The custom-kernel form of a Ulysses call: every attention batch as one varlen call over
(sequence, query head) pairs of one head each.

``SequenceBalancer.pre_attn`` hands a rank whose sequences all have one degree its batch as
it is; a rank mixing degrees (different head slices per batch) gets one flat call in which
every (sequence, query head) pair is its own "sequence" of one head (kv heads copied per query
head), so any varlen kernel runs it once. :func:`unflatten_pairs` undoes it for the output.
"""

from __future__ import annotations

import torch

from knapformer.distributed.ulysses.exchange import AttnBatch, UlyssesCall

__all__ = ["flatten_pairs", "unflatten_pairs"]


def _pair_index(batch: AttnBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows of ``q.view(A * hq, D)`` and ``k.view(A * hkv, D)`` in (sequence, query head, token)
    order, and the pair lengths."""
    A, hq = batch.q.shape[0], batch.q.shape[1]
    hkv = batch.k.shape[1]
    ratio = hq // hkv
    cu = batch.cu_seqlens.tolist()
    device = batch.q.device
    q_rows, k_rows, lens = [], [], []
    for c0, c1 in zip(cu[:-1], cu[1:]):
        t = torch.arange(c0, c1, device=device)
        for j in range(hq):
            q_rows.append(t * hq + j)
            k_rows.append(t * hkv + j // ratio)
            lens.append(c1 - c0)
    if not q_rows:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, []
    del A
    return torch.cat(q_rows), torch.cat(k_rows), lens


def flatten_pairs(call: UlyssesCall):
    """All batches as one varlen call over (sequence, query head) pairs of one head each (kv
    heads copied per query head): ``(q, k, v, cu_seqlens, max_len)`` for a custom kernel. A rank
    with one batch gets that batch as it is."""
    if len(call.batches) == 1:
        b = call.batches[0]
        return b.q, b.k, b.v, b.cu_seqlens, b.max_len
    if not call.batches:  # a rank with no sequences this step: empty, but in the graph
        h, h_kv, d, dv = call.heads
        z = call.anchor
        cu = torch.zeros(1, dtype=torch.int32, device=z.device)
        return z.view(0, 1, d), z.view(0, 1, d), z.view(0, 1, dv), cu, 0
    qs, ks, vs, lens = [], [], [], []
    for b in call.batches:
        qi, ki, li = _pair_index(b)
        qs.append(b.q.reshape(-1, b.q.shape[2]).index_select(0, qi))
        ks.append(b.k.reshape(-1, b.k.shape[2]).index_select(0, ki))
        vs.append(b.v.reshape(-1, b.v.shape[2]).index_select(0, ki))
        lens += li
    device = call.batches[0].q.device
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return (torch.cat(qs)[:, None], torch.cat(ks)[:, None], torch.cat(vs)[:, None], cu, max(lens, default=0))


def unflatten_pairs(o: torch.Tensor, call: UlyssesCall) -> list[torch.Tensor]:
    """Inverse of :func:`flatten_pairs` for the attention output (N, 1, Dv) -> per batch."""
    if len(call.batches) == 1:
        return [o]
    outs, start = [], 0  # (no batches: nothing to return)
    dv = o.shape[2]
    for b in call.batches:
        qi, _, _ = _pair_index(b)
        n = qi.numel()
        part = o[start : start + n, 0]
        full = part.new_empty((b.q.shape[0] * b.q.shape[1], dv))
        full = full.index_copy(0, qi, part)
        outs.append(full.view(b.q.shape[0], b.q.shape[1], dv))
        start += n
    return outs
