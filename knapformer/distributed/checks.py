"""The balancer's checks: what each call validates locally, and when it agrees with the other ranks.

A rendezvous (:func:`~knapformer.distributed.agree.agree`: one small all-gather of the whole
group's fixed-size rows) carries the operation, its index in the step, the step, this rank's local problem (if
any) and the values that must match, so that bad input on one rank raises the same clear error
on every rank before data moves, and ranks that make different calls raise naming each
rank's call. A rendezvous is a synchronisation of the whole group, so a step makes them only
before its first layer (:class:`StepChecks`):

- ``plan`` (and ``use_plan``, ``flush``, ``load_state_dict``) agree: they are step
  boundaries, and every error deferred in the previous step is raised there, on every rank
  (a ``plan``/``use_plan`` settled ahead makes no agreement: ``plan_ahead``'s request rode on
  the previous step's ``route`` row, :mod:`.ahead`; its errors are raised there instead);
- every ``route`` agrees — where a forward pass begins, before its first layer: its tensors'
  shapes and dtypes, whether gradients are on (and autocast), the plan's digest. A ``route``
  opens a *segment* of the step (so does the step's first call, if it is not a route), and
  the segment's place in the step with the opening call's values name its *kind*;
- in the first segment of each kind (and under ``debug``) every later call agrees too, and
  the sequence of calls up to the next segment is recorded: its *schedule*;
- later segments of that kind check each call after the opening one — per-layer
  (``attention``, ``pre_attn``, ``post_attn``) and the others (``reverse_route``,
  ``gather_sequences``, ``route_context``) — locally against the schedule, which every rank
  agreed on: what shapes the exchanges is then the same on every rank without a collective,
  and each exchange involves only its own peers. A training step with one forward pass (plan,
  route, layers, reverse, backward) thus synchronises the whole group in ``plan`` and
  ``route`` only, both before its first layer. A rank whose call differs (bad shapes or dtype, a bad kernel
  output, another operation, a layer more or less) *plays* the scheduled call instead — the
  same exchanges, on zeros — or, for a call the schedule does not have, makes none; it defers
  its error, which every rank raises at the next rendezvous (the next ``plan``): no rank
  leaves an exchange its peers are in, and no rank waits for one it exchanges nothing with.

A problem found where no exchange follows (``cross_attention`` is local; ``report_error``) is
deferred the same way. Legend: R routed tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from knapformer.distributed.agree import (
    DEFAULT_CAPACITY,
    Agreement,
    Call,
    agree_rows,
    describe_parts,
    digest_of,
    gather_int_rows,
    signature,
)
from knapformer.distributed.ahead import AheadRequest
from knapformer.distributed.exchange import handshake
from knapformer.errors import BalancerInputError

__all__ = [
    "SKIP",
    "LayerCall",
    "OnceCall",
    "StepChecks",
    "as_lengths",
    "attention_problem",
    "mode_values",
    "rows_problem",
]


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


@dataclass(frozen=True)
class OnceCall:
    """A once-per-step exchanging call as the schedule records it (``route``,
    ``reverse_route``, ``gather_sequences``, ``route_context``)."""

    op: str
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    """(dtype, trailing shape) of each tensor it exchanges."""
    values: tuple[tuple[str, str], ...]
    """What its agreement compared (names included)."""
    needs: bool
    """Some rank's tensors needed gradients (this rank's first floating tensor is then made a
    leaf that needs one, so that its backward reaches the exchange's backward)."""

    def describe(self) -> str:
        return f"{self.op}({', '.join(f'{n}: {v}' for n, v in self.values)})"


MAX_CAPACITY = 256
"""The most payload slots an agreement row grows to (:meth:`StepChecks.grow`)."""

SKIP = "skip"
""":meth:`StepChecks.once`/:meth:`StepChecks.layer`: the call is not in the schedule (one this
rank makes beyond the others'): run no exchange, return zeros (the error is deferred)."""


class StepChecks:
    """Agreement state of one balancer: the step, the calls made in it, the plan digest until
    it is agreed, a deferred error, and the schedules of the step kinds seen (module
    docstring). ``player(entry)`` (set by the balancer) runs a scheduled per-layer call on
    zeros when this rank must join exchanges it did not ask for."""

    def __init__(self, group, control, rank: int, *, debug: bool = False) -> None:
        self.group, self.control, self.rank = group, control, rank
        self.debug = debug
        """Every call agrees (no schedules)."""
        self.step = 0
        """Plans made or adopted so far."""
        self.index = 0
        """Calls made since the step's plan (per-layer calls included)."""
        self.pending = ""
        self._pending_kind = "input"
        self._plan_digest = 0
        self._plan_agreed = False
        self.player: Callable[[LayerCall | OnceCall], object] | None = None
        self.schedules: dict[tuple, tuple] = {}
        """Segment kind -> the calls of its first clean segment (``LayerCall``/``OnceCall``)."""
        self._segment = 0
        """Segments opened in this step."""
        self._at = 0
        """Calls of the open segment made so far (its schedule's index)."""
        self.agreed = True
        """The last call agreed with the whole group (else its peers check it: :meth:`peer_check`)."""
        self.peer_needs = False
        """The last :meth:`peer_check`: some peer's tensors need gradients."""
        self.played: list[torch.Tensor] = []
        """Outputs of scheduled calls this rank played on zeros, not yet joined to its graph."""
        self._played_pre: list[torch.Tensor] = []
        self._scheduled_values: tuple = ()
        self._record: list = []
        self._kind: tuple | None = None
        self._schedule: tuple | None = None
        self._failed = False
        self.rendezvous_count = 0
        """Agreements joined so far (what tests count)."""
        self.ahead: AheadRequest | None = None
        """This rank's ``plan_ahead`` request, until an agreement carries it."""
        self.on_ahead: Callable[[list[list[int]], AheadRequest | None], None] | None = None
        """Called (by the balancer) after an agreement in which some rank carried a request."""
        self.agreed_ahead = None
        """What the carrying agreement settled for the next step (the balancer's; dropped on
        every rank alike when an agreement raises)."""
        self.seconds_bits: Callable[[], int] | None = None
        """This rank's last measured seconds as int64 bits (the balancer's closed loop): they ride
        on the row that carries a request."""
        self.capacity = DEFAULT_CAPACITY
        """Payload slots of this group's agreement rows: the same on every rank (it grows only
        where every rank saw the same table: :meth:`grow`)."""

    # -- steps ----------------------------------------------------------------------------------
    def new_step(self, plan_digest: int, *, agreed: bool) -> None:
        self._close_segment()
        self.step += 1
        self.index = 0
        self._segment = 0
        self._plan_digest, self._plan_agreed = plan_digest, agreed
        self._failed = False

    def _close_segment(self) -> None:
        """A learning segment's record becomes its kind's schedule (every call agreed, so the
        record is the same on every rank)."""
        if self._kind is not None and not self._failed and self._schedule is None and not self.debug:
            self.schedules[self._kind] = tuple(self._record)
        self._record, self._kind, self._schedule = [], None, None

    @property
    def scheduled(self) -> bool:
        """This step's later calls follow a known schedule (no rendezvous after its first call)."""
        return self._schedule is not None

    # -- deferred errors ------------------------------------------------------------------------
    def defer(self, message: str, kind: str = "input") -> None:
        """Raise ``message`` at the next agreement (the first deferred message wins, this
        rank's own problem before a peer's); ``kind``: ``input`` (bad input), ``divergent`` (a
        call the other ranks did not make) or ``peer`` (a peer's call differed)."""
        self._failed = True
        if not self.pending or (self._pending_kind == "peer" and kind != "peer"):  # this rank's own problem first
            self.pending, self._pending_kind = str(message), kind

    def fail(self) -> None:
        """This step raised on every rank (its record is not a schedule)."""
        self._failed = True

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
        payload=(),
    ) -> Agreement:
        """Join the agreement of call ``op`` (a deferred error takes precedence over ``error``,
        which is about ``what``). ``play``: within a scheduled segment, first run the scheduled
        per-layer calls this rank skipped (off at step boundaries: ``plan``, ``flush``).
        ``flags``: small ints whose maximum over the group the result carries; ``payload``:
        ints every rank's of which it carries (:func:`~knapformer.distributed.agree.agree_rows`)."""
        if play:
            self._play_skipped(op)
        out = self._agree(op, error, values, what, flags, payload)
        self._close_segment()  # a rendezvous ends the segment: the next call opens another
        return out

    def grow(self, longest: int) -> None:
        """Make room for payloads of ``longest`` values in later agreements, up to
        :data:`MAX_CAPACITY` (call it on every rank alike: from a table every rank gathered).
        Beyond it a payload takes a second gather each time: every agreement carries the rows,
        and one rank's thousands of tiny sequences must not make every later row that long."""
        while self.capacity < min(longest, MAX_CAPACITY):
            self.capacity *= 2

    def _agree(self, op: str, error: str, values: tuple, what: str, flags=(), payload=()) -> Agreement:
        pending, kind = self.take_pending(), self._pending_kind
        error, what = (pending, kind) if pending else (error, what)
        call = Call(op=op, index=self.index, step=self.step, values=values)
        plan = self._plan_digest if not self._plan_agreed else 0
        self.index += 1
        self._plan_agreed = True  # checked now, whatever the outcome (a mismatch raises here, once)
        self.rendezvous_count += 1
        self.agreed = True
        carried, boundary = None, op in ("plan", "use_plan")
        if boundary:  # a request no agreement carried before the next plan is dropped (on every rank alike)
            self.ahead = None
        elif self.ahead is not None and self.seconds_bits is not None:
            carried, self.ahead = self.ahead, None
            payload = carried.payload(self.seconds_bits())
        try:
            got = agree_rows(
                self.group,
                call,
                error,
                plan=plan,
                control=self.control,
                what=what,
                flags=flags,
                payload=payload,
                capacity=self.capacity,
            )
            if got.overflow:  # every rank sees it: all gather the long payloads, and the rows grow
                rows = gather_int_rows(self.control, list(payload), got.counts, op)
                got = dataclasses.replace(got, gathered=rows)
                self.grow(max(got.counts))
            if not boundary and any(got.counts) and self.on_ahead is not None:
                self.on_ahead(got.payloads(), carried)
            return got
        except Exception:
            # raised on every rank alike: drop what was learned (a kind whose calls changed is
            # learned again, the same way everywhere) and what was settled ahead
            self._failed = True
            self.schedules.clear()
            self._schedule = None
            self.agreed_ahead = None
            raise

    def _entry(self):
        """The schedule's entry for this rank's next call (None: the schedule has no more)."""
        sched = self._schedule
        return sched[self._at] if sched is not None and self._at < len(sched) else None

    def _advance(self, entry) -> None:
        self.index += 1
        self._at += 1
        self._record.append(entry)

    def _play_skipped(self, op: str) -> None:
        """Within a scheduled segment: run the calls the schedule still has before this rank's
        call ``op`` — the per-layer calls up to the next other call, and, when ``op`` is a later
        once-per-step call of the schedule, every call before it (this rank skipped them; its
        peers are in their exchanges)."""
        if self._schedule is None or self.debug:
            return
        ahead = [e for e in self._schedule[self._at :] if isinstance(e, OnceCall)]
        skipped_once = bool(ahead) and ahead[0].op != op and any(e.op == op for e in ahead)
        while True:
            entry = self._entry()
            if entry is None or (isinstance(entry, OnceCall) and (entry.op == op or not skipped_once)):
                return
            what = "a layer" if isinstance(entry, LayerCall) else entry.op
            self.defer(
                f"rank {self.rank} called {op} where every rank made {entry.describe()} (call {self.index} of step "
                f"{self.step}) in earlier steps of this kind ({what} skipped on this rank?)",
                "divergent",
            )
            self.play(entry)

    def play(self, entry: LayerCall | OnceCall) -> None:
        """Run scheduled call ``entry`` on zeros (its exchanges meet the other ranks'); what it
        returns waits in :attr:`played` until the balancer joins it to the caller's graph (so
        that its backward exchanges run, in their place among the others)."""
        self._advance(entry)
        # a played call is checked with its peers like any call after the segment's first
        values = entry.values() if isinstance(entry, LayerCall) else entry.values
        self.agreed, self._scheduled_values = False, values
        assert self.player is not None, "the balancer sets StepChecks.player"
        out = self.player(entry)
        if entry.op == "post_attn":  # its output hangs off the played pre_attn's: that one is in its graph
            self.played = [t for t in self.played if not any(t is p for p in self._played_pre)]
            self._played_pre = []
        if isinstance(out, torch.Tensor):
            self.played.append(out)
        elif isinstance(out, tuple):  # pre_attn's arguments: their tensors
            self._played_pre = [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.played.extend(self._played_pre)

    def take_played(self) -> list[torch.Tensor]:
        """The outputs of the calls played since the last take (module docstring)."""
        out, self.played = self.played, []
        return out

    def _learning(self) -> bool:
        """This (non-opening) call agrees: under ``debug``, or while the segment records its
        schedule."""
        return self.debug or self._schedule is None

    def _opens(self, op: str) -> bool:
        """This call opens a segment: every ``route``, and the step's first call."""
        return op == "route" or self._kind is None

    def _open(self, op: str, values: tuple, entry) -> None:
        """A segment opened by agreed call ``entry``: its kind (the same on every rank: agreed)
        and its schedule, if one was learned."""
        self._close_segment()
        self._kind = (self._segment, op, values)
        self._segment += 1
        self._schedule = None if self.debug else self.schedules.get(self._kind)
        self._record = [entry]
        self._at = 1

    def layer(self, call: LayerCall, error: str = "") -> LayerCall | str | None:
        """Check per-layer call ``call`` (this rank's local problem: ``error``). Returns None
        when the call runs as made (agreed, or matching the schedule), the scheduled call this
        rank must run instead, on zeros, or :data:`SKIP` (a call beyond the schedule: no
        exchange); the error is then deferred."""
        opens = self._opens(call.op)
        if opens or self._learning():
            values = call.values() if not error else ()
            values = (*values, *mode_values(), ("grad mode", str(torch.is_grad_enabled()))) if opens else values
            self._agree(call.op, error, values, "input")
            if opens:
                self._open(call.op, values, call)
            else:
                self._at += 1
                self._record.append(call)
            return None
        entry = self._entry()
        if not isinstance(entry, LayerCall):  # every rank's schedule has another call (or nothing) here
            what = entry.op if entry is not None else "no further call"
            self.defer(
                f"rank {self.rank} made {call.describe()} where every rank made {what} (call {self.index} of step "
                f"{self.step}) in earlier steps of this kind (a layer more on this rank?)",
                "divergent",
            )
            return SKIP
        if entry.op == call.op and not error:  # its shapes are checked with the peers (peer_check), not
            self._advance(call)  # here: every rank may have moved on to other shapes together
            self.agreed, self._scheduled_values = False, entry.values()
            return None
        where = f"{call.op} on rank {self.rank} (call {self.index} of step {self.step})"
        if error:  # bad input: the scheduled call runs on zeros instead (the same autograd structure)
            self.defer(f"{where}: {error}", "input")
        else:
            made = f"made {call.describe()} where every rank made {entry.describe()} in earlier steps of this kind"
            self.defer(f"{where}: {made}", "divergent")
        self._advance(entry)
        self.agreed, self._scheduled_values = False, entry.values()
        return entry

    def once(
        self, op: str, tensors: Sequence, rows: int, *, error: str = "", names=None, peers=frozenset()
    ) -> tuple[tuple, str | None, frozenset]:
        """Check call ``op`` of tensors exchanged together (``route``, ``reverse_route``,
        ``gather_sequences``, ``route_context``): ``rows`` token rows each on this rank, the
        same dtypes and trailing shapes on every rank (or, in a scheduled segment, on every
        rank of ``peers``, the ranks the call moves data with), the same gradient mode.
        Returns (the tensors to exchange, None, the peers to leave out), or (…, :data:`SKIP`,
        …) when this rank must make no exchange: its call is not in the schedule, or is bad
        (the error is deferred; its peers leave it out).

        Gradients: where some rank's tensors need them and this rank's do not (an empty rank's
        ``torch.zeros(0, d)``), this rank's first floating tensor is made a leaf that needs one,
        so that its backward also reaches the exchange's backward (its peers are in it). A rank
        under ``torch.no_grad()`` while others' tensors need gradients raises on every rank."""
        error = error or rows_problem(tensors, rows, self.rank)
        floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
        needs = torch.is_grad_enabled() and any(t.requires_grad for t in floats)
        sig = () if error else tuple((t.dtype, tuple(t.shape[1:])) for t in tensors)
        values = signature(tensors, names) if not error else ()
        opens = self._opens(op)
        if opens or self._learning():
            if opens:
                self._play_skipped(op)
                tensors, self.played = _joined(tuple(tensors), self.take_played())
            agreed = (*values, *mode_values()) if opens else values
            grad = torch.is_grad_enabled()
            any_needs, any_no_grad, any_grad = self._agree(op, error, agreed, "input", (needs, not grad, grad)).flags
            if any_no_grad and (any_needs or (opens and any_grad)):
                self.fail()
                others = "others' tensors need gradients" if any_needs else "others run with gradients on"
                raise BalancerInputError(
                    f"SequenceBalancer.{op}: some ranks run it under torch.no_grad() while {others} (this is rank "
                    f"{self.rank}): every rank of the group must run the same backward"
                )
            entry = OnceCall(op, sig, values, bool(any_needs))
            if opens:  # the gradient mode is the same everywhere (checked above): part of the kind
                self._open(op, (*agreed, ("grad mode", str(grad))), entry)
            else:
                self._at += 1
                self._record.append(entry)
            return _with_grad(tuple(tensors), bool(any_needs) and not needs), None, frozenset()
        self._play_skipped(op)
        tensors, self.played = _joined(tuple(tensors), self.take_played())
        entry = self._entry()
        if not isinstance(entry, OnceCall) or entry.op != op:
            what = entry.describe() if entry is not None else "no further call"
            self.defer(
                f"rank {self.rank} made {op} where every rank made {what} (call {self.index} of step {self.step}) "
                "in earlier steps of this kind",
                "divergent",
            )
            return tuple(tensors), SKIP, frozenset()
        self._advance(entry)
        self.agreed, self._scheduled_values = False, entry.values
        skip = self.peer_check(peers, op, values, error, needs=needs)
        if error:
            return tuple(tensors), SKIP, skip
        # whether a peer's tensors need gradients now (not when the schedule was learned: a module
        # may have been frozen or unfrozen since)
        return _with_grad(tuple(tensors), self.peer_needs and not needs), None, skip

    def peer_check(
        self, peers, op: str, values: tuple, error: str = "", kind: str = "input", needs: bool = False
    ) -> frozenset[int]:
        """After a call that did not agree with the whole group (one of a scheduled segment):
        exchange a header — the step, the call's index, its operation and values, an error
        flag — with exactly ``peers`` (the ranks this call moves data with) and return those
        whose header differs from this rank's: the two sides of such a pair leave each other
        out of the call's exchanges (each sees the same difference). ``error``: this rank's own
        problem with the call (it then runs none of it; every peer leaves it out). Whatever
        differs is deferred and raised on every rank at the next rendezvous. Nothing to check
        (an empty set) after an agreed call. ``needs``: this rank's tensors need gradients; after
        the call :attr:`peer_needs` says whether a peer's do (then this rank's backward must
        reach the exchange too)."""
        self.peer_needs = False
        if self.agreed:
            return frozenset()
        index = self.index - 1
        mine = (self.step, index, digest_of(op), digest_of(values), 1 if error else 0)
        got = handshake(peers, (*mine, int(needs)), self.rank, self.control, f"{op} (its header)")
        skip = frozenset(p for p, h in got.items() if h[:5] != mine)
        self.peer_needs = any(h[5] for p, h in got.items() if p not in skip)
        where = f"{op} on rank {self.rank} (call {index} of step {self.step})"
        if error:
            self.defer(f"{where}: {error}", kind)
            return frozenset(got)
        if skip and values != self._scheduled_values:
            made = ", ".join(f"{n}: {v}" for n, v in values)
            want = ", ".join(f"{n}: {v}" for n, v in self._scheduled_values)
            self.defer(
                f"{where}: made {op}({made}) where every rank made {op}({want}) in earlier steps of this kind, "
                f"and rank(s) {sorted(skip)} of its exchange differ from it now"
            )
        elif skip:
            self.defer(f"{where}: rank(s) {sorted(skip)} of its exchange made another call or had bad input", "peer")
        return skip


def mode_values() -> tuple[tuple[str, str], ...]:
    """The autocast mode of the calling thread, as agreement values (part of a segment's kind:
    ranks in different modes would run different schedules; the gradient mode is agreed by
    the flags of the opening call)."""
    cast = ", ".join(
        f"{d}: {str(torch.get_autocast_dtype(d)).removeprefix('torch.')}"
        for d in ("cpu", "cuda")
        if torch.is_autocast_enabled(d)
    )
    return (("autocast", cast or "off"),)


def _joined(tensors: tuple, played: list[torch.Tensor]) -> tuple[tuple, list[torch.Tensor]]:
    """``tensors`` with the played calls' outputs joined to the first floating one (an added
    zero): their backward exchanges then run where the other ranks run those calls'. Returns
    them and what could not be joined (no floating tensor: it waits for the next call)."""
    played = [p for p in played if p.requires_grad]
    if not played:
        return tensors, []
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            for p in played:
                t = t + 0 * p.sum().to(t.dtype)
            return (*tensors[:i], t, *tensors[i + 1 :]), []
    return tensors, played


def _with_grad(tensors: tuple, make: bool) -> tuple:
    """``tensors`` with the first floating one of each dtype made a leaf that needs a gradient
    (``make``): tensors of one dtype travel in one exchange, whose backward each must reach."""
    if not make:
        return tensors
    out, seen = list(tensors), set()
    for i, t in enumerate(out):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in seen:
            seen.add(t.dtype)
            out[i] = t.detach().requires_grad_()
    return tuple(out)
