"""``SequenceBalancer``: the per-step handle a model calls (plan, route, attention, reverse).

    bal = SequenceBalancer("g1n2+g2n1", WorkloadModel(d_model=64))   # after init_process_group
    plan = bal.plan(local_seq_lens)         # collective over the balancing group
    y = bal.route(x)                        # (sum(local_seq_lens), *F) -> routed tokens
    o = bal.attention(q, k, v)              # (R, h, D) -> (R, h, Dv), Ulysses inside groups
    x2 = bal.reverse_route(y)               # back to the caller's order

It implements :class:`~knapformer.executor.TokenExecutor` over torch.distributed. Planning is
done independently on every rank from the same gathered lengths (no rank-0 broadcast). A step
synchronises the whole group only before its first layer (``plan``, and the agreement of its
first exchanging call, normally ``route``); every later exchange involves only the ranks that
move data in it (:mod:`.exchange`), and the calls that shape those exchanges are checked
against the step's schedule (:mod:`.checks`). The other concerns live in their own modules:
the settings and groups agreed at construction (:mod:`.settings`), the closed loop
(:mod:`.closed_loop`), context and cross-attention (:mod:`.cross`), the route spec
(:mod:`.spec`), the Ulysses exchanges (:mod:`.ulysses`), ring attention (:mod:`.ring`) and the
K/V gather of ``pre_attn`` (:mod:`.kv_gather`).

The attention calls (``attention``, ``pre_attn``/``post_attn``, ``cross_attention``) check a
layer's q, k, v on each rank (shapes, dtypes, the routed token count); a bad call is raised on
every rank — at once while the step agrees call by call (its kind's first step, or
``debug``), else at the next ``plan``, after this rank has run the call every rank
scheduled on zeros so that no exchange is left waiting. A head count the plan's groups cannot
split is an :class:`~knapformer.errors.InvalidPlanError` naming the group, and so is a ring
plan run on the other attention path than ``attn_path`` names (``attention``: ring rounds;
``pre_attn``: the K/V all-gather of :mod:`.kv_gather`). Under ``torch.autocast`` q, k, v are
cast to the autocast dtype first (what SDPA does); under ``torch.compile`` ``attention`` and
``cross_attention`` are one opaque operator each (:mod:`.compiled`).

Devices come from tensors (index tensors are copied to the tensor's device once per plan);
exchanges use the group's backend: gloo for CPU tensors, NCCL for CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

import knapformer.distributed.ahead as ahead
import knapformer.distributed.compiled as compiled
import knapformer.distributed.cross as cross
import knapformer.distributed.kv_gather as kv_gather
import knapformer.distributed.ops as ops
import knapformer.distributed.ring as ring
import knapformer.distributed.trace as trace
import knapformer.distributed.ulysses as ulysses
from knapformer.attention.varlen import varlen_attention
from knapformer.config import BalancerConfig
from knapformer.distributed.agree import digest62, gather_ints, gather_text, group_device
from knapformer.distributed.ahead import AheadSolver
from knapformer.distributed.backends import data_device, device_problem, uses_nccl
from knapformer.distributed.checks import SKIP, LayerCall, OnceCall, StepChecks, as_lengths, attention_problem
from knapformer.distributed.closed_loop import ClosedLoop
from knapformer.distributed.compiled import eager_only
from knapformer.distributed.exchange import warm_up
from knapformer.distributed.link_probe import measure_link
from knapformer.distributed.settings import agree_settings, asked_group, resolve_groups
from knapformer.distributed.spec import RouteSpec, prepared_spec
from knapformer.errors import BalancerConfigError, BalancerInputError, InvalidPlanError, PlanMismatchError
from knapformer.executor.opaque import attend, owner_handle
from knapformer.executor.protocol import RoutedContext, VarlenArgs, context_tensors
from knapformer.layout import AutoLayout, BagLayout
from knapformer.plan import Plan, Planner
from knapformer.plan.cost import LinkModel
from knapformer.plan.memory import gathered_memory
from knapformer.plan.problem import ValidLens, validate_lengths
from knapformer.telemetry import StepTelemetry
from knapformer.workload import WorkloadModel

__all__ = [
    "STATE_VERSION",
    "BalancerConfigError",
    "BalancerInputError",
    "PlanMismatchError",
    "SequenceBalancer",
    "autocast_inputs",
]

_log = logging.getLogger("knapformer")

STATE_VERSION = 1
"""Version of :meth:`SequenceBalancer.state_dict`'s format."""


class SequenceBalancer:
    """Plans and executes sequence balancing for one balancing group per replica.

    Build it from a :class:`~knapformer.config.BalancerConfig`, or with the layout and cost
    model positionally and the other settings as keywords (the same fields)::

        SequenceBalancer(BalancerConfig(layout="g2n4", cost=model, max_tokens_per_rank=8192))
        SequenceBalancer("g2n4", model, max_tokens_per_rank=8192)

    Construction is a collective over the whole world: every rank builds its balancer at the
    same point, with the same settings (checked). ``group=`` (a process group this rank is a
    member of) or ``device_mesh=`` (a 1-D ``DeviceMesh``, or a ``(mesh, dimension name)``
    pair) names the balancing group; without one the layout's group tiles the world into
    replicas of consecutive ranks."""

    def __init__(
        self,
        layout: str | BagLayout | AutoLayout | BalancerConfig,
        model: WorkloadModel | str | os.PathLike | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        device_mesh=None,
        **settings,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SequenceBalancer needs torch.distributed: call init_process_group first")
        local_error, given, config, asked, mine = "", None, None, None, None
        try:
            asked, mine = asked_group(group, device_mesh)
            if isinstance(layout, BalancerConfig):
                if model is not None or settings:
                    raise TypeError("pass either a BalancerConfig or layout, model and settings, not both")
                given = layout
            else:
                if model is None:
                    raise TypeError("SequenceBalancer needs a cost model (a WorkloadModel or a profile path)")
                given = BalancerConfig(layout=layout, cost=model, **settings)
            # layout "auto" without a size spans the given group, or the whole world
            config = given.resolved(len(asked) if asked is not None else dist.get_world_size())
            if config.rank_speed is not None and len(config.rank_speed) != config.layout.group_size:
                raise ValueError(
                    f"rank_speed has {len(config.rank_speed)} entries for {config.layout.group_size} ranks"
                )
            if asked is None:
                config.layout.replica_ranks(dist.get_world_size())  # the layout tiles the world
        except (TypeError, ValueError) as exc:
            local_error = f"{type(exc).__name__}: {exc}"
        agree_settings(given, local_error, asked)  # the settings as given: "auto" agrees before it is sized
        groups = resolve_groups(config, mine, asked)
        self.config: BalancerConfig = config
        """The settings this balancer was built with (the closed loop never rewrites them)."""
        self.group = groups.group
        self.group_rank = dist.get_rank(self.group)
        self._checks = StepChecks(self.group, groups.control, self.group_rank, debug=config.debug)
        self._checks.player = self._play  # joins the exchanges of a scheduled call this rank did not make
        self._checks.seconds_bits = self._take_boundary_bits  # ride on the row that carries plan_ahead's request
        self._boundary_bits: int | None = None  # the seconds of the step before a plan made ahead
        self._checks.on_ahead = self._settle_ahead
        self._solver = AheadSolver()
        self._loop = ClosedLoop(config)
        self._plan: Plan | None = None
        self._spec: RouteSpec | None = None
        self._call: ulysses.UlyssesCall | None = None  # the last pre_attn, for post_attn
        self._expected: tuple | None = None  # post_attn's output shape after a pre_attn run on zeros
        self._played = None  # what the last call run on zeros returned
        self._data_device = group_device(self.group)  # where the data tensors were last seen
        self._devices: list[str] | None = None  # every rank's "host/device", once the first route saw them
        self._kv_gather = config.attn_path == "pre_attn"  # plans price pre_attn's K/V all-gather
        self._opaque = owner_handle(self)  # how torch.compile's operators find this balancer
        if uses_nccl(self.group) and torch.cuda.is_available():  # NCCL: point-to-point among subsets needs
            warm_up(self.group, data_device(self.group))  # the communicator made by all members first
        self._loop.planning = dataclasses.replace(self._loop.planning, link=self._resolve_link(config))

    def _resolve_link(self, config: BalancerConfig) -> LinkModel | None:
        """The links the plans price: as given, none (``"free"``), or measured now on this group
        (the default; collective, every rank is here: construction is)."""
        if isinstance(config.link, LinkModel) or config.link == "free":
            return config.link if isinstance(config.link, LinkModel) else None
        return measure_link(self.group, self._checks.control, data_device(self.group), config.cost)

    # -- settings --------------------------------------------------------------------------------
    @property
    def layout(self) -> BagLayout | AutoLayout:
        return self.config.layout  # type: ignore[return-value]

    @property
    def model(self) -> WorkloadModel:
        """The cost model the balancer was built with (:meth:`online_model`: the one planning now)."""
        return self.config.cost  # type: ignore[return-value]

    @property
    def debug(self) -> bool:
        return self.config.debug

    @property
    def num_plans(self) -> int:
        """Plans made or adopted so far (one per step in a training loop)."""
        return self._checks.step

    @property
    def last_step(self) -> StepTelemetry | None:
        """The last completed step's telemetry (measured when ``measure`` is on)."""
        return self._loop.last_step

    @property
    def planning_config(self) -> BalancerConfig:
        """The settings the next plan uses: :attr:`config` with, under ``recalibrate``, the
        online fit's cost model (and estimated rank speeds), and the links resolved (measured
        ones as a ``LinkModel``). They round-trip: a balancer built from them plans as this one
        does next — so unpriced links read ``"free"``, never None (which a config takes as
        "measure them now", a probe on whatever the machine is doing then)."""
        cfg = self._loop.planning
        return cfg if cfg.link is not None else dataclasses.replace(cfg, link="free")

    def planner(self) -> Planner:
        """What :meth:`plan` solves with now, as a picklable :class:`~knapformer.plan.Planner`:
        ``planner(every_rank_lengths)`` is the plan ``plan`` would make from those lengths, in
        any process (a DataLoader worker, ahead of the step: :class:`knapformer.data.PlannedSteps`);
        run it with :meth:`use_plan`. A snapshot: take a new one when the planning settings
        change (``recalibrate``'s fits; ``attn_path="auto"`` after the first ``pre_attn`` call)."""
        return Planner.from_config(self._loop.planning, kv_gather=self._kv_gather)

    def online_model(self) -> WorkloadModel:
        """The cost model the next plan uses (the online fit's, with ``recalibrate``); save it
        with ``WorkloadModel.save`` to start another job from it (a profile)."""
        return self._loop.planning.cost  # type: ignore[return-value]

    # -- planning --------------------------------------------------------------------------------
    @eager_only
    def plan(self, local_seq_lens: Sequence[int]) -> Plan:
        """Gather every rank's lengths, plan, and build this rank's route spec. Collective over
        the balancing group: one agreement that carries every rank's lengths (a second gather
        only in a step where some rank holds more sequences than any before); returns the same
        :class:`Plan` on every rank. ``local_seq_lens``: a list, a numpy array or a 1-D integer
        tensor of this rank's sequence lengths (empty is fine)."""
        with trace.span(trace.PLAN):
            return self._plan_step(local_seq_lens)

    def _plan_step(self, local_seq_lens: Sequence[int]) -> Plan:
        error, lens = "", []
        try:
            lens = list(validate_lengths(as_lengths(local_seq_lens), "local_seq_lens"))
        except ValueError as exc:
            error = str(exc)
        settled = self._take_ahead()
        if settled is not None:
            return self._plan_from_ahead(settled, lens, error)
        if self._boundary_bits is not None:  # a step's seconds no agreement carried: its record goes unmeasured
            self._boundary_bits = None
            if self._loop.ready:
                self._loop.finish_step(None)
        # one whole-group collective: the agreement (a fixed-size row, the same collective as
        # every agreement, so ranks at different calls still meet) carries each rank's previous
        # measured seconds and its lengths; a rank with more lengths than the rows hold makes
        # every rank gather them once more, and the rows grow for the steps after
        payload = [self._loop.seconds_bits(), *lens]
        try:
            got = self._checks.agree("plan", error, what="local_seq_lens", play=False, payload=payload)
        except BalancerInputError:
            self._drop_plan()
            raise
        rows = got.payloads()  # (a rank with more lengths than the rows hold: gathered again, the rows grown)
        if self._loop.ready:  # the previous step's telemetry (with CUDA events: the one before)
            self._loop.finish_step(self._loop.measured(np.asarray([r[0] for r in rows], dtype=np.int64)))
        all_lens = ValidLens(tuple(r[1:]) for r in rows)
        try:  # (lengths validated on their own ranks and agreed above; the planner any process can run)
            plan = self.planner()(all_lens)
        except ValueError as exc:  # e.g. an infeasible memory cap: the same on every rank
            self._drop_plan()
            raise BalancerInputError(f"SequenceBalancer.plan: {exc}") from exc
        return self._start(plan)

    def _start(self, plan: Plan) -> Plan:
        """Adopt a plan this rank made (its digest rides on the step's first agreement) and
        open the step's telemetry."""
        self._adopt(plan, prepared_spec(plan, self.group_rank), agreed=False)
        if self.debug:
            self._checks.agree("plan digest")
        self._loop.start_step(plan, self.num_plans)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "step %d rank %d: %s plan in %.1f ms, predicted imbalance %.3f -> %.3f, %d tokens moved",
                self.num_plans,
                self.group_rank,
                plan.solver,
                1e3 * plan.plan_seconds,
                plan.imbalance_before,
                plan.imbalance_after,
                plan.tokens_moved,
            )
        return plan

    @eager_only
    def use_plan(self, plan: Plan) -> Plan:
        """Execute a plan made elsewhere (any groups of ranks: non-contiguous, overlapping,
        different every step). Collective: every rank must pass the identical plan; it is
        validated and its digest agreed before use, so a bad or different plan raises on every
        rank. The local tensors must follow ``plan.seq_lens[group_rank]``."""
        with trace.span(trace.PLAN):
            return self._use_plan_step(plan)

    def _use_plan_step(self, plan: Plan) -> Plan:
        settled = self._take_ahead()
        if settled is not None:
            return self._use_plan_from_ahead(settled, plan)
        error, spec = "", None
        try:
            if not isinstance(plan, Plan):
                raise TypeError(f"use_plan needs a Plan, got {type(plan).__name__}")
            if plan.num_ranks != self.layout.group_size:
                raise ValueError(f"plan has {plan.num_ranks} ranks, the balancing group {self.layout.group_size}")
            plan.validate()
            spec = prepared_spec(plan, self.group_rank)
        except (TypeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._checks.new_step(digest62(plan.digest()) if spec is not None else 0, agreed=False)
        try:
            self._checks.agree("use_plan", error, play=False)
        except BalancerInputError:
            self._drop_plan()
            raise
        self._plan, self._spec = plan, spec
        return plan

    # -- plans settled ahead ---------------------------------------------------------------------
    @eager_only
    def plan_ahead(self, next_step: Sequence[int] | Plan) -> None:
        """Settle the next step's plan during this one (:mod:`.ahead`). ``next_step``: this
        rank's lengths of the next step (as :meth:`plan` takes them), or the next step's
        :class:`Plan` made elsewhere (as :meth:`use_plan` takes it). No collective of its own:
        the request rides on this step's next agreement (its ``route``), which then gives every
        rank every rank's next lengths; the next plan is solved in a worker process meanwhile.
        The next :meth:`plan` (with the same lengths) or :meth:`use_plan` (with the same plan)
        then makes no collective. Call it on every rank alike, before ``route``; a bad request,
        or one some ranks did not make, raises on every rank at the next ``plan``/``use_plan``."""
        error, lens, plan, values = "", None, None, []
        if isinstance(next_step, Plan):
            plan = next_step
            try:
                if plan.num_ranks != self.layout.group_size:
                    raise ValueError(f"plan has {plan.num_ranks} ranks, the balancing group {self.layout.group_size}")
                plan.validate()
                prepared_spec(plan, self.group_rank)
                values = [digest62(plan.digest())]
            except (TypeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            kind = ahead.PLAN
        else:
            try:
                lens = list(validate_lengths(as_lengths(next_step), "next_step"))
                values = lens
            except (TypeError, ValueError) as exc:
                error = str(exc)
            kind = ahead.LENGTHS
        self._checks.ahead = ahead.AheadRequest(kind, values, error, lens=lens, plan=plan)

    def _settle_ahead(self, rows: list[list[int]], carried: ahead.AheadRequest | None) -> None:
        """An agreement carried requests (every rank runs this on the same rows): settle the
        next step, start its solve, and complete the previous step's telemetry."""
        settled, seconds = ahead.settle(
            rows, carried, lambda: gather_text(self._checks.control, carried.error if carried else "")
        )
        if settled.problem is None and settled.kind == ahead.LENGTHS:
            planner = self.planner()
            settled.future = self._solver.submit(planner, settled.lens, self.group_rank)
            settled.request.planner = planner  # what an inline re-solve uses
        self._checks.agreed_ahead = settled
        if seconds is not None and self._loop.ready_ahead:
            self._loop.finish_step(self._loop.measured(np.asarray(seconds, dtype=np.int64)))

    def _take_boundary_bits(self) -> int:
        """The previous step's seconds, closed at a plan made ahead (NaN bits if none)."""
        bits, self._boundary_bits = self._boundary_bits, None
        return bits if bits is not None else int(np.float64("nan").view(np.int64))

    def _take_ahead(self) -> ahead.Ahead | None:
        settled, self._checks.agreed_ahead = self._checks.agreed_ahead, None
        if settled is not None and settled.problem is not None:
            self._drop_plan()
            self._checks.ahead = None
            error_type, message = settled.problem
            raise error_type(f"{message} (this is rank {self.group_rank})")
        return settled

    def _plan_from_ahead(self, settled: ahead.Ahead, lens: list[int], error: str) -> Plan:
        """``plan`` after ``plan_ahead``: no collective; a rank whose lengths differ from its
        request defers the error, which every rank raises at the step's ``route``."""
        mine = settled.request
        if settled.kind != ahead.LENGTHS:
            self._checks.defer(
                f"rank {self.group_rank} called plan() where plan_ahead(plan) asked for use_plan(plan)", "divergent"
            )
        elif error or lens != mine.lens:
            got = error or f"{lens[:8]}{'...' if len(lens) > 8 else ''}"
            self._checks.defer(f"plan(local_seq_lens) got {got}, plan_ahead had {mine.lens[:8]}", "local_seq_lens")
        if settled.kind == ahead.PLAN:
            plan = mine.plan
        else:
            try:
                plan = self._solver.result(settled.future, mine.planner, settled.lens, self.group_rank)
            except ValueError as exc:  # e.g. an infeasible memory cap: the same on every rank
                self._drop_plan()
                raise BalancerInputError(f"SequenceBalancer.plan: {exc}") from exc
        # the previous step ends here (its seconds ride on the row of this step's route)
        self._boundary_bits = self._loop.seconds_bits()
        return self._start(plan)

    def _use_plan_from_ahead(self, settled: ahead.Ahead, plan: Plan) -> Plan:
        """``use_plan`` after ``plan_ahead(plan)``: no collective (the digest was agreed in the
        previous step's row). Another plan than the request's, or a request of lengths, is
        deferred and raised on every rank at the step's ``route`` (the step runs the agreed one)."""
        mine = settled.request
        if settled.kind != ahead.PLAN:
            self._checks.defer(
                f"rank {self.group_rank} called use_plan() where plan_ahead(lengths) asked for plan()", "divergent"
            )
            return self._plan_from_ahead(settled, list(mine.lens), "")
        if plan is not mine.plan and (not isinstance(plan, Plan) or plan.digest() != mine.plan.digest()):
            self._checks.defer(f"use_plan got another plan than plan_ahead on rank {self.group_rank}", "input")
        self._adopt(mine.plan, prepared_spec(mine.plan, self.group_rank), agreed=True)
        return mine.plan

    def _adopt(self, plan: Plan, spec: RouteSpec, *, agreed: bool) -> None:
        self._plan, self._spec = plan, spec
        self._checks.new_step(digest62(plan.digest()), agreed=agreed)

    def _drop_plan(self) -> None:
        self._plan = self._spec = None

    @property
    def current_plan(self) -> Plan:
        return self._require_spec()[0]

    @property
    def spec(self) -> RouteSpec:
        return self._require_spec()[1]

    def _require_spec(self) -> tuple[Plan, RouteSpec]:
        if self._plan is None or self._spec is None:
            raise RuntimeError("SequenceBalancer: call plan(local_seq_lens) before route/attention/reverse_route")
        return self._plan, self._spec

    # -- closed loop -----------------------------------------------------------------------------
    def on_step(self, callback) -> None:
        """Call ``callback(StepTelemetry)`` for every completed step (with ``measure``, a step
        completes at the next ``plan`` or at :meth:`flush`)."""
        self._loop.callbacks.append(callback)

    @eager_only
    def flush(self) -> StepTelemetry | None:
        """Complete the last step's telemetry now (collective: an agreement, and one small
        all-gather when telemetry is waiting) instead of at the next ``plan``; returns it.

        The agreement also raises, on every rank, an error deferred in this step (a bad layer
        found where no rendezvous follows): call it after ``backward()`` and before
        ``optimizer.step()`` to stop such a step before it changes the weights — one host
        rendezvous per step, which the next ``plan`` makes anyway otherwise."""
        self._checks.agree("flush", play=False)
        if not self._loop.waiting:
            return self.last_step
        bits = self._loop.drain_bits()
        k = len(bits) - 2 - (self._loop.timer.lag if self._loop.timer is not None else 0)
        if self._boundary_bits is not None and k >= 0:  # the step before a plan made ahead: closed there
            bits[k] = self._boundary_bits
        self._boundary_bits = None
        S = dist.get_world_size(self.group)
        table = gather_ints(self._checks.control, bits, [len(bits)] * S, "flush").reshape(S, len(bits))
        for j in range(table.shape[1]):  # oldest first
            self._loop.finish_step(self._loop.measured(table[:, j]))
        return self.last_step

    # -- resumable state -------------------------------------------------------------------------
    @eager_only
    def state_dict(self) -> dict:
        """What a resumed job needs to plan exactly as this one would: the step counter and the
        closed loop's fitted cost model, rank speeds and fit history. Collective: it completes
        the last step's telemetry first (:meth:`flush`), so the state is the same on every rank
        — save it from any one of them. Plain data (JSON-serialisable)."""
        self.flush()
        return {
            "version": STATE_VERSION,
            "step": self.num_plans,
            "group_size": self.layout.group_size,
            "closed_loop": self._loop.state_dict(),
        }

    @eager_only
    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` of another balancer (e.g. before a restart).
        Collective: every rank must load the same state (agreed; a rank that loaded another one,
        or a malformed state, raises on every rank). Saved on another number of ranks (a job
        resumed after a resize): the fitted cost model is kept, the saved per-rank speeds are
        dropped (this balancer's ``rank_speed`` setting plans instead), see
        :meth:`ClosedLoop.load_state_dict <knapformer.distributed.closed_loop.ClosedLoop.load_state_dict>`."""
        import json

        error = ""
        try:
            if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
                raise ValueError(f"not a SequenceBalancer state of version {STATE_VERSION}")
            saved = state.get("group_size")
            if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int) or saved < 1):
                raise ValueError(f"group_size must be a positive int, got {saved!r}")
            digest = json.dumps(state, sort_keys=True)
        except (TypeError, ValueError) as exc:
            error, digest = f"load_state_dict: {exc}", "?"
        self._checks.agree("load_state_dict", error, (("state", str(digest62(digest))),), play=False)
        self._loop.load_state_dict(state["closed_loop"], state.get("group_size"))
        self._checks.step = int(state["step"])

    # -- errors ----------------------------------------------------------------------------------
    def report_error(self, message: str) -> None:
        """Report a problem only this rank can see (e.g. a malformed sample): it is raised, as
        :class:`BalancerInputError` naming this rank and carrying ``message``, on every rank of
        the group at the next agreement (the step's first exchanging call, a call of a step
        that agrees call by call, ``flush`` or the next ``plan``), so the other ranks do not
        wait in an exchange this rank has left."""
        self._checks.defer(message)

    @eager_only
    def raise_everywhere(self, message: str) -> NoReturn:
        """Raise ``message`` now, on every rank of the group: this rank joins the agreement the
        others are entering at their next agreed call, and all of them raise
        :class:`BalancerInputError` with it. Meant for problems found before the step's first
        exchange (the families check their samples there): in a later step of a known kind,
        after its first exchange, the other ranks agree next at their next ``plan`` — use
        :meth:`report_error` there (the step then finishes on zeros)."""
        self._checks.defer(message)
        self._checks.agree("raise_everywhere")
        raise AssertionError("unreachable: the agreement raises")  # pragma: no cover

    # -- execution -------------------------------------------------------------------------------
    @eager_only
    def route(self, x: torch.Tensor, *features: torch.Tensor, seq_lens: Sequence[int] | None = None, names=None):
        """Move tokens (T, *F) to their planned ranks -> (R, *F); several tensors -> a tuple.
        One all_to_all_single per dtype; differentiable (backward = reverse exchange).
        ``seq_lens`` (optional): the lengths the tensors are laid out in, checked against the
        plan (catches a batch from another step with the same token count). ``names``
        (optional): what each tensor is, for error messages."""
        plan, spec = self._require_spec()
        tensors = (x, *features)
        error = ""
        if seq_lens is not None:
            planned = list(plan.seq_lens[self.group_rank])
            if [int(n) for n in seq_lens] != planned:
                error = f"the tensors are laid out as sequences {list(seq_lens)[:8]}..., planned {planned[:8]}..."
        # every route agrees (it opens a segment of the step: the rendezvous before its layers)
        tensors, _, _ = self._checks.once("route", tensors, spec.num_local, error=error, names=names)
        if self._devices is None:  # once: ranks on one GPU under NCCL, or on mixed devices, fail here
            self._check_devices(x.device)
        self._data_device = x.device
        out = ops.route(self._loop.on_route(tensors), spec, self.group)
        return out[0] if not features else tuple(out)

    def _skipped(self, tensors, rows: int) -> list[torch.Tensor]:
        """What a call that makes no exchange on this rank returns (its error is deferred):
        zeros of the caller's tensors' forms with ``rows`` rows, joined to the caller's tensors
        (so that its backward runs)."""
        device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), self._data_device)
        out = []
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                z = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
            else:
                z = torch.zeros((rows,), device=device)
            out.append(_tie(z, *tensors) if z.is_floating_point() else z)
        return out

    def _check_devices(self, device: torch.device) -> None:
        """Every rank's data device, gathered once (at the first route, before data moves): two
        ranks on one GPU under NCCL, or data on different kinds of device, raise on every rank."""
        import socket

        self._devices = gather_text(self._checks.control, f"{socket.gethostname()}/{device}")
        problem = device_problem(self._devices, uses_nccl(self.group))
        if problem:
            self._devices = None
            raise BalancerInputError(f"SequenceBalancer.route: {problem} (this is rank {self.group_rank})")

    @eager_only
    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor, names=None):
        """Inverse of :meth:`route`: (R, *F) -> (T, *F) in the caller's original order."""
        _, spec = self._require_spec()
        tensors = (y, *features)
        peers = spec.route_peers.peers
        tensors, verdict, skip = self._checks.once("reverse_route", tensors, spec.num_routed, names=names, peers=peers)
        if verdict == SKIP:
            out = self._skipped(tensors, spec.num_local)
        else:
            self._loop.on_reverse(y)
            out = ops.reverse_route(tensors, spec, self.group, skip)
        return out[0] if not features else tuple(out)

    @eager_only
    def gather_sequences(self, *per_seq: torch.Tensor, names=None) -> tuple[torch.Tensor, ...]:
        """Per-sequence rows, in group sequence-id order: (n_local, *F) each -> (n_group, *F),
        indexable by ``routed_positions()[0]``. A rank gets the rows of its own sequences and
        of every sequence it holds tokens of (all a routed token can index); the other rows
        are zero. Differentiable; one exchange per dtype, with the owners and holders of those
        sequences only. Use it for conditioning (timestep/AdaLN vectors, text lengths); rows on
        the host (CPU tensors) are exchanged on the host, even beside a GPU data group."""
        plan, spec = self._require_spec()
        n_local = len(plan.seq_lens[self.group_rank])
        peers = ops.sequence_rows_peers(spec, plan).peers
        per_seq, verdict, skip = self._checks.once("gather_sequences", per_seq, n_local, names=names, peers=peers)
        if verdict == SKIP:
            return tuple(self._skipped(per_seq, plan.index.num_seqs))
        # host rows (counts, lengths) travel over the host control group: on the data group's
        # device they would cost a copy there and a read back (a device synchronisation)
        on_host = bool(per_seq) and all(t.device.type == "cpu" for t in per_seq)
        group = self._checks.control if on_host else self.group
        return tuple(ops.gather_sequences(per_seq, spec, plan, group, skip))

    @eager_only
    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Send each local sequence's context (``lens[i]`` rows of ``context`` for local
        sequence i, e.g. its embedded text) to every rank of the group that holds queries of
        that sequence, once per step; every layer's :meth:`cross_attention` reuses the result.
        Differentiable (a context sent to several ranks gets the sum of their gradients).
        Exchanges, with the owners and holders of the sequences only: the context lengths (on
        the host), then the rows."""
        return cross.route_context(self, context, lens)

    def routed_positions(self, device: torch.device | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per routed token: global sequence id in the group (rank-major) and position (int64),
        on ``device`` — or on the device of a tensor of the routed tokens, which under
        ``torch.compile`` keeps the call in the graph (an operator shaped like that tensor)."""
        if isinstance(device, torch.Tensor):
            if torch.compiler.is_compiling():
                return compiled.routed_positions(device, self._opaque)
            device = device.device
        return self._positions_eager(device)

    def present_sequences(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(P,) group sequence ids with routed tokens here (ascending) and (R,) each routed
        token's row among them; from the plan on the host, uploaded once per plan (no device
        synchronisation)."""
        _, spec = self._require_spec()
        idx = spec.indices_on(torch.device("cpu") if device is None else torch.device(device))
        return idx["present"], idx["slot"]

    def _positions_eager(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        _, spec = self._require_spec()
        if device is None:
            return spec.routed_seq_id, spec.routed_pos
        idx = spec.indices_on(device)
        return idx["routed_seq_id"], idx["routed_pos"]

    # -- attention --------------------------------------------------------------------------------
    def _pre(self, q, k, v, op: str, causal: bool) -> ulysses.UlyssesCall | None:
        """Check a layer's q, k, v and run the pre-attention exchange; None when this rank ran
        the scheduled call on zeros instead (its error is deferred)."""
        _, spec = self._require_spec()
        q, k, v = autocast_inputs(q, k, v)
        error = attention_problem(q, k, v, spec.num_routed, self.group_rank)
        call = LayerCall(op, causal=causal) if error else LayerCall.of(op, (q, k, v), causal)
        played = self._checks.layer(call, error)
        if played is not None:
            self._played = None if played == SKIP else self._play(played, (q, k, v))
            return None
        kind = "input"
        if not error:
            error = self._plan_problem(op, q.shape[1], k.shape[1], causal)
            kind = "plan"
            if error and self._checks.agreed:  # the shapes agree: every rank raises it here, before data moves
                self._checks.fail()
                raise InvalidPlanError(error)
        if error:  # a plan problem in a scheduled segment (an agreed call raised already): the peers
            self._checks.peer_check(spec.layer_peers, op, (), error, kind)  # learn it from the header and
            self._played = None  # leave this rank out
            return None
        return self._pre_run(q, k, v, op, causal, call.values())

    def _plan_problem(self, op: str, h: int, h_kv: int, causal: bool) -> str:
        """Why this plan cannot run a layer of ``h``/``h_kv`` heads through ``op`` ("" if it
        can): heads its groups cannot split, a ring plan on the other attention path, gathered
        keys and values over the memory cap. Computed once per plan and head configuration (a
        layer's host work does not grow with the group)."""
        plan, spec = self._require_spec()
        key = ("plan problem", op, h, h_kv, causal, self.config.attn_path)
        if key not in spec.cache:
            problem = ulysses.check_heads(h, h_kv, spec)
            problem = f"SequenceBalancer.{op}: the plan cannot run these heads: {problem}" if problem else ""
            if not problem and spec.ring_rounds > 1:  # the plan and the settings are the same on every rank
                try:
                    self._check_ring_path(op, plan, h, h_kv, causal)
                except InvalidPlanError as exc:
                    problem = str(exc)
            spec.cache[key] = problem
        return spec.cache[key]

    def _pre_run(self, q, k, v, op: str, causal: bool, values: tuple) -> ulysses.UlyssesCall:
        plan, spec = self._require_spec()
        self._data_device = q.device
        self._loop.note_bytes(q.element_size())  # the agreed dtype: the next plans price it
        if op == "pre_attn" and self.config.attn_path == "auto":
            self._kv_gather = True  # the plans from now on price the all-gather (every rank is here)
        skip = self._checks.peer_check(spec.layer_peers, op, values) if spec.layer_peers else frozenset()
        return ulysses.pre_attn_batches(q, k, v, spec, self.group, skip)

    def _play(self, entry: LayerCall | OnceCall, like=()) -> torch.Tensor | VarlenArgs | None:
        """Run scheduled call ``entry`` on zeros: this rank makes the exchanges every other rank
        makes now (its own call was different, or bad; the step raises at its next agreement).
        ``like``: this rank's own tensors, whose autograd graphs the zeros join."""
        if isinstance(entry, OnceCall):
            return self._play_once(entry)
        _, spec = self._require_spec()
        device = next((t.device for t in _tensors(*like)), self._data_device)
        if entry.op == "post_attn":
            call, self._call = self._call, None
            if call is None:  # no pre_attn to invert: there is no exchange to join
                return None
            # the kernel's output on zeros, hanging off its inputs (the pre exchange's: its backward runs
            # after this call's, as the peers' do) and the caller's tensors
            inputs = [b.q for b in call.batches if b.q.requires_grad]
            o = _tie(torch.zeros(ulysses.output_shape(call), dtype=call.dtype, device=device), *like, *inputs[:1])
            return self._post_run(call, ulysses.unflatten_pairs(kv_gather.join_backward(o, call.kv_token), call))
        q, k, v = (
            _tie(torch.zeros((spec.num_routed, *shape), dtype=dtype, device=device), *like)
            for dtype, shape in entry.tensors
        )
        if torch.is_grad_enabled() and not q.requires_grad and q.is_floating_point():
            q = q.requires_grad_()  # a backward of its own: the peers run this call's backward exchanges
        problem = self._plan_problem(entry.op, q.shape[1], k.shape[1], entry.causal)
        if problem:  # this plan cannot run the scheduled heads: deferred, and the peers leave this rank out
            self._checks.peer_check(spec.layer_peers, entry.op, (), problem, "plan")
            self._call = None
            return None
        if entry.op == "attention":
            return self._attention_run(self._pre_run(q, k, v, "attention", entry.causal, entry.values()), entry.causal)
        call = self._pre_run(q, k, v, "pre_attn", entry.causal, entry.values())
        if spec.in_ring:
            call = kv_gather.gather_kv(call, spec, self.group, entry.causal)
        self._call = call
        return ulysses.flatten_pairs(call)

    def _play_once(self, entry: OnceCall) -> torch.Tensor | None:
        """A scheduled ``reverse_route``/``gather_sequences``/``route_context`` this rank did not
        make, run on zeros of the schedule's form (its peers are in its exchanges). Returns a
        scalar hanging off what it computed (for its backward), or None."""
        plan, spec = self._require_spec()
        n_local = len(plan.seq_lens[self.group_rank])
        rows = {"reverse_route": spec.num_routed}.get(entry.op, n_local)
        zeros = [torch.zeros((rows, *shape), dtype=dtype, device=self._data_device) for dtype, shape in entry.tensors]
        if torch.is_grad_enabled() and entry.needs:
            for dtype in {z.dtype for z in zeros if z.is_floating_point()}:  # one leaf per exchanged dtype
                i = next(i for i, z in enumerate(zeros) if z.dtype == dtype)
                zeros[i] = zeros[i].requires_grad_()
        if entry.op == "reverse_route":
            skip = self._checks.peer_check(spec.route_peers.peers, entry.op, entry.values)
            out = ops.reverse_route(zeros, spec, self.group, skip)
        elif entry.op == "gather_sequences":
            skip = self._checks.peer_check(ops.sequence_rows_peers(spec, plan).peers, entry.op, entry.values)
            out = ops.gather_sequences(zeros, spec, plan, self.group, skip)
        elif entry.op == "route_context":
            skip = self._checks.peer_check(cross.context_size_peers(plan, spec), entry.op, entry.values)
            out = [cross.route_context_rows(self, plan, spec, zeros[0], [1] * n_local, skip).rows]
        else:  # route opens a segment (agreed): never played
            raise AssertionError(f"a scheduled {entry.op} is not played")
        floats = [o for o in out if o.is_floating_point() and o.requires_grad]
        return sum((o.sum() * 0 for o in floats[1:]), floats[0].sum() * 0) if floats else None

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
            z = _tie(z, q, k, v, self._played)  # what ran instead (an attention call) joins the graph
            cu = torch.tensor([0, z.shape[0]], dtype=torch.int32, device=z.device)
            return VarlenArgs(z, z, z, cu, cu, z.shape[0], z.shape[0])
        if spec.in_ring:  # with this rank's ring peers
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
        if entry == SKIP:  # a call beyond the schedule: no exchange (its error is deferred)
            self._call = self._expected = None
            _, spec = self._require_spec()
            shape = mine or (
                (spec.num_routed, call.heads[0], call.heads[3]) if call is not None else (spec.num_routed, 1, 1)
            )
            dtype = o.dtype if isinstance(o, torch.Tensor) and o.is_floating_point() else torch.float32
            return _tie(torch.zeros(shape, dtype=dtype, device=self._data_device), o)
        if entry is None and error:  # a scheduled segment (an agreed call raised already)
            self._call = self._expected = None
            _, spec = self._require_spec()
            if call is None:  # its pre_attn made no exchange (its error is deferred): neither does this
                shape = mine or (spec.num_routed, 1, 1)
                return _tie(torch.zeros(shape, dtype=self._expected_dtype(o), device=self._data_device), o)
            # the peers wait for this rank's outputs: zeros of the kernel output's form go instead
            self._checks.defer(f"post_attn on rank {self.group_rank} (step {self._checks.step}): {error}")
            z = _tie(torch.zeros(ulysses.output_shape(call), dtype=call.dtype, device=self._data_device), o)
            out = self._post_run(call, ulysses.unflatten_pairs(kv_gather.join_backward(z, call.kv_token), call))
            return out if mine is None else _tie(torch.zeros(mine, dtype=out.dtype, device=out.device), out)
        if entry is None:
            self._call = self._expected = None
            out = self._post_run(call, ulysses.unflatten_pairs(kv_gather.join_backward(o, call.kv_token), call))
            if mine is None:
                return out
            return _tie(torch.zeros(mine, dtype=out.dtype, device=out.device), out)
        played = self._play(entry, _tensors(o))
        if entry.op != "pre_attn":  # a played pre_attn leaves its call for the post_attn scheduled next
            self._call = None
        self._expected = None
        _, spec = self._require_spec()
        shape = mine or (
            (spec.num_routed, call.heads[0], call.heads[3]) if call is not None else (spec.num_routed, 1, 1)
        )
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
        if spec.in_ring:  # rounds with this rank's ring peers
            outs, call.anchor = ring.ring_attention(
                call.batches, outs, call.anchor, spec.ring_rounds, spec.rank, self.group, causal, backend, call.skip
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


def _tensors(*ts) -> list[torch.Tensor]:
    return [t for t in ts if isinstance(t, torch.Tensor)]


def _tie(out: torch.Tensor, *ts) -> torch.Tensor:
    """``out`` joined to the autograd graphs of ``ts`` (added zero; a played ``pre_attn``'s
    arguments count by their tensors): a rank that runs a call on zeros still runs the backward
    exchanges its peers run through theirs."""
    for t in ts:
        if isinstance(t, VarlenArgs):
            out = _tie(out, t.q, t.k, t.v)
        elif isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            out = out + 0 * t.sum().to(out.dtype)
    return out


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
