"""Attention of one query block against one key/value block, with its log-sum-exp, and its
backward: the pieces ring attention is made of.

Ring attention computes a sequence's attention block by block (the queries of this rank's block
against each key/value block as it passes), so each block's output has to be merged by its
log-sum-exp (an online softmax), and the backward recomputes each block's probabilities from
the *final* log-sum-exp:

    p = exp(q·kᵀ·scale − lse),   dv += pᵀ·do,   ds = p ⊙ (do·vᵀ − δ),   dq += ds·k·scale,   dk += dsᵀ·q·scale

with δ = Σ_d do ⊙ o per query and head. Masks come from token positions (causal: a key
attends to a query at or after it), so blocks of any arrangement (contiguous or zigzag) work.
Exact math in the inputs' precision (fp32 for fp16/bf16), queries taken in tiles so that the
score matrix stays tile × block: the reference every fused kernel of
:mod:`knapformer.attention.lse` is checked against, and the fallback where none applies.

Shapes: q (A, h, D), k (B, h_kv, D), v (B, h_kv, Dv), o (A, h, Dv), lse (h, A); positions
(A,) and (B,) int64.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_backward", "block_forward", "compute_dtype", "merge"]

TILE = 1024
"""Query rows per score matrix."""


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype block math runs and accumulates in: fp32 for fp16/bf16, else the input's."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _expand(t: torch.Tensor, h: int) -> torch.Tensor:
    """kv heads repeated for their query heads (GQA/MQA)."""
    rep = h // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _scores(q, k, q_pos, k_pos, causal: bool, scale: float) -> torch.Tensor:
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[None], float("-inf"))
    return s


def _tiles(n: int):
    return [slice(i, min(i + TILE, n)) for i in range(0, n, TILE)] or [slice(0, 0)]


def block_forward(q, k, v, q_pos, k_pos, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of q's block against one k/v block; a query that sees no key gets o = 0 and
    lse = −inf (it contributes nothing when merged)."""
    dt = compute_dtype(q)
    h, scale = q.shape[1], 1.0 / math.sqrt(q.shape[2])
    kk, vv = _expand(k, h).to(dt), _expand(v, h).to(dt)
    outs, lses = [], []
    for t in _tiles(q.shape[0]):
        s = _scores(q[t].to(dt), kk, q_pos[t], k_pos, causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # (h, T)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see nothing: 0
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def merge(o_acc, lse_acc, o, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial results of the same queries."""
    new = torch.logaddexp(lse_acc, lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    wa = torch.exp(lse_acc - safe).nan_to_num(0.0).transpose(0, 1)[..., None]
    wb = torch.exp(lse - safe).nan_to_num(0.0).transpose(0, 1)[..., None]
    return o_acc * wa + o * wb, new


def block_backward(q, k, v, do, lse, delta, q_pos, k_pos, *, causal: bool, keep_precision: bool = False):
    """(dq, dk, dv) of one (query block, key/value block) pair given the queries' final
    ``lse`` (h, A) and ``delta`` (h, A) = Σ do ⊙ o; dk/dv have k/v's (kv) heads. With
    ``keep_precision`` they stay in the compute dtype (fp32 for fp16/bf16 inputs), for
    accumulating over blocks."""
    dt = compute_dtype(q)
    h, scale = q.shape[1], 1.0 / math.sqrt(q.shape[2])
    kk, vv = _expand(k, h).to(dt), _expand(v, h).to(dt)
    dq = torch.empty(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(kk.shape, dtype=dt, device=q.device)
    dv = torch.zeros(vv.shape, dtype=dt, device=q.device)
    for t in _tiles(q.shape[0]):
        qt, dot = q[t].to(dt), do[t].to(dt)
        s = _scores(qt, kk, q_pos[t], k_pos, causal, scale)
        p = torch.exp(s - lse[:, t, None]).nan_to_num(0.0)
        dv += torch.einsum("hqk,qhd->khd", p, dot)
        ds = p * (torch.einsum("qhd,khd->hqk", dot, vv) - delta[:, t, None])
        dq[t] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk += torch.einsum("hqk,qhd->khd", ds, qt) * scale
    rep = h // k.shape[1]
    if rep > 1:  # a kv head served several query heads: their gradients add up
        dk = dk.unflatten(1, (k.shape[1], rep)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], rep)).sum(2)
    if keep_precision:
        return dq, dk, dv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
