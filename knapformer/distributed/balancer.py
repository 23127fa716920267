"""``SequenceBalancer``: the per-step handle a model calls (plan, route, attention, reverse).

    bal = SequenceBalancer("g1n2+g2n1", WorkloadModel(d_model=64))   # after init_process_group
    plan = bal.plan(local_seq_lens)         # collective over the balancing group
    y = bal.route(x)                        # (sum(local_seq_lens), *F) -> routed tokens
    o = bal.attention(q, k, v)              # (R, h, D) -> (R, h, Dv), Ulysses inside groups
    x2 = bal.reverse_route(y)               # back to the caller's order

It implements :class:`~knapformer.executor.TokenExecutor` over torch.distributed. Planning is
done independently on every rank from the same gathered lengths (no rank-0 broadcast). The
concerns live in their own modules: the settings and groups agreed at construction
(:mod:`.settings`), the checks and agreement every exchange joins (:mod:`.checks`: bad input on
one rank, or ranks at different calls, raise the same error on every rank before data moves),
the closed loop (:mod:`.closed_loop`), context and cross-attention (:mod:`.cross`), the route
spec (:mod:`.spec`) and the Ulysses exchanges (:mod:`.ulysses`).

Devices come from tensors (index tensors are copied to the tensor's device once per plan);
collectives use the group's backend: gloo for CPU tensors, NCCL for CUDA tensors.
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

import knapformer.distributed.compiled as compiled
import knapformer.distributed.cross as cross
import knapformer.distributed.ops as ops
import knapformer.distributed.trace as trace
import knapformer.distributed.ulysses as ulysses
from knapformer.config import BalancerConfig
from knapformer.distributed.agree import digest62, gather_ints, gather_text, group_device
from knapformer.distributed.attention_calls import AttentionCalls
from knapformer.distributed.backends import data_device, device_problem, uses_nccl
from knapformer.distributed.checks import StepChecks, as_lengths
from knapformer.distributed.closed_loop import ClosedLoop
from knapformer.distributed.compiled import eager_only
from knapformer.distributed.link_probe import measure_link
from knapformer.distributed.settings import agree_settings, asked_group, resolve_groups
from knapformer.distributed.spec import RouteSpec, build_route_spec
from knapformer.errors import BalancerConfigError, BalancerInputError, PlanMismatchError
from knapformer.executor.opaque import owner_handle
from knapformer.executor.protocol import RoutedContext
from knapformer.layout import AutoLayout, BagLayout
from knapformer.plan import Plan, PlanProblem, get_solver
from knapformer.plan.cost import LinkModel
from knapformer.plan.problem import ValidLens, validate_lengths
from knapformer.telemetry import StepTelemetry
from knapformer.workload import WorkloadModel

__all__ = ["STATE_VERSION", "BalancerConfigError", "BalancerInputError", "PlanMismatchError", "SequenceBalancer"]

_log = logging.getLogger("knapformer")

STATE_VERSION = 1
"""Version of :meth:`SequenceBalancer.state_dict`'s format."""


class SequenceBalancer(AttentionCalls):
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

    def online_model(self) -> WorkloadModel:
        """The cost model the next plan uses (the online fit's, with ``recalibrate``); save it
        with ``WorkloadModel.save`` to start another job from it (a profile)."""
        return self._loop.planning.cost  # type: ignore[return-value]

    # -- planning --------------------------------------------------------------------------------
    @eager_only
    def plan(self, local_seq_lens: Sequence[int]) -> Plan:
        """Gather every rank's lengths, plan, and build this rank's route spec. Collective over
        the balancing group (an agreement, then two all-gathers); returns the same
        :class:`Plan` on every rank. ``local_seq_lens``: a list, a numpy array or a 1-D integer
        tensor of this rank's sequence lengths (empty is fine)."""
        with trace.span(trace.PLAN):
            return self._plan_step(local_seq_lens)

    def _plan_step(self, local_seq_lens: Sequence[int]) -> Plan:
        S = self.layout.group_size
        control = self._checks.control  # host tensors (the group's gloo, or its gloo twin): no device sync
        error, lens = "", []
        try:
            lens = list(validate_lengths(as_lengths(local_seq_lens), "local_seq_lens"))
        except ValueError as exc:
            error = str(exc)
        try:
            self._checks.agree("plan", error, what="local_seq_lens", play=False)
        except BalancerInputError:
            self._drop_plan()
            raise
        # the previous step's measured seconds ride on the gather of the lengths' counts
        heads = gather_ints(control, [len(lens), self._loop.seconds_bits()], [2] * S, "plan").reshape(S, 2)
        if self._loop.ready:  # the previous step's telemetry (with CUDA events: the one before)
            self._loop.finish_step(self._loop.measured(heads[:, 1]))
        counts = heads[:, 0].tolist()
        flat = gather_ints(control, lens, counts, "plan").tolist()
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        all_lens = ValidLens(tuple(flat[offsets[r] : offsets[r + 1]]) for r in range(S))
        cfg = self._loop.planning
        problem = PlanProblem(  # lengths were validated on their own ranks and agreed above
            seq_lens=all_lens,
            layout=cfg.layout,
            model=cfg.cost,
            max_tokens_per_rank=cfg.max_tokens_per_rank,
            rank_speed=cfg.rank_speed,
            options=cfg.solver_options,
            link=cfg.link,
            kv_gather=self._kv_gather,
        )
        try:
            plan = get_solver(cfg.solver)(problem, time_budget_s=cfg.time_budget_s)
        except ValueError as exc:  # e.g. an infeasible memory cap: the same on every rank
            self._drop_plan()
            raise BalancerInputError(f"SequenceBalancer.plan: {exc}") from exc
        self._adopt(plan, build_route_spec(plan, self.group_rank), agreed=False)
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
        error, spec = "", None
        try:
            if not isinstance(plan, Plan):
                raise TypeError(f"use_plan needs a Plan, got {type(plan).__name__}")
            if plan.num_ranks != self.layout.group_size:
                raise ValueError(f"plan has {plan.num_ranks} ranks, the balancing group {self.layout.group_size}")
            plan.validate()
            spec = build_route_spec(plan, self.group_rank)
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
        """Complete the last step's telemetry now (collective: an agreement and one small
        all-gather) instead of at the next ``plan``; returns it."""
        if not self._loop.waiting:
            return self.last_step
        self._checks.agree("flush", play=False)
        bits = self._loop.drain_bits()
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
        the group at the next agreement (the next exchange or ``plan``), so the other ranks do
        not wait in a collective this rank has left."""
        self._checks.defer(message)

    @eager_only
    def raise_everywhere(self, message: str) -> NoReturn:
        """Raise ``message`` now, on every rank of the group: this rank joins the agreement the
        others are entering at their next exchange, and all of them raise
        :class:`BalancerInputError` with it."""
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
        tensors = self._checks.tensors("route", tensors, spec.num_local, error=error, names=names)
        if self._devices is None:  # once: ranks on one GPU under NCCL, or on mixed devices, fail here
            self._check_devices(x.device)
        self._data_device = x.device
        out = ops.route(self._loop.on_route(tensors), spec, self.group)
        return out[0] if not features else tuple(out)

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
        tensors = self._checks.tensors("reverse_route", tensors, spec.num_routed, names=names)
        self._loop.on_reverse(y)
        out = ops.reverse_route(tensors, spec, self.group)
        return out[0] if not features else tuple(out)

    @eager_only
    def gather_sequences(self, *per_seq: torch.Tensor, names=None) -> tuple[torch.Tensor, ...]:
        """Per-sequence rows of every rank of the group, in group sequence-id order: (n_local,
        *F) each -> (n_group, *F), indexable by ``routed_positions()[0]``. Differentiable; one
        collective per dtype. Use it for conditioning (timestep/AdaLN vectors, text lengths)."""
        plan, _ = self._require_spec()
        counts = plan.index.counts.tolist()
        per_seq = self._checks.tensors("gather_sequences", per_seq, counts[self.group_rank], names=names)
        return tuple(ops.gather_sequences(per_seq, counts, self.group_rank, self.group))

    @eager_only
    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Send each local sequence's context (``lens[i]`` rows of ``context`` for local
        sequence i, e.g. its embedded text) to every rank of the group that holds queries of
        that sequence, once per step; every layer's :meth:`cross_attention` reuses the result.
        Differentiable (a context sent to several ranks gets the sum of their gradients).
        Collectives: the agreement, a gather of the lengths, and one all-to-all unless every
        context stays on its own rank."""
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

    def _positions_eager(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        _, spec = self._require_spec()
        if device is None:
            return spec.routed_seq_id, spec.routed_pos
        idx = spec.indices_on(device)
        return idx["routed_seq_id"], idx["routed_pos"]
