"""Ring attention across the sub-groups of ring groups: K/V blocks pass around the ring, outputs
merge by log-sum-exp, dK/dV travel back; exact forward and backward.

A group of k = u·r ranks runs a sequence as r sub-groups of u consecutive members. Ulysses
inside a sub-group (:mod:`.ulysses`) gives each member its h/u heads of the sub-group's block
of the sequence (L/r tokens); member t of sub-group s then attends its block's queries to
every sub-group's block of K/V, which arrive from the members t of the other sub-groups (its
*ring peers*), and merges the partial outputs by their log-sum-exp (an online softmax,
:mod:`knapformer.attention.blockwise`). Per-rank attention memory stays O(L/k) tokens: its own
block, the block being computed, the next one in flight and the send buffer — a few blocks of
L/r tokens × h/u heads, never the whole sequence.

Rounds. Round 0 is the own block. In round j (1 ≤ j < r) member s sends its own K/V block to
ring peer s + j and receives the block of peer s − j (mod r), straight from its owner, so no
round waits on another's arrival. Rounds run up to the plan's largest ring
(``RouteSpec.ring_rounds``, the same order on every rank): all of a round's blocks, of every
ring group a rank is in, move in one exchange with that round's ring peers (point-to-point,
:mod:`.exchange`; counts in elements; a rank with no peer in a round exchanges nothing), and
the next round's exchange is issued before the current round's blocks are computed, so the
exchange overlaps the block attention it feeds.

Backward: the same K/V rounds again (nothing of the other blocks is kept), each round's
block gradients dK/dV computed against the queries' final log-sum-exp and sent straight back
to the block's owner (in the compute dtype: fp32 for fp16/bf16, accumulated there; on CPU's
fused kernel path each block's gradients are first rounded to the input dtype), one exchange
per round issued as soon as that round's blocks are done and awaited a round later.

Causal: masks follow from each block's position runs (``GroupEntry.runs``): a query run
sees an earlier key run whole, its own run causally and a later one not at all (pairs seen by
nothing are not computed, and a block no query of a peer sees is not sent). The plan cuts ring
sequences in zigzag order (sub-group s holds half-blocks s and 2r − 1 − s,
:func:`knapformer.plan.seqindex.zigzag_slots`), so every sub-group computes the same causal
work: r half×half pairs unmasked plus its two diagonal halves. Every block is then sent whole
each round (a peer's later half-block sees it), as without masking.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

import knapformer.distributed.trace as trace
from knapformer.attention.blockwise import block_backward, block_forward, compute_dtype, merge
from knapformer.attention.lse import LseKernel, block_kernel
from knapformer.distributed.exchange import TAGS, Peers, exchange_async
from knapformer.distributed.ulysses.exchange import AttnBatch

__all__ = ["RingSchedule", "pair_work", "ring_attention", "ring_schedule"]


@dataclass(frozen=True)
class _Batch:
    """One ring batch's static part."""

    pos: int
    """This rank's sub-group s."""
    ring: int
    peers: tuple[int, ...]
    """Ring peer (balancing-group rank) of each sub-group."""
    cu: np.ndarray
    """(r, n + 1) row bounds of each sub-group's block of each sequence."""
    runs: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]
    """Per sub-group, per sequence: its block's position runs as (first row in the block,
    first position, length)."""
    sees: np.ndarray
    """(r, r) bool: under causal masking, sub-group j's queries see some key of sub-group i's
    block (``sees[i, j]``; the block is sent from i to j)."""


@dataclass(frozen=True)
class RingSchedule:
    """What every round of one layer call moves (the same on every rank's side of a pair)."""

    rounds: int
    """The plan's largest ring r: rounds 1 … r − 1 exchange."""
    batches: tuple[_Batch, ...]
    sends: tuple[tuple[tuple[int, int], ...], ...]
    """Per round j ≥ 1: (batch, destination) of each block this rank sends, in send order."""
    recvs: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per round j ≥ 1: (batch, source, source sub-group) of each block received, in order."""
    causal: bool


def ring_schedule(batches: list[AttnBatch], rounds: int, causal: bool) -> RingSchedule:
    """The rounds of this rank's ring batches (``batch.ring`` set) under a plan whose largest
    ring has ``rounds`` sub-groups. Blocks to one peer in one round go in batch order, which is
    the global group order on both sides. Depends on the plan only: computed once per plan
    and cached (every layer of a step reuses it)."""
    return _schedule(tuple(b.ring for b in batches), rounds, causal)


@functools.lru_cache(maxsize=64)
def _schedule(entries: tuple, rounds: int, causal: bool) -> RingSchedule:
    static = []
    for e in entries:
        blocks = np.asarray(e.blocks, dtype=np.int64).reshape(e.ring, -1)
        cu = np.concatenate([np.zeros((e.ring, 1), dtype=np.int64), np.cumsum(blocks, axis=1)], axis=1)
        runs = tuple(tuple(_run_rows(seq) for seq in sub) for sub in e.runs)
        static.append(_Batch(pos=e.ring_pos, ring=e.ring, peers=e.ring_peers, cu=cu, runs=runs, sees=_sees(runs)))
    sends, recvs = [], []
    for j in range(1, rounds):
        out, inc = [], []
        for i, b in enumerate(static):
            if j >= b.ring:
                continue
            dst, src = (b.pos + j) % b.ring, (b.pos - j) % b.ring
            if not causal or b.sees[b.pos, dst]:  # a causal query sees no later key
                out.append((i, b.peers[dst]))
            if not causal or b.sees[src, b.pos]:
                inc.append((i, b.peers[src], src))
        sends.append(tuple(sorted(out, key=lambda t: t[1])))  # by destination rank, batch order kept
        recvs.append(tuple(sorted(inc, key=lambda t: t[1])))
    return RingSchedule(rounds, tuple(static), tuple(sends), tuple(recvs), causal)


def pair_work(entry, causal: bool) -> int:
    """Query-key pairs this rank's block attends to over every round of its ring entry (a
    :class:`~knapformer.distributed.spec.GroupEntry` with ``ring`` > 1), for each of its
    heads: the work the ring computes here, from the same pieces the forward runs."""
    b = _schedule((entry,), entry.ring, causal).batches[0]
    total = 0
    for src in range(b.ring):
        for qr, kr, mask in _pairs(b, src, causal):
            nq, nk = qr.stop - qr.start, kr.stop - kr.start
            if mask is True:
                total += nq * (nq + 1) // 2
            elif mask is False:
                total += nq * nk
            else:
                total += int((mask[1][None, :] <= mask[0][:, None]).sum())
    return total


def _run_rows(runs) -> tuple[tuple[int, int, int], ...]:
    """(start, length) runs -> (first row in the block, start, length)."""
    out, row = [], 0
    for start, n in runs:
        out.append((row, int(start), int(n)))
        row += int(n)
    return tuple(out)


def _sees(runs) -> np.ndarray:
    """(r, r): some query of sub-group j attends (causally) to some key of sub-group i, in
    some sequence — its first key position is before its last query position."""
    r = len(runs)
    out = np.zeros((r, r), dtype=bool)
    for i in range(r):
        for j in range(r):
            out[i, j] = any(ki and qj and ki[0][1] < qj[-1][1] + qj[-1][2] for ki, qj in zip(runs[i], runs[j]))
    return out


def _rows(b: _Batch, sub: int) -> int:
    return int(b.cu[sub, -1])


class _Exchange:
    """One round's exchange with this rank's ring peers of that round, issued asynchronously;
    :meth:`wait` gives the received blocks."""

    def __init__(
        self,
        sched: RingSchedule,
        j: int,
        blocks: list[torch.Tensor],
        widths: list[int],
        rank: int,
        group,
        dtype: torch.dtype,
        device,
        reverse: bool = False,
        skip: frozenset = frozenset(),
    ):
        sends, recvs = sched.sends[j - 1], sched.recvs[j - 1]
        if skip:  # peers left out of this call: nothing to or from them (their blocks are not computed)
            sends = tuple(x for x in sends if x[1] not in skip)
            recvs = tuple(x for x in recvs if x[1] not in skip)
            blocks = blocks if reverse else [blocks[n] for n, x in enumerate(sched.sends[j - 1]) if x[1] not in skip]
        self.phase = f"ring round {j}" + (" (dK/dV back)" if reverse else "")
        # reverse: gradients go back to the block owners (what was received is sent, and vice versa)
        out_parts = [(i, peer) for i, peer, _ in recvs] if reverse else list(sends)
        in_parts = [(i, peer, sub) for i, peer in sends for sub in [sched.batches[i].pos]] if reverse else list(recvs)
        self.pieces = [(i, sub, _rows(sched.batches[i], sub) * widths[i]) for i, _, sub in in_parts]
        peers = Peers.from_parts(
            [(peer, blocks[n].numel()) for n, (_, peer) in enumerate(out_parts)],
            [(peer, size) for (_, peer, _), (_, _, size) in zip(in_parts, self.pieces)],
            rank,
        )
        tensors = [blocks[n].reshape(-1) for n in range(len(out_parts))]
        send = torch.cat(tensors).to(dtype) if tensors else torch.zeros(0, dtype=dtype, device=device)
        tag = TAGS["ring grads"] if reverse else TAGS["ring"]
        self.recv, self.pending = exchange_async(send, peers, group, self.phase, tag=tag)

    def wait(self) -> list[tuple[int, int, torch.Tensor]]:
        """(batch, source sub-group, flat block) of every received block."""
        self.pending.wait()
        out, off = [], 0
        for i, sub, n in self.pieces:
            out.append((i, sub, self.recv[off : off + n]))
            off += n
        return out


def _kv_flat(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.flatten(1), v.flatten(1)], dim=1)


def _kv_split(flat: torch.Tensor, rows: int, hkv: int, d: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = flat.view(rows, hkv * (d + dv))
    return kv[:, : hkv * d].unflatten(1, (hkv, d)), kv[:, hkv * d :].unflatten(1, (hkv, dv))


def _pairs(b: _Batch, src: int, causal: bool):
    """The (query rows, key rows of sub-group ``src``'s block, mask) pieces to compute, per
    sequence: without masking each sequence's blocks whole (mask None); causal, per pair of
    position runs — ``False`` (an earlier run: unmasked), ``True`` (the same run: causal from
    both starts), or the two runs' positions (general: never met by the plan's cuts); runs
    that see nothing are skipped."""
    for i in range(b.cu.shape[1] - 1):
        q0, q1, k0, k1 = int(b.cu[b.pos, i]), int(b.cu[b.pos, i + 1]), int(b.cu[src, i]), int(b.cu[src, i + 1])
        if q1 <= q0 or k1 <= k0:
            continue
        if not causal:
            yield slice(q0, q1), slice(k0, k1), False
            continue
        for qr, qs, qn in b.runs[b.pos][i]:
            for kr, ks, kn in b.runs[src][i]:
                if ks >= qs + qn:
                    continue
                rows_q, rows_k = slice(q0 + qr, q0 + qr + qn), slice(k0 + kr, k0 + kr + kn)
                if ks + kn <= qs:
                    yield rows_q, rows_k, False
                elif (ks, kn) == (qs, qn):
                    yield rows_q, rows_k, True
                else:
                    yield rows_q, rows_k, (torch.arange(qs, qs + qn), torch.arange(ks, ks + kn))


class _RingAttention(torch.autograd.Function):
    """Ring batches' (q, k, v) -> outputs; ``through`` (one tensor) passes unchanged so that a
    rank without ring batches still runs the backward rounds the others run."""

    @staticmethod
    def forward(ctx, sched: RingSchedule, rank: int, group, skip, kernels, through, *qkv):  # type: ignore[override]
        n = len(sched.batches)
        qs, ks, vs = qkv[:n], qkv[n : 2 * n], qkv[2 * n :]
        dtype, device = through.dtype, through.device  # q's dtype on every rank (agreed)
        widths = [k.shape[1] * (k.shape[2] + v.shape[2]) for k, v in zip(ks, vs)]
        own = [_kv_flat(k, v) for k, v in zip(ks, vs)]

        def exchange(j: int) -> _Exchange:
            return _Exchange(
                sched, j, [own[i] for i, _ in sched.sends[j - 1]], widths, rank, group, dtype, device, skip=skip
            )

        pending = exchange(1) if sched.rounds > 1 else None
        outs, lses = [], []
        with trace.span(f"{trace.RING}.round.0"):
            for i, (b, q, k, v) in enumerate(zip(sched.batches, qs, ks, vs)):
                dt = compute_dtype(q)
                o = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dt, device=device)
                lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dt, device=device)
                _forward_pairs(b, b.pos, q, k, v, o, lse, sched.causal, kernels[i])
                outs.append(o)
                lses.append(lse)
        for j in range(1, sched.rounds):
            with trace.span(f"{trace.RING}.round.{j}"):
                got = pending.wait()
                pending = None
                if j + 1 < sched.rounds:
                    pending = exchange(j + 1)
                for i, sub, flat in got:
                    b, q, v = sched.batches[i], qs[i], vs[i]
                    kk, vv = _kv_split(flat, _rows(b, sub), ks[i].shape[1], ks[i].shape[2], v.shape[2])
                    _forward_pairs(b, sub, q, kk, vv, outs[i], lses[i], sched.causal, kernels[i])
        ctx.sched, ctx.rank, ctx.group, ctx.kernels, ctx.skip = sched, rank, group, kernels, skip
        results = [o.to(dtype) for o in outs]
        # the outputs are saved in the activations' dtype, not the fp32 they were merged in (half
        # the memory under bf16): the backward needs them only for δ = Σ do ⊙ o, which
        # flash-attn's backward also takes from the rounded output; the log-sum-exp stays fp32
        ctx.save_for_backward(*qs, *ks, *vs, *results, *lses)
        return (*results, through.view_as(through))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        sched, rank, group, kernels, skip = ctx.sched, ctx.rank, ctx.group, ctx.kernels, ctx.skip
        n = len(sched.batches)
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n : (i + 1) * n] for i in range(5))
        dos, d_through = grads[:n], grads[n]
        dtype, device = d_through.dtype, d_through.device
        gdtype = compute_dtype(d_through)  # block gradients travel in the compute dtype
        widths = [k.shape[1] * (k.shape[2] + v.shape[2]) for k, v in zip(ks, vs)]
        own = [_kv_flat(k, v) for k, v in zip(ks, vs)]

        def exchange(j: int) -> _Exchange:
            return _Exchange(
                sched, j, [own[i] for i, _ in sched.sends[j - 1]], widths, rank, group, dtype, device, skip=skip
            )

        deltas = [(do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).transpose(0, 1) for do, o, lse in zip(dos, outs, lses)]
        dq = [torch.zeros(q.shape, dtype=compute_dtype(q), device=device) for q in qs]
        dk = [torch.zeros(k.shape, dtype=compute_dtype(q), device=device) for q, k in zip(qs, ks)]
        dv = [torch.zeros(v.shape, dtype=compute_dtype(q), device=device) for q, v in zip(qs, vs)]
        pending = exchange(1) if sched.rounds > 1 else None
        with trace.span(f"{trace.RING}.backward.round.0"):
            for i, b in enumerate(sched.batches):
                _backward_pairs(
                    b,
                    b.pos,
                    qs[i],
                    ks[i],
                    vs[i],
                    dos[i],
                    outs[i],
                    lses[i],
                    deltas[i],
                    dq[i],
                    dk[i],
                    dv[i],
                    sched.causal,
                    kernels[i],
                )
        grads_back: _Exchange | None = None
        for j in range(1, sched.rounds):
            with trace.span(f"{trace.RING}.backward.round.{j}"):
                got = pending.wait()
                pending = None
                if j + 1 < sched.rounds:
                    pending = exchange(j + 1)
                partials = []
                for i, sub, flat in got:
                    b = sched.batches[i]
                    rows = _rows(b, sub)
                    kk, vv = _kv_split(flat, rows, ks[i].shape[1], ks[i].shape[2], vs[i].shape[2])
                    pk = torch.zeros(kk.shape, dtype=gdtype, device=device)
                    pv = torch.zeros(vv.shape, dtype=gdtype, device=device)
                    _backward_pairs(
                        b,
                        sub,
                        qs[i],
                        kk,
                        vv,
                        dos[i],
                        outs[i],
                        lses[i],
                        deltas[i],
                        dq[i],
                        pk,
                        pv,
                        sched.causal,
                        kernels[i],
                    )
                    partials.append(_kv_flat(pk, pv))
                if grads_back is not None:
                    _add_partials(grads_back.wait(), dk, dv, ks, vs)
                grads_back = _Exchange(sched, j, partials, widths, rank, group, gdtype, device, reverse=True, skip=skip)
        if grads_back is not None:
            _add_partials(grads_back.wait(), dk, dv, ks, vs)
        dqs = [g.to(q.dtype) for g, q in zip(dq, qs)]
        dks = [g.to(k.dtype) for g, k in zip(dk, ks)]
        dvs = [g.to(v.dtype) for g, v in zip(dv, vs)]
        return None, None, None, None, None, d_through, *dqs, *dks, *dvs


def _forward_pairs(b: _Batch, src: int, q, k, v, o, lse, causal: bool, kernel: LseKernel) -> None:
    for qr, kr, mask in _pairs(b, src, causal):
        if isinstance(mask, tuple):
            pq, pk = (m.to(q.device) for m in mask)
            ob, lb = block_forward(q[qr], k[kr], v[kr], pq, pk, causal=True)
        else:
            ob, lb = kernel.forward(q[qr], k[kr], v[kr], mask)
        o[qr], lse[:, qr] = merge(o[qr], lse[:, qr], ob, lb)


def _backward_pairs(
    b: _Batch, src: int, q, k, v, do, o, lse, delta, dq, dk, dv, causal: bool, kernel: LseKernel
) -> None:
    for qr, kr, mask in _pairs(b, src, causal):
        if isinstance(mask, tuple):
            pq, pk = (m.to(q.device) for m in mask)
            gq, gk, gv = block_backward(
                q[qr], k[kr], v[kr], do[qr], lse[:, qr], delta[:, qr], pq, pk, causal=True, keep_precision=True
            )
        else:
            gq, gk, gv = kernel.backward(do[qr], q[qr], k[kr], v[kr], o[qr], lse[:, qr], mask)
        dq[qr] += gq
        dk[kr] += gk
        dv[kr] += gv


def _add_partials(got, dk, dv, ks, vs) -> None:
    """Block gradients received from the ring peers that used this rank's K/V: add them up."""
    for i, _, flat in got:
        rows, hkv, d, e = ks[i].shape[0], ks[i].shape[1], ks[i].shape[2], vs[i].shape[2]
        gk, gv = _kv_split(flat, rows, hkv, d, e)
        dk[i] += gk
        dv[i] += gv


def ring_attention(
    batches: list[AttnBatch],
    outs: list,
    anchor: torch.Tensor | None,
    rounds: int,
    rank: int,
    group,
    causal: bool,
    backend: str = "auto",
    skip: frozenset = frozenset(),
) -> tuple[list, torch.Tensor | None]:
    """Complete the ring batches of one layer: ``outs`` (per batch, None for ring batches)
    gets their outputs; a rank in some ring group runs ``rounds`` rounds (the plan's largest
    ring), exchanging in each with its ring peers of that round. Blocks run on the block
    kernel of the attention ``backend`` (:func:`knapformer.attention.lse.block_kernel`).
    Returns the outputs and the anchor to hand to the post exchange (the ring's pass-through,
    so that the backward rounds run wherever the forward ones did)."""
    ring = [i for i, b in enumerate(batches) if b.ring is not None]
    others = [i for i, b in enumerate(batches) if b.ring is None and b.degree > 1]
    sched = ring_schedule([batches[i] for i in ring], rounds, causal)
    through_index = others[0] if others else None
    through = outs[through_index] if through_index is not None else anchor
    qkv = [batches[i].q for i in ring] + [batches[i].k for i in ring] + [batches[i].v for i in ring]
    kernels = [block_kernel(backend, batches[i].q, batches[i].k, batches[i].v) for i in ring]
    res = _RingAttention.apply(sched, rank, group, skip, kernels, through, *qkv)
    outs = list(outs)
    for i, o in zip(ring, res[: len(ring)]):
        outs[i] = o
    if through_index is not None:
        outs[through_index] = res[-1]
        return outs, anchor
    return outs, res[-1]
