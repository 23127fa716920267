"""The balancer's checks: what each call validates locally, and when it agrees with the other ranks.

The once-per-step calls (``plan``, ``route``, ``gather_sequences``, ``route_context``,
``reverse_route``) each join one agreement (:func:`~knapformer.distributed.agree.agree`: a
rendezvous of the whole group) carrying the operation, its index in the step, the step, this
rank's local problem (if any) and the values that must match, so that bad input on one rank
raises the same clear error on every rank before data moves, ranks that make different calls
raise naming each rank's call, and the first exchange after a new plan agrees on the plan's
digest.

The per-layer calls (``attention``, ``pre_attn``, ``post_attn``) run every layer, and a
rendezvous there would cost a whole-group synchronisation per layer and direction. So they
agree only where they must (:class:`StepChecks`):

- the *first* per-layer call of every step agrees (its shapes, dtypes and causal flag), and
  that signature — with the call's index and whether gradients are on — names the step's
  *kind*;
- in the first step of each kind (and under ``debug``) every per-layer call agrees too, and the
  sequence of calls is recorded: the step's *schedule*;
- later steps of that kind check each per-layer call locally against the schedule, every rank
  agreed on: what shapes its exchanges is then the same on every rank without a collective.
  A rank whose call differs (bad shapes or dtype, a bad kernel output, another operation, a
  layer more or less) *plays* the scheduled call instead — the same exchanges, on zeros — and
  defers its error, which every rank raises at the step's next agreement (``reverse_route``,
  or the next ``plan``): no rank leaves a collective the others are in.

A problem found where no exchange follows (``cross_attention`` is local; ``report_error``) is
deferred the same way. Legend: R routed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from knapformer.distributed.agree import Call, agree, describe_parts, signature
from knapformer.errors import BalancerInputError

__all__ = ["LayerCall", "StepChecks", "as_lengths", "attention_problem", "rows_problem"]


def rows_problem(tensors: Sequence, rows: int, rank: int) -> str:
    """Why ``tensors`` cannot be exchanged as ``rows`` token rows each ("" if they can)."""
    if not tensors:
        return "no tensors given"
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return f"argument {i} is not a tensor with a token dimension"
        if t.shape[0] != rows:
            return f"argument {i} has {t.shape[0]} tokens on rank {rank}, expected {rows}"
        if t.device != tensors[0].device:
            return f"argument {i} is on {t.device}, argument 0 on {tensors[0].device}"
    return ""


def as_lengths(local_seq_lens) -> Sequence[int]:
    """Lengths as a list (a 1-D integer tensor is accepted, as numpy arrays are)."""
    if isinstance(local_seq_lens, torch.Tensor):
        if local_seq_lens.dim() != 1 or local_seq_lens.is_floating_point() or local_seq_lens.is_complex():
            raise ValueError(
                f"local_seq_lens must be a 1-D integer tensor or a list, got a {local_seq_lens.dtype} tensor "
                f"of shape {tuple(local_seq_lens.shape)}"
            )
        return local_seq_lens.tolist()
    return local_seq_lens


def attention_problem(q, k, v, routed: int, rank: int) -> str:
    """Why q, k, v cannot be this rank's routed attention inputs ("" if they can)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k, v must be tensors"
    shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {shapes}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2]:
        return f"q (R, h, D), k (R, h_kv, D) and v (R, h_kv, Dv) must share R, h_kv and D; got {shapes}"
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v must share a dtype (or run under torch.autocast); got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[0] != routed:
        return f"q has {q.shape[0]} tokens on rank {rank}; routed tokens: {routed}"
    return ""


@dataclass(frozen=True)
class LayerCall:
    """What shapes the exchanges of one per-layer call: the operation, the dtype and trailing
    shape of each tensor it takes (token dimension left open) and causal masking."""

    op: str
    """``attention``, ``pre_attn`` or ``post_attn``."""
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = ()
    """(dtype, trailing shape) of q, k, v (``post_attn``: none; its exchange follows ``pre_attn``'s)."""
    causal: bool = False

    @classmethod
    def of(cls, op: str, tensors: Sequence[torch.Tensor] = (), causal: bool = False) -> LayerCall:
        return cls(op, tuple((t.dtype, tuple(t.shape[1:])) for t in tensors), bool(causal))

    def values(self) -> tuple[tuple[str, str], ...]:
        """What the agreement compares (name, text)."""
        out = tuple((n, describe_parts(dt, shape)) for n, (dt, shape) in zip("qkv", self.tensors))
        return out + ((("causal", str(self.causal)),) if self.op != "post_attn" else ())

    def describe(self) -> str:
        args = ", ".join(f"{n}: {describe_parts(dt, shape)}" for n, (dt, shape) in zip("qkv", self.tensors))
        return f"{self.op}({args}{', causal' if self.causal else ''})"


class StepChecks:
    """Agreement state of one balancer: the step, the calls made in it, the plan digest until
    it is agreed, a deferred error, and the schedules of the step kinds seen (module
    docstring). ``player(entry)`` (set by the balancer) runs a scheduled per-layer call on
    zeros when this rank must join exchanges it did not ask for."""

    def __init__(self, group, control, rank: int, *, debug: bool = False) -> None:
        self.group, self.control, self.rank = group, control, rank
        self.debug = debug
        """Every per-layer call agrees (no schedules)."""
        self.step = 0
        """Plans made or adopted so far."""
        self.index = 0
        """Calls made since the step's plan (per-layer calls included)."""
        self.pending = ""
        self._pending_kind = "input"
        self._plan_digest = 0
        self._plan_agreed = False
        self.player: Callable[[LayerCall], None] | None = None
        self.schedules: dict[tuple, tuple] = {}
        """Step kind -> the calls of its first clean step (``LayerCall`` or rendezvous name)."""
        self._record: list = []
        self._kind: tuple | None = None
        self._schedule: tuple | None = None
        self._failed = False
        self.rendezvous_count = 0
        """Agreements joined so far (what tests count)."""

    # -- steps ----------------------------------------------------------------------------------
    def new_step(self, plan_digest: int, *, agreed: bool) -> None:
        record, known = tuple(self._record), self._schedule
        if self._kind is not None and not self._failed and (known is None or known[: len(record)] != record):
            # the same on every rank (every call beyond the schedule was agreed); a step that
            # stops short of its schedule (no recomputation, say) keeps the longer one
            self.schedules[self._kind] = record
        self.step += 1
        self.index = 0
        self._plan_digest, self._plan_agreed = plan_digest, agreed
        self._record, self._kind, self._schedule, self._failed = [], None, None, False

    @property
    def scheduled(self) -> bool:
        """This step's per-layer calls follow a known schedule (no rendezvous per layer)."""
        return self._schedule is not None

    # -- deferred errors ------------------------------------------------------------------------
    def defer(self, message: str, kind: str = "input") -> None:
        """Raise ``message`` at the next agreement (the first deferred message wins);
        ``kind``: ``input`` (bad input) or ``divergent`` (a call the other ranks did not make)."""
        self._failed = True
        if not self.pending:
            self.pending, self._pending_kind = str(message), kind

    def take_pending(self) -> str:
        message, self.pending = self.pending, ""
        return message

    # -- agreements -----------------------------------------------------------------------------
    def agree(
        self,
        op: str,
        error: str = "",
        values: tuple[tuple[str, str], ...] = (),
        what: str = "input",
        *,
        play: bool = True,
        flags=(),
    ) -> list[int]:
        """Join the agreement of call ``op`` (a deferred error takes precedence over ``error``,
        which is about ``what``). ``play``: first join the per-layer calls the step's schedule
        still has before the next agreement (a rank that skipped layers: the others are in
        their exchanges); off at step boundaries (``plan``, ``flush``). ``flags``: small ints
        whose maximum over the group is returned (:func:`~knapformer.distributed.agree.agree`)."""
        while play and self._schedule is not None and self.index < len(self._schedule):
            entry = self._schedule[self.index]
            if isinstance(entry, str):
                break
            self.defer(
                f"rank {self.rank} called {op} where every rank made {entry.describe()} (call {self.index}) in "
                "earlier steps of this kind (a layer skipped on this rank?)",
                "divergent",
            )
            self.play(entry)
        out = self._agree(op, error, values, what, flags)
        self._record.append(op)
        return out

    def _agree(self, op: str, error: str, values: tuple, what: str, flags=()) -> list[int]:
        pending, kind = self.take_pending(), self._pending_kind
        error, what = (pending, kind) if pending else (error, what)
        call = Call(op=op, index=self.index, step=self.step, values=values)
        plan = self._plan_digest if not self._plan_agreed else 0
        self.index += 1
        self._plan_agreed = True  # checked now, whatever the outcome (a mismatch raises here, once)
        self.rendezvous_count += 1
        try:
            return agree(self.group, call, error, plan=plan, control=self.control, what=what, flags=flags)
        except Exception:
            self._failed = True
            raise

    def play(self, entry: LayerCall) -> None:
        """Run scheduled call ``entry`` on zeros (its exchanges meet the other ranks')."""
        self.index += 1
        self._record.append(entry)
        assert self.player is not None, "the balancer sets StepChecks.player"
        self.player(entry)

    def layer(self, call: LayerCall, error: str = "") -> LayerCall | None:
        """Check per-layer call ``call`` (this rank's local problem: ``error``). Returns None
        when the call runs as made (agreed, or matching the schedule), or the scheduled call
        this rank must run instead, on zeros (its error is then deferred)."""
        if self.debug or self._kind is None or self._schedule is None or self.index >= len(self._schedule):
            first = self._kind is None
            self._agree(call.op, error, call.values() if not error else (), "input")
            self._record.append(call)
            if first:  # the step's kind: the first per-layer call, where it is, and gradients on or not
                self._kind = (self.index - 1, call, torch.is_grad_enabled())
                self._schedule = None if self.debug else self.schedules.get(self._kind)
            return None
        entry = self._schedule[self.index]
        if isinstance(entry, str):
            # every rank that made as many calls as the schedule is now in this agreement (or, if
            # this step has more layers, at this same call): join it. Ranks at the same call go on
            # agreeing call by call, as in a first step; a rank at another call raises everywhere.
            self._agree(call.op, error, call.values() if not error else (), "input")
            self._record.append(call)
            self._schedule = None
            return None
        if entry == call and not error:
            self.index += 1
            self._record.append(call)
            return None
        made = f"made {call.describe()} where every rank made {entry.describe()} in earlier steps of this kind"
        self.defer(
            f"{call.op} on rank {self.rank} (call {self.index} of step {self.step}): " + (error or made),
            "input" if error or entry.op == call.op else "divergent",  # other shapes: bad input; another call
        )
        self.index += 1
        self._record.append(entry)
        return entry

    def tensors(self, op: str, tensors: Sequence, rows: int, *, error: str = "", names=None) -> tuple:
        """Agree on tensors exchanged together: ``rows`` token rows each on this rank, the same
        dtypes and trailing shapes on every rank — and on whether the step has a backward:
        returns ``tensors``, where some rank's need gradients and this rank's do not (an empty
        rank's ``torch.zeros(0, d)``), with its first floating tensor made a leaf that needs
        one, so that this rank's backward also reaches the exchange's backward (every rank is
        in it). A rank under ``torch.no_grad()`` while others need a backward raises on every
        rank."""
        error = error or rows_problem(tensors, rows, self.rank)
        floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
        needs = torch.is_grad_enabled() and any(t.requires_grad for t in floats)
        values = signature(tensors, names) if not error else ()
        any_needs, any_no_grad = self.agree(op, error, values, flags=(needs, not torch.is_grad_enabled()))
        if any_needs and any_no_grad:
            raise BalancerInputError(
                f"SequenceBalancer.{op}: some ranks run it under torch.no_grad() while others' tensors need "
                f"gradients (this is rank {self.rank}): every rank of the group must run the same backward"
            )
        if any_needs and not needs and floats:
            i = next(i for i, t in enumerate(tensors) if t is floats[0])
            tensors = (*tensors[:i], tensors[i].detach().requires_grad_(), *tensors[i + 1 :])
        return tuple(tensors)
