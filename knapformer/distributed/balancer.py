"""``SequenceBalancer``: the per-step handle a model calls (plan, route, attention, reverse).

    bal = SequenceBalancer("g1n2+g2n1", WorkloadModel(d_model=64))   # after init_process_group
    plan = bal.plan(local_seq_lens)         # collective over the balancing group
    y = bal.route(x)                        # (sum(local_seq_lens), *F) -> routed tokens
    o = bal.attention(q, k, v)              # (R, h, D) -> (R, h, D), Ulysses inside groups
    x2 = bal.reverse_route(y)               # back to the caller's order

Planning is done independently on every rank from the same gathered lengths (no rank-0
broadcast). What shapes a collective is agreed before data moves (:mod:`.agree`), so bad
input on one rank raises a clear error on every rank instead of a hang or an abort:

- at construction: the balancer's settings (one all-gather of their digests);
- in ``plan``: every rank's lengths are validated (the gather that collects them carries the
  error flags);
- at the first exchange after a new plan: the plan's digest (ranks holding different plans
  raise :class:`PlanMismatchError`); ``use_plan`` agrees at once;
- at every ``route``/``reverse_route``/``gather_sequences``: this rank's rows, and the dtypes
  and trailing shapes of the tensors, in the flag exchange that precedes the data;
- per attention layer, locally: the first ``pre_attn`` of a plan agrees on the attention
  shapes (heads, kv heads, head dim, dtype); later layers compare with them for free, and a
  rank that finds a problem joins the exchange with well-formed zeros and raises at the next
  agreement point (``reverse_route``, ``route``, ``plan``) together with every other rank.
  ``debug=True`` agrees on every layer instead (a host sync per layer).

Devices come from tensors (index tensors are copied to the tensor's device once per plan);
collectives use the group's backend: gloo for CPU tensors, NCCL for CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from knapformer.attention import varlen_attention
from knapformer.config import BalancerConfig
from knapformer.distributed import ops, ulysses
from knapformer.distributed.agree import agree, digest62, group_device
from knapformer.distributed.context import build_context_route
from knapformer.distributed.errors import BalancerConfigError, BalancerInputError, PlanMismatchError
from knapformer.distributed.spec import RouteSpec, build_route_spec
from knapformer.distributed.timing import StepTimer
from knapformer.layout import AutoLayout, BagLayout
from knapformer.models.executor import RoutedContext, context_problem, cross_attend, cross_problem, routed_context
from knapformer.plan import Plan, PlanProblem, get_solver
from knapformer.plan.online import Observation, OnlineFit
from knapformer.plan.problem import ValidLens, validate_lengths
from knapformer.telemetry import StepTelemetry, imbalance
from knapformer.workload import WorkloadModel

__all__ = ["BalancerConfigError", "BalancerInputError", "PlanMismatchError", "SequenceBalancer"]


def _signature(tensors: Sequence[torch.Tensor]) -> str:
    """What must match across ranks for tensors exchanged together: dtypes, trailing shapes."""
    return ";".join(f"{t.dtype}{tuple(t.shape[1:])}" for t in tensors)


class SequenceBalancer:
    """Plans and executes sequence balancing for one balancing group per replica.

    Build it from a :class:`~knapformer.config.BalancerConfig`, or with the layout and cost
    model positionally and the other settings as keywords (the same fields)::

        SequenceBalancer(BalancerConfig(layout="g2n4", cost=model, max_tokens_per_rank=8192))
        SequenceBalancer("g2n4", model, max_tokens_per_rank=8192)

    Construction is a collective over the world (or ``group``): every rank must build its
    balancer at the same point, with the same settings (checked)."""

    def __init__(
        self,
        layout: str | BagLayout | BalancerConfig,
        model: WorkloadModel | str | os.PathLike | None = None,
        group: dist.ProcessGroup | None = None,
        **settings,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SequenceBalancer needs torch.distributed: call init_process_group first")
        local_error, config = "", None
        try:
            if isinstance(layout, BalancerConfig):
                if model is not None or settings:
                    raise TypeError("pass either a BalancerConfig or layout, model and settings, not both")
                config = layout
            else:
                if model is None:
                    raise TypeError("SequenceBalancer needs a cost model (a WorkloadModel or a profile path)")
                config = BalancerConfig(layout=layout, cost=model, **settings)
        except (TypeError, ValueError) as exc:
            local_error = f"{type(exc).__name__}: {exc}"
        agree_group = dist.group.WORLD if group is None else group
        self._agree_config(agree_group, config, local_error)
        assert config is not None
        # layout "auto" without a size spans the given group, or the whole world
        config = config.resolved(dist.get_world_size(agree_group))
        if config.rank_speed is not None and len(config.rank_speed) != config.layout.group_size:
            raise ValueError(f"rank_speed has {len(config.rank_speed)} entries for {config.layout.group_size} ranks")
        self.config = config
        S = config.layout.group_size
        if group is None:
            world = dist.get_world_size()
            replicas = config.layout.replica_ranks(world)  # the same error on every rank (settings agree)
            if len(replicas) == 1:
                group = dist.group.WORLD
            else:
                # every rank creates every replica's group, in the same order (collective)
                mine = None
                for ranks in replicas:
                    g = dist.new_group(ranks)
                    if dist.get_rank() in ranks:
                        mine = g
                group = mine
        elif dist.get_world_size(group) != S:
            raise ValueError(
                f"process group has {dist.get_world_size(group)} ranks but layout {config.layout.spec()!r} needs {S}"
            )
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.num_plans = 0
        """Plans made or adopted so far (one per step in a training loop)."""
        self._plan: Plan | None = None
        self._spec: RouteSpec | None = None
        self._digest = 0
        self._agreed = False  # the current plan's digest has been agreed across ranks
        self._attn_sig: tuple | None = None  # agreed (heads, kv heads, head dim, dtype) of this plan
        self._pending = ""  # a local problem found where no agreement was possible; raised at the next one
        self._call: ulysses.UlyssesCall | None = None  # the last pre_attn, for post_attn
        # -- closed loop: timing, online fit, telemetry
        self._timer = StepTimer() if config.measure else None
        self._fit = (
            OnlineFit(
                prior=config.cost,
                window=config.recalibrate_window,
                warmup=config.recalibrate_warmup,
                estimate_speed=config.estimate_speed,
            )
            if config.recalibrate
            else None
        )
        self._callbacks: list = []
        self._record: StepTelemetry | None = None  # this step's record, waiting for its measurement
        self._bytes_per_token = 0
        self.last_step: StepTelemetry | None = None
        """The last completed step's telemetry (measured when ``measure`` is on)."""

    # -- settings --------------------------------------------------------------------------------
    @staticmethod
    def _agree_config(group, config: BalancerConfig | None, local_error: str) -> None:
        """One all-gather of every setting's digest (and an error flag) over ``group``."""
        names = list(BalancerConfig.__dataclass_fields__)
        mine = [1 if local_error else 0] + (config.setting_digests() if config is not None else [0] * len(names))
        device = group_device(group)
        t = torch.tensor(mine, dtype=torch.int64, device=device)
        rows = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, t, group=group)
        table = torch.stack(rows).cpu().tolist()
        me = dist.get_rank(group)
        bad = [r for r, row in enumerate(table) if row[0]]
        if bad:
            raise BalancerConfigError(
                f"SequenceBalancer: invalid settings on rank(s) {bad} (this is rank {me})"
                + (f": {local_error}" if local_error else "")
            )
        differs = []
        for i, name in enumerate(names):
            ranks = [r for r, row in enumerate(table) if row[1 + i] != table[0][1 + i]]
            if ranks:
                value = config.settings()[name] if config is not None else "?"
                differs.append(f"{name!r} differs on rank(s) {ranks} from rank 0 (this rank {me} has {value})")
        if differs:
            raise BalancerConfigError(
                "SequenceBalancer: ranks were built with different settings: " + "; ".join(differs)
            )

    @property
    def layout(self) -> BagLayout | AutoLayout:
        return self.config.layout  # type: ignore[return-value]

    @property
    def model(self) -> WorkloadModel:
        """The planner's cost model."""
        return self.config.cost  # type: ignore[return-value]

    @property
    def debug(self) -> bool:
        return self.config.debug

    # -- planning --------------------------------------------------------------------------------
    def plan(self, local_seq_lens: Sequence[int]) -> Plan:
        """Gather every rank's lengths (two all-gathers), plan, and build this rank's route spec.
        Collective over the balancing group; returns the same :class:`Plan` on every rank."""
        device = group_device(self.group)
        S = self.layout.group_size
        error, lens = self._pending, []
        if not error:
            try:
                lens = list(validate_lengths(local_seq_lens, "local_seq_lens"))
            except ValueError as exc:
                error = str(exc)
        # the previous step's measured seconds ride on the gather of the lengths' counts
        seconds = self._timer.seconds() if self._timer is not None else float("nan")
        bits = torch.tensor([seconds], dtype=torch.float64).view(torch.int64).item()
        head = torch.tensor([len(lens), 1 if error else 0, bits], dtype=torch.int64, device=device)
        heads = [torch.empty_like(head) for _ in range(S)]
        dist.all_gather(heads, head, group=self.group)
        heads_t = torch.stack(heads).cpu()
        if self._record is not None:  # complete and emit the previous step's telemetry
            measured = heads_t[:, 2].clone().view(torch.float64).tolist() if self._timer is not None else None
            self._finish_step(measured)
        bad = heads_t[:, 1].nonzero().flatten().tolist()
        if bad:
            self._pending = ""
            self._drop_plan()
            msg = error or f"see the error raised on rank {bad[0]}"
            raise BalancerInputError(
                f"SequenceBalancer.plan: bad local_seq_lens on rank(s) {bad} (this is rank {self.group_rank}): {msg}"
            )
        counts = heads_t[:, 0].tolist()
        width = max(max(counts), 1)
        padded = torch.zeros(width, dtype=torch.int64, device=device)
        if lens:
            padded[: len(lens)] = torch.tensor(lens, dtype=torch.int64)
        gathered = [torch.empty_like(padded) for _ in range(S)]
        dist.all_gather(gathered, padded, group=self.group)
        all_lens = ValidLens(tuple(g[:c].tolist()) for g, c in zip(torch.stack(gathered).cpu(), counts))
        cfg = self.config
        problem = PlanProblem(  # lengths were validated on their own ranks and agreed above
            seq_lens=all_lens,
            layout=cfg.layout,
            model=cfg.cost,
            max_tokens_per_rank=cfg.max_tokens_per_rank,
            rank_speed=cfg.rank_speed,
            options=cfg.solver_options,
            link=cfg.link,
        )
        try:
            plan = get_solver(cfg.solver)(problem, time_budget_s=cfg.time_budget_s)
        except ValueError as exc:  # e.g. an infeasible memory cap: the same on every rank
            self._drop_plan()
            raise BalancerInputError(f"SequenceBalancer.plan: {exc}") from exc
        self._adopt(plan, build_route_spec(plan, self.group_rank), agreed=False)
        if self.debug:
            self._agree("plan")
        self._start_step(plan)
        return plan

    # -- closed loop -----------------------------------------------------------------------------
    def on_step(self, callback) -> None:
        """Call ``callback(StepTelemetry)`` for every completed step (with ``measure``, a step
        completes at the next ``plan`` or at :meth:`flush`)."""
        self._callbacks.append(callback)

    def _start_step(self, plan: Plan) -> None:
        cfg = self.config
        model = cfg.cost
        in_seconds = str(model.meta.get("units", "")).startswith("seconds")
        self._record = StepTelemetry(
            step=self.num_plans,
            layout=cfg.layout.spec(),
            solver=plan.solver,
            plan_ms=1e3 * plan.plan_seconds,
            predicted=plan.time_after.tolist(),
            predicted_s=(
                ((plan.time_after + float(model.meta.get("per_call_seconds", 0.0))) * model.num_layers).tolist()
                if in_seconds
                else None
            ),
            measured_s=None,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            measured_imbalance=None,
            gap_to_bound=plan.gap_to_bound,
            tokens_moved=plan.tokens_moved,
            bytes_moved=0,
            coefficients={
                "linear": model.linear_coef,
                "quadratic": model.quad_coef,
                "per_seq": model.per_seq_coef,
                "units": model.meta.get("units", "cost units"),
            },
            rank_speed=list(cfg.rank_speed) if cfg.rank_speed is not None else None,
        )
        if self._timer is None:  # nothing to wait for
            self._finish_step(None)

    def _finish_step(self, measured: list[float] | None) -> None:
        record = dataclasses.replace(
            self._record,
            measured_s=measured,
            measured_imbalance=imbalance(measured) if measured is not None else None,
            bytes_moved=self._record.tokens_moved * self._bytes_per_token,
        )
        self._record = None
        if self._fit is not None and measured is not None and self._plan is not None:
            self._fit.add(Observation(self._plan.features(), np.asarray(measured, dtype=np.float64)))
            self._recalibrate()
        self.last_step = record
        for cb in self._callbacks:
            cb(record)

    def _recalibrate(self) -> None:
        """Plan the next steps with the model (and speeds) fitted to the measured steps."""
        cfg = self.config
        model, speeds = self._fit.fit(cfg.rank_speed if cfg.estimate_speed else None)
        changes = {"cost": model}
        if speeds is not None:
            changes["rank_speed"] = tuple(float(s) for s in speeds)
        if cfg.link is not None and model is not self._fit.prior:
            changes["link"] = dataclasses.replace(cfg.link, units_per_second=1.0)  # the fit is in seconds
        self.config = dataclasses.replace(cfg, **changes)

    def flush(self) -> StepTelemetry | None:
        """Complete the last step's telemetry now (collective: one small all-gather) instead
        of at the next ``plan``; returns it."""
        if self._record is None:
            return self.last_step
        seconds = self._timer.seconds() if self._timer is not None else float("nan")
        t = torch.tensor([seconds], dtype=torch.float64, device=group_device(self.group))
        rows = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, t, group=self.group)
        self._finish_step(torch.cat(rows).cpu().tolist() if self._timer is not None else None)
        return self.last_step

    def online_model(self) -> WorkloadModel:
        """The cost model the next plan uses (the online fit's, with ``recalibrate``); save it
        with ``WorkloadModel.save`` to start another job from it (a profile)."""
        return self.config.cost  # type: ignore[return-value]

    def use_plan(self, plan: Plan) -> Plan:
        """Execute a plan made elsewhere (any groups of ranks: non-contiguous, overlapping,
        different every step). Collective: every rank must pass the identical plan; it is
        validated and its digest agreed before use, so a bad or different plan raises on every
        rank. The local tensors must follow ``plan.seq_lens[group_rank]``."""
        error, spec = self._pending, None
        if not error:
            try:
                if not isinstance(plan, Plan):
                    raise TypeError(f"use_plan needs a Plan, got {type(plan).__name__}")
                if plan.num_ranks != self.layout.group_size:
                    raise ValueError(f"plan has {plan.num_ranks} ranks, the balancing group {self.layout.group_size}")
                plan.validate()
                spec = build_route_spec(plan, self.group_rank)
            except (TypeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._pending = ""
        digest = digest62(plan.digest()) if spec is not None else 0
        try:
            agree(self.group, "SequenceBalancer.use_plan", error, {"plan": digest})
        except BalancerInputError:
            self._drop_plan()
            raise
        self._adopt(plan, spec, agreed=True)
        return plan

    def _adopt(self, plan: Plan, spec: RouteSpec, *, agreed: bool) -> None:
        self._plan, self._spec = plan, spec
        self._digest = digest62(plan.digest())
        self._agreed = agreed
        self._attn_sig = None
        self.num_plans += 1

    def _drop_plan(self) -> None:
        self._plan = self._spec = None
        self._agreed = False

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

    # -- agreement ---------------------------------------------------------------------------------
    def report_error(self, message: str) -> None:
        """Report a problem only this rank can see (e.g. a malformed sample): it is raised, as
        :class:`BalancerInputError` naming this rank, on every rank of the group at the next
        agreement point (the next ``route``/``reverse_route``/``route_context``/first
        attention), so the other ranks do not wait in a collective this rank has left."""
        self._pending = self._pending or str(message)

    def _agree(self, where: str, error: str = "", **values: str) -> None:
        """The flag exchange before data moves: this rank's error (or one deferred from an
        earlier layer), the plan digest until it is agreed, and ``values`` (signatures)."""
        error = self._pending or error
        self._pending = ""
        digests = {"plan": self._digest} if not self._agreed else {}
        digests.update({k.replace("_", " "): digest62(v) for k, v in values.items()})
        agree(self.group, f"SequenceBalancer.{where}", error, digests)
        self._agreed = True

    def _check_rows(self, tensors: Sequence[torch.Tensor], rows: int, where: str, *, seq_lens=None) -> None:
        error = ""
        if not tensors:
            error = "no tensors given"
        else:
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    error = f"argument {i} is not a tensor with a token dimension"
                elif t.shape[0] != rows:
                    error = f"argument {i} has {t.shape[0]} tokens on rank {self.group_rank}, expected {rows}"
                elif t.device != tensors[0].device:
                    error = f"argument {i} is on {t.device}, argument 0 on {tensors[0].device}"
                if error:
                    break
        if not error and seq_lens is not None:
            planned = list(self.current_plan.seq_lens[self.group_rank])
            if [int(n) for n in seq_lens] != planned:
                error = f"the tensors are laid out as sequences {list(seq_lens)[:8]}..., planned {planned[:8]}..."
        ok = not error
        self._agree(where, error, dtypes_and_shapes=_signature(tensors) if ok else "?")

    # -- execution -------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, *features: torch.Tensor, seq_lens: Sequence[int] | None = None):
        """Move tokens (T, *F) to their planned ranks -> (R, *F); several tensors -> a tuple.
        One all_to_all_single per dtype; differentiable (backward = reverse exchange).
        ``seq_lens`` (optional): the lengths the tensors are laid out in, checked against the
        plan (catches a batch from another step with the same token count)."""
        _, spec = self._require_spec()
        tensors = (x, *features)
        self._check_rows(tensors, spec.num_local, "route", seq_lens=seq_lens)
        if self._timer is not None:
            self._timer.start(x.device)
            tensors = self._timer.mark(tensors)
            tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        self._bytes_per_token = sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors)
        out = ops.route(tensors, spec, self.group)
        return out[0] if not features else tuple(out)

    def reverse_route(self, y: torch.Tensor, *features: torch.Tensor):
        """Inverse of :meth:`route`: (R, *F) -> (T, *F) in the caller's original order."""
        _, spec = self._require_spec()
        tensors = (y, *features)
        self._check_rows(tensors, spec.num_routed, "reverse_route")
        if self._timer is not None and not (torch.is_grad_enabled() and y.requires_grad):
            self._timer.stop()  # no backward to wait for
        out = ops.reverse_route(tensors, spec, self.group)
        return out[0] if not features else tuple(out)

    def _attn_problem(self, q, k, v, spec: RouteSpec) -> tuple[str, tuple]:
        """(error, signature) of q, k, v against the plan, checked locally."""
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return "q, k, v must be tensors", ()
        sig = (q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype)
        if self._attn_sig is not None and sig == self._attn_sig[0] and q.shape[0] == spec.num_routed:
            return "", sig  # this step's agreed shapes (checked when they were agreed): the per-layer fast path
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return f"q, k, v must be (tokens, heads, head_dim); got {shapes}", sig
        if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or k.shape[2] != q.shape[2]:
            return (f"q (R, h, D), k (R, h_kv, D) and v (R, h_kv, Dv) must share R, h_kv and D; got {shapes}"), sig
        if q.dtype != k.dtype or q.dtype != v.dtype:
            return f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}", sig
        if q.shape[0] != spec.num_routed:
            return f"q has {q.shape[0]} tokens on rank {self.group_rank}; routed tokens: {spec.num_routed}", sig
        return ulysses.check_heads(q.shape[1], k.shape[1], spec), sig  # from the plan: the same everywhere

    def _pre(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> ulysses.UlyssesCall:
        _, spec = self._require_spec()
        error, sig = self._attn_problem(q, k, v, spec)
        if self.debug or self._attn_sig is None or not self._agreed:
            self._agree("pre_attn", error, attention_shapes=repr(tuple(map(str, sig))) if not error else "?")
            self._attn_sig = (sig, q.device)
        elif error or sig != self._attn_sig[0]:
            self._pending = self._pending or (
                error or f"q/k/v shapes or dtypes {sig} differ from this step's {self._attn_sig[0]}"
            )
            q, k, v = self._zeros_like_agreed(spec)
        return ulysses.pre_attn_batches(q, k, v, spec, self.group)

    def _post(self, call: ulysses.UlyssesCall, outs: list[torch.Tensor]) -> torch.Tensor:
        _, spec = self._require_spec()
        error = ""
        for b, o in zip(call.batches, outs):
            expected = (b.q.shape[0], b.q.shape[1], b.v.shape[2])
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != expected or o.dtype != b.v.dtype:
                got = (tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else type(o).__name__
                error = f"post_attn got {got} on rank {self.group_rank}, expected {expected} of {b.v.dtype}"
                break
        if self.debug:
            self._agree("post_attn", error)
        elif error:
            self._pending = self._pending or error
            outs = [b.v.new_zeros((b.q.shape[0], b.q.shape[1], b.v.shape[2])) for b in call.batches]
        return ulysses.post_attn_batches(call, outs, spec, self.group)

    def pre_attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Routed q (R, h, D), k/v (R, h_kv, ·) -> ``(q2, k2, v2, cu_seqlens, max_len)`` for one
        custom varlen kernel call; :meth:`post_attn` takes its output. A rank whose sequences
        all have one degree k (every bag layout) gets (A, h/k, ·) with its head slice; a rank
        mixing degrees gets (sequence, query head) pairs of one head each. Checked as the module
        docstring says."""
        call = self._pre(q, k, v)
        self._call = call
        return ulysses.flatten_pairs(call)

    def post_attn(self, o: torch.Tensor) -> torch.Tensor:
        """Output of the kernel run on :meth:`pre_attn`'s tensors -> (R, h, Dv) in routed order."""
        call = getattr(self, "_call", None)
        if call is None:
            raise RuntimeError("SequenceBalancer.post_attn: call pre_attn first (post_attn inverts it)")
        self._call = None
        single = len(call.batches) == 1
        if isinstance(o, torch.Tensor) and not single:
            n = sum(b.q.shape[0] * b.q.shape[1] for b in call.batches)
            if tuple(o.shape) == (n, 1, call.heads[3]):
                return self._post(call, ulysses.unflatten_pairs(o, call))
            o = None  # reported below with the expected per-batch shapes
        return self._post(call, [o] if single else [o] * len(call.batches))

    def _zeros_like_agreed(self, spec: RouteSpec):
        """Well-formed stand-ins for q, k, v of this step's agreed shapes (so the exchange the
        other ranks are in completes; the error is raised at the next agreement point)."""
        (qs, ks, vs, qd, kd, vd), device = self._attn_sig  # type: ignore[misc]
        R = spec.num_routed
        return tuple(torch.zeros((R, *s), dtype=d, device=device) for s, d in ((qs, qd), (ks, kd), (vs, vd)))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Attention of routed tokens within their own sequences: q (R, h, D), k/v (R, h_kv, ·)
        -> (R, h, Dv); one varlen call per parallel degree on this rank."""
        call = self._pre(q, k, v)
        backend = self.config.attn_backend
        outs = [
            varlen_attention(b.q, b.k, b.v, b.cu_seqlens, b.max_len, causal=causal, backend=backend)
            for b in call.batches
        ]
        return self._post(call, outs)

    def gather_sequences(self, *per_seq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sequence rows of every rank of the group, in group sequence-id order: (n_local,
        *F) each -> (n_group, *F), indexable by ``routed_positions()[0]``. Differentiable; one
        collective per dtype. Use it for conditioning (timestep/AdaLN vectors, text lengths)."""
        plan, _ = self._require_spec()
        counts = plan.index.counts.tolist()
        self._check_rows(per_seq, counts[self.group_rank], "gather_sequences")
        return tuple(ops.gather_sequences(per_seq, counts, self.group_rank, self.group))

    def route_context(self, context: torch.Tensor, lens: Sequence[int]) -> RoutedContext:
        """Send each local sequence's context (``lens[i]`` rows of ``context`` for local
        sequence i, e.g. its embedded text) to every rank of the group that holds queries of
        that sequence, once per step; every layer's :meth:`cross_attention` reuses the result.
        Differentiable (a context sent to several ranks gets the sum of their gradients).
        Collectives: the agreement flag, a gather of the lengths, and one all-to-all unless
        every context stays on its own rank."""
        plan, spec = self._require_spec()
        n_local = len(plan.seq_lens[self.group_rank])
        error = context_problem(context, lens, n_local)
        sig = f"{context.dtype}{tuple(context.shape[1:])}" if not error else "?"
        self._agree("route_context", error, context_dtype_and_shape=sig)
        device = group_device(self.group)
        mine = torch.tensor([int(n) for n in lens], dtype=torch.int64, device=device)
        counts = plan.index.counts.tolist()
        all_lens = ops.gather_sequences([mine], counts, self.group_rank, self.group)[0].cpu().numpy()
        route = build_context_route(plan, self.group_rank, all_lens)
        rows = context.index_select(0, torch.from_numpy(route.send_rows).to(context.device))
        if route.moves:
            rows = ops.all_to_all(rows, route.send_splits, route.recv_splits, self.group)
        seq_id = spec.indices_on(context.device)["routed_seq_id"]
        return routed_context(rows, torch.from_numpy(route.seq_ids), route.lens.tolist(), seq_id)

    def cross_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: RoutedContext
    ) -> torch.Tensor:
        """Cross-attention of routed queries q (R, h, D) over their own sequence's context:
        k (M, h_kv, D), v (M, h_kv, Dv) projected from ``context.rows`` -> (R, h, Dv). Local:
        each rank computes all heads for the queries it holds (no exchange). A bad shape on
        one rank is raised on every rank at the next agreement point (zeros meanwhile)."""
        _, spec = self._require_spec()
        error = cross_problem(q, k, v, context, spec.num_routed)
        if error and all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, v)):
            self._pending = self._pending or f"cross_attention on rank {self.group_rank}: {error}"
            return q.new_zeros((q.shape[0], q.shape[1], v.shape[2])) + 0 * q.sum()
        if error:
            raise ValueError(f"cross_attention: {error}")
        return cross_attend(q, k, v, context, self.config.attn_backend)

    def routed_positions(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per routed token: global sequence id in the group (rank-major) and position (int64)."""
        _, spec = self._require_spec()
        if device is None:
            return spec.routed_seq_id, spec.routed_pos
        idx = spec.indices_on(device)
        return idx["routed_seq_id"], idx["routed_pos"]
