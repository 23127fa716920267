"""The attention calls of a balancer (a mixin of :class:`~knapformer.distributed.SequenceBalancer`):
``attention``, ``pre_attn``/``post_attn`` for custom kernels, and ``cross_attention``.

Every call agrees first (:mod:`.checks`): this rank's local problem, or q/k/v shapes and dtypes
that differ between ranks, raise on every rank before the exchange; a head count the plan's
groups cannot split is an :class:`~knapformer.errors.InvalidPlanError` naming the group. Under
``torch.autocast`` q, k, v are cast to the autocast dtype first (what SDPA does); under
``torch.compile`` ``attention`` and ``cross_attention`` are one opaque operator each
(:mod:`.compiled`).
"""

from __future__ import annotations

import torch

import knapformer.distributed.cross as cross
import knapformer.distributed.ring as ring
import knapformer.distributed.trace as trace
import knapformer.distributed.ulysses as ulysses
from knapformer.attention.varlen import varlen_attention
from knapformer.distributed.agree import describe
from knapformer.distributed.checks import attention_problem
from knapformer.errors import InvalidPlanError
from knapformer.executor.opaque import attend
from knapformer.executor.protocol import RoutedContext, context_tensors

__all__ = ["AttentionCalls", "autocast_inputs"]


class AttentionCalls:
    """Attention methods; the balancer provides ``_require_spec``, ``_checks``, ``group``,
    ``group_rank``, ``config``, ``_opaque`` and ``_call``."""

    def _pre(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str = "pre_attn") -> ulysses.UlyssesCall:
        _, spec = self._require_spec()
        q, k, v = autocast_inputs(q, k, v)
        error = attention_problem(q, k, v, spec.num_routed, self.group_rank)
        values = () if error else tuple((n, describe(t)) for n, t in zip("qkv", (q, k, v)))
        self._checks.agree(op, error, values)
        # the shapes agree: a plan whose groups cannot split them fails the same way on every rank
        heads = ulysses.check_heads(q.shape[1], k.shape[1], spec)
        if heads:
            raise InvalidPlanError(f"SequenceBalancer.{op}: the plan cannot run these heads: {heads}")
        return ulysses.pre_attn_batches(q, k, v, spec, self.group)

    def _post(self, call: ulysses.UlyssesCall, outs: list, error: str = "") -> torch.Tensor:
        _, spec = self._require_spec()
        for b, o in zip(call.batches, outs) if not error else ():
            expected = (b.q.shape[0], b.q.shape[1], b.v.shape[2])
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != expected or o.dtype != b.v.dtype:
                got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o).__name__
                error = f"post_attn got {got} on rank {self.group_rank}, expected {expected} of {b.v.dtype}"
                break
        self._checks.agree("post_attn", error)
        return ulysses.post_attn_batches(call, outs, spec, self.group)

    @torch.compiler.disable
    def pre_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Routed q (R, h, D), k/v (R, h_kv, ·) -> ``(q2, k2, v2, cu_seqlens, max_len)`` for one
        custom varlen kernel call; :meth:`post_attn` takes its output. A rank whose sequences
        all have one degree k (every bag layout) gets (A, h/k, ·) with its head slice; a rank
        mixing degrees gets (sequence, query head) pairs of one head each."""
        _, spec = self._require_spec()
        if spec.ring_rounds > 1:  # the plan is the same on every rank: so is this error
            rings = [g for g, r in zip(spec.used_groups, spec.used_rings) if r > 1]
            raise InvalidPlanError(
                f"SequenceBalancer.pre_attn: this plan runs ring attention (groups {rings}), which a single "
                "varlen kernel call cannot (rounds of blocks merged by their log-sum-exp); use bal.attention "
                "(your own kernel can run the blocks as a block kernel: knapformer.attention.lse) or a plan "
                "without rings (layout 'auto:noring')"
            )
        call = self._pre(q, k, v)
        self._call = call
        return ulysses.flatten_pairs(call)

    @torch.compiler.disable
    def post_attn(self, o: torch.Tensor) -> torch.Tensor:
        """Output of the kernel run on :meth:`pre_attn`'s tensors -> (R, h, Dv) in routed order.
        A wrong shape or dtype on any rank raises on every rank (before the exchange)."""
        call = self._call
        if call is None:
            raise RuntimeError("SequenceBalancer.post_attn: call pre_attn first (post_attn inverts it)")
        self._call = None
        if len(call.batches) == 1:
            return self._post(call, [o])
        n, dv = sum(b.q.shape[0] * b.q.shape[1] for b in call.batches), call.heads[3]
        if isinstance(o, torch.Tensor) and tuple(o.shape) == (n, 1, dv):
            return self._post(call, ulysses.unflatten_pairs(o, call))
        got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
        error = f"post_attn got {got} on rank {self.group_rank}, expected {(n, 1, dv)} (pre_attn's head pairs)"
        return self._post(call, [], error)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Attention of routed tokens within their own sequences: q (R, h, D), k/v (R, h_kv, ·)
        -> (R, h, Dv); one varlen call per parallel degree on this rank. Under
        ``torch.autocast`` q, k, v are cast to the autocast dtype first, as SDPA does. Under
        ``torch.compile`` it is one opaque operator (``knapformer::attend``): a block that
        calls it compiles with ``fullgraph=True, dynamic=True`` and is not recompiled for a
        step of other lengths."""
        if torch.compiler.is_compiling():
            q, k, v = autocast_inputs(q, k, v)
            return attend("balanced", q, k, v, owner=self._opaque, causal=causal, backend=self.config.attn_backend)
        return self._attention_eager(q, k, v, causal)

    def _attention_eager(self, q, k, v, causal: bool) -> torch.Tensor:
        call = self._pre(q, k, v, "attention")
        backend = self.config.attn_backend
        with trace.span(trace.ATTENTION):
            outs = [
                None
                if b.ring is not None
                else varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len, causal=causal, backend=backend)
                for b in call.batches
            ]
        _, spec = self._require_spec()
        if spec.ring_rounds > 1:  # every rank joins the ring rounds, with ring batches or not
            outs, call.anchor = ring.ring_attention(
                call.batches, outs, call.anchor, spec.ring_rounds, spec.num_ranks, self.group, causal, backend
            )
        return self._post(call, outs)

    def cross_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: RoutedContext
    ) -> torch.Tensor:
        """Cross-attention of routed queries q (R, h, D) over their own sequence's context:
        k (M, h_kv, D), v (M, h_kv, Dv) projected from ``context.rows`` -> (R, h, Dv). Local:
        each rank computes all heads for the queries it holds (no exchange). A bad shape on
        one rank is raised on every rank at the next agreement (zeros meanwhile)."""
        q, k, v = autocast_inputs(q, k, v)
        if torch.compiler.is_compiling():
            return attend("balanced_cross", q, k, v, context_tensors(context), owner=self._opaque)
        return cross.cross_attention(self, q, k, v, context)


def autocast_inputs(q, k, v):
    """Under ``torch.autocast`` for the tensors' device: q, k, v in the autocast dtype (what SDPA
    does with its inputs), so mixed dtypes become one."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
