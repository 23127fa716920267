"""The custom-kernel form of a Ulysses call: every attention batch in one varlen call.

``SequenceBalancer.pre_attn`` hands a rank its batches as one
:class:`~knapformer.executor.VarlenArgs`:

- one batch (every bag layout, or a rank whose sequences all have one degree): as it is;
- several batches with the same head slice widths (a pure ring beside sequences run alone,
  rings of one Ulysses size): their rows concatenated, the bounds shifted;
- batches of different head slices (a rank mixing degrees): every (segment, query head) pair
  becomes its own segment of one head (kv heads copied per query head), so any varlen kernel
  runs it once.

Query and key bounds are separate (a gathered ring batch's keys are not its queries'
sequence, :mod:`knapformer.distributed.kv_gather`); without one they are the same tensor.
:func:`unflatten_pairs` undoes the form for the output, whose rows follow the queries.
"""

from __future__ import annotations

import numpy as np
import torch

from knapformer.attention.bounds import derived, host_bounds, remember, to_device, upload
from knapformer.distributed.spec import concat_ranges
from knapformer.distributed.ulysses.exchange import AttnBatch, UlyssesCall
from knapformer.executor.protocol import VarlenArgs

__all__ = ["flatten_pairs", "output_shape", "unflatten_pairs"]


def _form(call: UlyssesCall) -> str:
    if len(call.batches) <= 1:
        return "one" if call.batches else "empty"
    if len({(b.q.shape[1], b.k.shape[1]) for b in call.batches}) == 1:
        return "rows"
    return "pairs"


def _bounds(b: AttnBatch) -> tuple[np.ndarray, np.ndarray]:
    """The batch's query and key bounds on the host (registered by the plan: no device read)."""
    cu_q = np.asarray(host_bounds(b.cu_seqlens), dtype=np.int64)
    cu_k = cu_q if b.cu_seqlens_k is None else np.asarray(host_bounds(b.cu_seqlens_k), dtype=np.int64)
    return cu_q, cu_k


def _anchors(call: UlyssesCall) -> list[torch.Tensor]:
    """The bounds tensors the call's form derives from (the plan's, alive for its step)."""
    return [t for b in call.batches for t in (b.cu_seqlens, b.cu_seqlens_k) if t is not None]


def _pair_index(b: AttnBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``q.view(A * hq, D)`` and of ``k.view(M * hkv, D)`` in (segment, query head,
    token) order, and each pair's query and key lengths."""
    hq, hkv = b.q.shape[1], b.k.shape[1]
    ratio = hq // hkv
    cu_q, cu_k = _bounds(b)
    nseg = cu_q.size - 1
    heads = np.tile(np.arange(hq, dtype=np.int64), nseg)
    lq, lk = np.repeat(np.diff(cu_q), hq), np.repeat(np.diff(cu_k), hq)
    q_rows = concat_ranges(np.repeat(cu_q[:-1], hq), lq) * hq + np.repeat(heads, lq)
    k_rows = concat_ranges(np.repeat(cu_k[:-1], hq), lk) * hkv + np.repeat(heads // ratio, lk)
    return q_rows, k_rows, lq, lk


def _pairs(call: UlyssesCall):
    """Per batch ``_pair_index`` as index tensors, built once per plan and head configuration
    (every layer reuses them; no upload per call)."""
    if call.pairs is None:
        device = call.batches[0].q.device
        key = ("pairs", str(device), tuple((b.q.shape[1], b.k.shape[1]) for b in call.batches))

        def build():
            out = []
            for b in call.batches:
                q_rows, k_rows, lq, lk = _pair_index(b)
                q_idx, k_idx = (to_device(torch.from_numpy(a), device) for a in (q_rows, k_rows))
                out.append((q_idx, k_idx, lq, lk))
            return out

        call.pairs = derived(_anchors(call), key, build)
    return call.pairs


def _cu(call: UlyssesCall, name: str, lens, device) -> torch.Tensor:
    """Bounds of ``lens`` on ``device``, uploaded once per plan (cached with the call's form)."""
    key = ("cu", name, str(device), tuple((b.q.shape[1], b.k.shape[1]) for b in call.batches))
    return derived(_anchors(call), key, lambda: upload(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), device))


def flatten_pairs(call: UlyssesCall) -> VarlenArgs:
    """All batches as one varlen call (module docstring): a custom kernel's arguments."""
    form = _form(call)
    if form == "empty":
        # a rank with no sequences this step: empty, but in the graph; one empty segment
        # (cu_seqlens [0, 0]), since flash-attn 2 refuses a batch of zero sequences
        h, h_kv, d, dv = call.heads
        z = call.anchor
        cu = remember(torch.zeros(2, dtype=torch.int32, device=z.device), (0, 0))  # no device read later
        return VarlenArgs(z.view(0, 1, d), z.view(0, 1, d), z.view(0, 1, dv), cu, cu, 0, 0)
    if form == "one":
        b = call.batches[0]
        if b.q.shape[0] == 0:  # no tokens here: one empty segment, as above
            cu = remember(torch.zeros(2, dtype=torch.int32, device=b.q.device), (0, 0))
            return VarlenArgs(b.q, b.k, b.v, cu, cu, 0, 0)
        cu_k = b.cu_seqlens if b.cu_seqlens_k is None else b.cu_seqlens_k
        max_k = b.max_len if b.max_len_k is None else b.max_len_k
        return VarlenArgs(b.q, b.k, b.v, b.cu_seqlens, cu_k, b.max_len, max_k)
    device = call.batches[0].q.device
    split = any(b.cu_seqlens_k is not None for b in call.batches)
    if form == "rows":
        lq, lk = [], []
        for b in call.batches:
            cu_q, cu_k = _bounds(b)
            lq += np.diff(cu_q).tolist()
            lk += np.diff(cu_k).tolist()
        qs, ks, vs = ([getattr(b, n) for b in call.batches] for n in "qkv")
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    else:
        qs, ks, vs, lq, lk = [], [], [], [], []
        for b, (qi, ki, li_q, li_k) in zip(call.batches, _pairs(call)):
            qs.append(b.q.reshape(-1, b.q.shape[2]).index_select(0, qi))
            ks.append(b.k.reshape(-1, b.k.shape[2]).index_select(0, ki))
            vs.append(b.v.reshape(-1, b.v.shape[2]).index_select(0, ki))
            lq += li_q.tolist()
            lk += li_k.tolist()
        q, k, v = torch.cat(qs)[:, None], torch.cat(ks)[:, None], torch.cat(vs)[:, None]
    cu_q = _cu(call, "q", lq, device)
    cu_k = _cu(call, "k", lk, device) if split else cu_q
    return VarlenArgs(q, k, v, cu_q, cu_k, max(lq, default=0), max(lk, default=0) if split else max(lq, default=0))


def output_shape(call: UlyssesCall) -> tuple[int, int, int]:
    """The shape the kernel's output on :func:`flatten_pairs`'s arguments has."""
    dv = call.heads[3]
    form = _form(call)
    if form == "empty":
        return (0, 1, dv)
    if form in ("one", "rows"):
        b = call.batches[0]
        return (sum(x.q.shape[0] for x in call.batches), b.q.shape[1], dv)
    return (sum(b.q.shape[0] * b.q.shape[1] for b in call.batches), 1, dv)


def unflatten_pairs(o: torch.Tensor, call: UlyssesCall) -> list[torch.Tensor]:
    """Inverse of :func:`flatten_pairs` for the attention output -> one tensor per batch."""
    form = _form(call)
    if form == "one":
        return [o]
    if form == "empty":
        return []
    if form == "rows":
        return list(torch.split(o, [b.q.shape[0] for b in call.batches]))
    outs, start = [], 0
    dv = o.shape[2]
    for b, (qi, _, _, _) in zip(call.batches, _pairs(call)):
        n = qi.numel()
        part = o[start : start + n, 0]
        full = part.new_empty((b.q.shape[0] * b.q.shape[1], dv)).index_copy(0, qi, part)
        outs.append(full.view(b.q.shape[0], b.q.shape[1], dv))
        start += n
    return outs
