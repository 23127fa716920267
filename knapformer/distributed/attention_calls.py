"""The attention calls of a balancer (a mixin of :class:`~knapformer.distributed.SequenceBalancer`):
``attention``, ``pre_attn``/``post_attn`` for custom kernels, and ``cross_attention``.

Every call is checked (:mod:`.checks`): this rank's local problem, or q/k/v shapes and dtypes
that differ between ranks, raise on every rank — at the call itself where it agrees (the step's
first per-layer call, every call of a step kind's first step, every call under ``debug``),
else at the step's next agreement, after this rank has run the call every rank scheduled on
zeros so that no exchange is left waiting. A head count the plan's groups cannot split is an
:class:`~knapformer.errors.InvalidPlanError` naming the group, and so is a ring plan run on
the other attention path than ``attn_path`` names (``attention``: ring rounds; ``pre_attn``:
the K/V all-gather of :mod:`.kv_gather`). Under ``torch.autocast`` q, k, v are cast to the
autocast dtype first (what SDPA does); under ``torch.compile`` ``attention`` and
``cross_attention`` are one opaque operator each (:mod:`.compiled`).
"""

from __future__ import annotations

import torch

import knapformer.distributed.cross as cross
import knapformer.distributed.kv_gather as kv_gather
import knapformer.distributed.ring as ring
import knapformer.distributed.trace as trace
import knapformer.distributed.ulysses as ulysses
from knapformer.attention.varlen import varlen_attention
from knapformer.distributed.checks import LayerCall, attention_problem
from knapformer.distributed.compiled import eager_only
from knapformer.errors import InvalidPlanError
from knapformer.executor.opaque import attend
from knapformer.executor.protocol import RoutedContext, VarlenArgs, context_tensors
from knapformer.plan.memory import gathered_memory

__all__ = ["AttentionCalls", "autocast_inputs"]


def _tensors(*ts) -> list[torch.Tensor]:
    return [t for t in ts if isinstance(t, torch.Tensor)]


def _tie(out: torch.Tensor, *ts) -> torch.Tensor:
    """``out`` joined to the autograd graphs of ``ts`` (added zero): a rank that runs a call
    on zeros still runs the backward exchanges the other ranks run through theirs."""
    for t in ts:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            out = out + 0 * t.sum().to(out.dtype)
    return out


class AttentionCalls:
    """Attention methods; the balancer provides ``_require_spec``, ``_checks``, ``group``,
    ``group_rank``, ``config``, ``_opaque``, ``_call``, ``_data_device`` and ``_kv_gather``
    (plans price the K/V all-gather of ``pre_attn``)."""

    def _pre(self, q, k, v, op: str, causal: bool) -> ulysses.UlyssesCall | None:
        """Check a layer's q, k, v and run the pre-attention exchange; None when this rank ran
        the scheduled call on zeros instead (its error is deferred)."""
        _, spec = self._require_spec()
        q, k, v = autocast_inputs(q, k, v)
        error = attention_problem(q, k, v, spec.num_routed, self.group_rank)
        call = LayerCall(op, causal=causal) if error else LayerCall.of(op, (q, k, v), causal)
        played = self._checks.layer(call, error)
        if played is not None:
            self._played = self._play(played, (q, k, v))
            return None
        return self._pre_run(q, k, v, op, causal)

    def _pre_run(self, q, k, v, op: str, causal: bool) -> ulysses.UlyssesCall:
        plan, spec = self._require_spec()
        self._data_device = q.device
        self._loop.note_bytes(q.element_size())  # the agreed dtype: the next plans price it
        # the shapes agree (or follow the schedule): a plan whose groups cannot split them
        # fails the same way on every rank
        heads = ulysses.check_heads(q.shape[1], k.shape[1], spec)
        if heads:
            raise InvalidPlanError(f"SequenceBalancer.{op}: the plan cannot run these heads: {heads}")
        if spec.ring_rounds > 1:  # the plan and the settings are the same on every rank: so is this
            self._check_ring_path(op, plan, q.shape[1], k.shape[1], causal)
        if op == "pre_attn" and self.config.attn_path == "auto":
            self._kv_gather = True  # the plans from now on price the all-gather (every rank is here)
        return ulysses.pre_attn_batches(q, k, v, spec, self.group)

    def _play(self, entry: LayerCall, like=()) -> torch.Tensor | VarlenArgs | None:
        """Run scheduled call ``entry`` on zeros: this rank makes the exchanges every other rank
        makes now (its own call was different, or bad; the step raises at its next agreement).
        ``like``: this rank's own tensors, whose autograd graphs the zeros join."""
        _, spec = self._require_spec()
        device = next((t.device for t in _tensors(*like)), self._data_device)
        if entry.op == "post_attn":
            call, self._call = self._call, None
            if call is None:  # no pre_attn to invert: there is no exchange to join
                return None
            o = _tie(torch.zeros(ulysses.output_shape(call), dtype=call.dtype, device=device), *like)
            return self._post_run(call, ulysses.unflatten_pairs(kv_gather.join_backward(o, call.kv_token), call))
        q, k, v = (
            _tie(torch.zeros((spec.num_routed, *shape), dtype=dtype, device=device), *like)
            for dtype, shape in entry.tensors
        )
        if entry.op == "attention":
            return self._attention_run(self._pre_run(q, k, v, "attention", entry.causal), entry.causal)
        call = self._pre_run(q, k, v, "pre_attn", entry.causal)
        if spec.ring_rounds > 1:
            call = kv_gather.gather_kv(call, spec, self.group, entry.causal)
        self._call = call
        return ulysses.flatten_pairs(call)

    def _check_ring_path(self, op: str, plan, h: int, h_kv: int, causal: bool) -> None:
        """A ring plan runs on the attention path it was made for (``attn_path``); the
        all-gather's keys and values fit the memory cap."""
        path = self.config.attn_path
        want = "pre_attn" if op == "pre_attn" else "attention"
        if path != "auto" and path != want:
            how = "its K/V all-gather" if want == "pre_attn" else "ring rounds"
            raise InvalidPlanError(
                f"SequenceBalancer.{op}: this plan has ring groups and was made for attn_path={path!r}, but "
                f"{op} runs them through {how}, which the plan did not price"
                + (" or count against max_tokens_per_rank" if want == "pre_attn" else "")
                + f": set BalancerConfig(attn_path={want!r}) (or 'auto') for a model that calls {op}"
            )
        cap = plan.max_tokens_per_rank
        if want == "pre_attn" and cap is not None:
            held = gathered_memory(plan, h, h_kv, causal)
            worst = int(held.argmax())
            if held[worst] > cap:
                raise InvalidPlanError(
                    f"SequenceBalancer.pre_attn: with its gathered keys and values rank {worst} holds "
                    f"{int(held[worst])} token-equivalents > max_tokens_per_rank={cap} under this plan "
                    f"(made for attn_path={'pre_attn' if plan.kv_gather else 'attention'!r}); plans made "
                    "with attn_path='pre_attn' count them (under 'auto' from the step after the first pre_attn)"
                )

    def _post_run(self, call: ulysses.UlyssesCall, outs: list) -> torch.Tensor:
        _, spec = self._require_spec()
        return ulysses.post_attn_batches(call, outs, spec, self.group)

    @eager_only
    def pre_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | None = None) -> VarlenArgs:
        """Routed q (R, h, D), k/v (R, h_kv, ·) -> the arguments of one custom varlen kernel call
        (:class:`~knapformer.executor.VarlenArgs`, flash-attn's order: q, k, v, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k); :meth:`post_attn` takes the kernel's
        output. Pass the ``causal`` your kernel uses: under a ring plan it shapes the key
        segments (causal: bottom-right-aligned masks over key prefixes); None (the default)
        takes the cost model's ``causal`` flag. A rank whose
        sequences all have one degree k (every bag layout) gets (A, h/k, ·) with its head
        slice; a rank mixing head slices gets (segment, query head) pairs of one head each.
        Every plan runs here: ring groups gather their keys and values over the ring
        (:mod:`knapformer.distributed.kv_gather`)."""
        _, spec = self._require_spec()
        causal = bool(self.config.cost.causal) if causal is None else bool(causal)
        call = self._pre(q, k, v, "pre_attn", causal)
        if call is None:  # ran the scheduled call on zeros: the kernel gets zeros of the same form
            self._call = self._call if isinstance(self._played, VarlenArgs) else None
            self._expected = _expected_output(q, v, spec.num_routed)
            if isinstance(self._played, VarlenArgs):
                return self._played
            z = torch.zeros(self._expected, dtype=self._expected_dtype(q), device=self._data_device)
            cu = torch.tensor([0, z.shape[0]], dtype=torch.int32, device=z.device)
            return VarlenArgs(z, z, z, cu, cu, z.shape[0], z.shape[0])
        if spec.ring_rounds > 1:  # every rank joins the gather, with ring batches or not
            call = kv_gather.gather_kv(call, spec, self.group, causal)
        self._call, self._expected = call, None
        return ulysses.flatten_pairs(call)

    @eager_only
    def post_attn(self, o: torch.Tensor) -> torch.Tensor:
        """Output of the kernel run on :meth:`pre_attn`'s tensors -> (R, h, Dv) in routed order.
        A wrong shape or dtype on any rank raises on every rank (at this call where it agrees,
        else at the step's next agreement)."""
        call, mine = self._call, self._expected  # mine: the shape this rank's caller expects (its pre_attn was played)
        if call is None and mine is None:
            raise RuntimeError("SequenceBalancer.post_attn: call pre_attn first (post_attn inverts it)")
        error = ""
        if call is not None:
            expected, dtype = ulysses.output_shape(call), call.dtype
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != expected or o.dtype != dtype:
                got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o).__name__
                error = (
                    f"post_attn got {got} on rank {self.group_rank}, expected {expected} of {dtype} "
                    "(pre_attn's query rows and heads)"
                )
        else:
            error = "its pre_attn ran another call (see the first error)"
        entry = self._checks.layer(LayerCall("post_attn"), error)
        if entry is None:
            self._call = self._expected = None
            out = self._post_run(call, ulysses.unflatten_pairs(kv_gather.join_backward(o, call.kv_token), call))
            if mine is None:
                return out
            return _tie(torch.zeros(mine, dtype=out.dtype, device=out.device), out)
        played = self._play(entry, _tensors(o))
        self._call = self._expected = None
        _, spec = self._require_spec()
        shape = mine or (spec.num_routed, call.heads[0], call.heads[3])
        dtype = o.dtype if isinstance(o, torch.Tensor) and o.is_floating_point() else torch.float32
        return _tie(torch.zeros(shape, dtype=dtype, device=self._data_device), o, played)

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
        _, spec = self._require_spec()
        causal = bool(causal)
        call = self._pre(q, k, v, "attention", causal)
        if call is not None:
            return self._attention_run(call, causal)
        # this rank ran the scheduled call on zeros; its caller gets zeros of its own call's shape
        shape = _expected_output(q, v, spec.num_routed)
        out = torch.zeros(shape, dtype=self._expected_dtype(q), device=self._data_device)
        return _tie(out, q, k, v, self._played if isinstance(self._played, torch.Tensor) else None)

    def _attention_run(self, call: ulysses.UlyssesCall, causal: bool) -> torch.Tensor:
        _, spec = self._require_spec()
        backend = self.config.attn_backend
        with trace.span(trace.ATTENTION):
            outs = [
                None
                if b.ring is not None
                else varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len, causal=causal, backend=backend)
                for b in call.batches
            ]
        if spec.ring_rounds > 1:  # every rank joins the ring rounds, with ring batches or not
            outs, call.anchor = ring.ring_attention(
                call.batches, outs, call.anchor, spec.ring_rounds, spec.num_ranks, self.group, causal, backend
            )
        return self._post_run(call, outs)

    def _expected_dtype(self, q) -> torch.dtype:
        return q.dtype if isinstance(q, torch.Tensor) and q.is_floating_point() else torch.float32

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


def _expected_output(q, v, rows: int) -> tuple[int, int, int]:
    """The output shape a caller of ``attention(q, k, v)`` expects (``rows`` routed tokens when
    q or v are not 3-D tensors)."""
    if all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, v)):
        return (q.shape[0], q.shape[1], v.shape[2])
    return (rows, 1, 1)


def autocast_inputs(q, k, v):
    """Under ``torch.autocast`` for the tensors' device: q, k, v in the autocast dtype (what SDPA
    does with its inputs), so mixed dtypes become one."""
    if not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return q, k, v
    dtype = torch.get_autocast_dtype(q.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
