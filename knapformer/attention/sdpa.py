"""``sdpa``: one ``scaled_dot_product_attention`` call per sequence.

Exact, runs everywhere, and measured fastest on CPU (a block-diagonal mask wastes work on
masked blocks). Also the cross-attention every backend without its own falls back to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from knapformer.attention.backend import Backend, check_gqa, empty_output
from knapformer.attention.bounds import host_bounds

__all__ = ["BACKEND", "lower_right_mask", "sdpa_cross", "sdpa_per_sequence", "sdpa_qk"]


def sdpa_per_sequence(q, k, v, cu_seqlens, max_len, *, causal):
    """(N, h, D) -> (N, h, Dv): one SDPA per sequence."""
    gqa = check_gqa(q, k, v)
    cu = host_bounds(cu_seqlens)  # the host copy the plan registered: no device read
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    if sum(lens) != q.shape[0]:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but q has {q.shape[0]}")
    # torch.split, not per-sequence slicing: a slice's backward zero-fills a full-size gradient
    # and adds it up once per sequence (O(sequences × tokens) memory traffic); split's backward
    # is one concatenation.
    outs = []
    for qs, ks, vs in zip(*(torch.split(t, lens) for t in (q, k, v))) if lens else ():
        if qs.shape[0] == 0:
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)[0].transpose(0, 1))
    if not outs:
        return empty_output(q, k, v)  # keep the graph connected
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def sdpa_cross(q, k, v, cu_q: list[int], cu_k: list[int]) -> torch.Tensor:
    """Queries of sequence i over keys/values of context i; an empty context gives zeros
    (attention over nothing adds nothing; SDPA would return NaN)."""
    gqa = check_gqa(q, k, v)
    lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
    lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    outs, attended = [], False
    for qs, ks, vs in zip(torch.split(q, lq), torch.split(k, lk), torch.split(v, lk)) if lq else ():
        if qs.shape[0] == 0:
            continue
        if ks.shape[0] == 0:  # nothing to attend to: no contribution
            outs.append(qs.new_zeros((qs.shape[0], qs.shape[1], vs.shape[2])))
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=gqa)[0].transpose(0, 1))
        attended = True
    if not attended:
        # keep q, k and v in the graph: k/v may come from a collective (a routed context) whose
        # backward every rank must join, also one whose queries all have empty contexts
        return empty_output(q, k, v) if not outs else torch.cat(outs) + 0 * (q.sum() + k.sum() + v.sum())
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def lower_right_mask(nq: int, nk: int, device=None) -> torch.Tensor:
    """(nq, nk) bool: query t sees keys 0 … nk − nq + t (the causal mask aligned to the bottom
    right, flash-attn's since 2.1; the top-left one when nq == nk)."""
    return torch.ones(nq, nk, dtype=torch.bool, device=device).tril(diagonal=nk - nq)


def sdpa_qk(q, k, v, cu_q: list[int], cu_k: list[int], *, causal: bool) -> torch.Tensor:
    """Segment i's queries over segment i's keys, one SDPA each; causal: bottom-right aligned
    (:func:`lower_right_mask`'s mask, given to SDPA as a ``causal_lower_right`` bias). A
    segment without queries is skipped; one without keys gives zeros (attention over nothing
    adds nothing)."""
    gqa = check_gqa(q, k, v)
    lq = [e - s for s, e in zip(cu_q[:-1], cu_q[1:])]
    lk = [e - s for s, e in zip(cu_k[:-1], cu_k[1:])]
    outs = []
    for qs, ks, vs in zip(torch.split(q, lq), torch.split(k, lk), torch.split(v, lk)) if lq else ():
        nq, nk = qs.shape[0], ks.shape[0]
        if nq == 0:
            continue
        if nk == 0:
            outs.append(qs.new_zeros((nq, qs.shape[1], vs.shape[2])))
            continue
        # a bottom-right causal bias, not a dense (nq, nk) mask: on a GPU SDPA runs it without
        # materialising one (the memory-efficient kernel takes the alignment)
        mask = causal_lower_right(nq, nk) if causal and nq != nk else None
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa
        )
        outs.append(o[0].transpose(0, 1))
    if not outs:
        return empty_output(q, k, v)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


BACKEND = Backend(name="sdpa", attend=sdpa_per_sequence, cross=sdpa_cross, attend_qk=sdpa_qk, auto_priority=0)
