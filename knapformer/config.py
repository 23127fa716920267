"""``BalancerConfig``: every setting of the balancer, in one kw-only value (torch-free).

The same object configures :class:`~knapformer.distributed.SequenceBalancer`, the simulator
(``SimConfig.balancer_config``) and the cluster model; the CLI flags that set it are defined
once (:func:`knapformer.tools.cli_support.add_balancer_args`), so ``knapformer plan``,
``simulate`` and ``cluster`` spell each setting the same way.

    cfg = BalancerConfig(layout="g1n2+g2n1", cost=WorkloadModel(d_model=3072), max_tokens_per_rank=65536)
    bal = SequenceBalancer(cfg)                      # after init_process_group
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields

from knapformer.attention.registry import BACKEND_NAMES
from knapformer.layout import AutoLayout, BagLayout, parse_layout
from knapformer.plan import SolverOptions, default_solver, get_solver
from knapformer.plan.cost import LinkModel
from knapformer.plan.problem import validate_rank_speed
from knapformer.workload import WorkloadModel

__all__ = ["ATTN_BACKENDS", "ATTN_PATHS", "BalancerConfig"]

ATTN_BACKENDS = BACKEND_NAMES
"""Attention backend names: the registry's (``knapformer.attention.registry``) plus ``auto``."""
ATTN_PATHS = ("auto", "attention", "pre_attn")
TIMER_MODES = ("auto", "cpu", "wall", "cuda")
LINK_CHOICES = ("measure", "free")
"""``BalancerConfig.link`` names: measured at construction (the default, also None), or free."""
"""``BalancerConfig.timer`` values (:mod:`knapformer.distributed.timing`)."""
"""Values of ``BalancerConfig.attn_path``."""


@dataclass(frozen=True, kw_only=True)
class BalancerConfig:
    """Settings of one balancer; validated on construction (errors name the field)."""

    layout: str | BagLayout | AutoLayout
    """Bag layout of one balancing group, e.g. ``"g1n4+g2n2"``, or ``"auto"`` (every sequence's
    group chosen per step; ``auto:max8`` caps the degree, ``auto:n16`` tiles the world into
    16-rank groups); a group smaller than the world is tiled into replicas."""
    cost: WorkloadModel | str | os.PathLike
    """The planner's cost model, or the path of a calibrated profile (``knapformer calibrate``).
    For ``auto``, give it ``num_heads`` (and ``num_kv_heads``): a degree the heads cannot split
    then runs as a ring of Ulysses sub-groups whose size they can (without: power-of-two
    degrees, rings of sub-groups of at most 8 beyond 8)."""
    solver: str | None = None
    """Planner name (``knapformer.plan.SOLVERS``); None = ``lpt`` for bag layouts, ``moldable``
    for ``auto``."""
    link: LinkModel | str | None = None
    """Links between the ranks, which price the exchanges so that ``auto`` splits a sequence
    only when it pays: None (or ``"measure"``, the default) = measured on the balancing group
    when the balancer is built (:mod:`knapformer.distributed.link_probe`: latency and bandwidth
    per peer class, and what a second is worth in the cost model's units on the device; a few
    ms); a ``knapformer.plan.cost.LinkModel`` (e.g. a hardware preset's ``Hardware.link``) =
    those links; ``"free"`` = communication costs nothing in the plan (what None meant before
    0.2.0). Bytes per value follow the tensors' dtype from the first step on."""
    max_tokens_per_rank: int | None = None
    """Memory cap: no rank holds more routed tokens in a step. None = no cap; layout ``auto``
    then prefers, within 0.5% of its fastest plan, the one with the fewest tokens on its busiest
    rank (``SolverOptions.peak_tolerance``), which bounds time-driven concentration but is not a
    cap: set one when activation memory is tight (docs/data.md, "The two budgets")."""
    rank_speed: tuple[float, ...] | None = None
    """Relative throughput of each rank of the group (a 0.5 rank gets half the work)."""
    attn_path: str = "auto"
    """How a ring group's attention runs, which the planner prices (ring plans only; without
    rings both are the same): ``attention`` — ``bal.attention``'s ring rounds (K/V blocks
    around the ring, overlapped with the block attention); ``pre_attn`` — ``pre_attn``/
    ``post_attn`` around your own kernel: keys and values all-gathered over the ring for one
    varlen call, its exchange exposed and its keys/values counted against
    ``max_tokens_per_rank``; ``auto`` — priced as ``attention`` until the first ``pre_attn``
    call (the same on every rank), as ``pre_attn`` from the next plan on. With ``attention``
    or ``pre_attn`` set, a ring plan run through the other call raises on every rank."""
    attn_backend: str = "auto"
    """Varlen attention kernel: ``auto`` (flash-attn on CUDA when importable, else SDPA) or a name
    of ``knapformer.attention.BACKENDS`` (``sdpa``, ``sdpa_mask``, ``flash``)."""
    collective_timeout_s: float = 300.0
    """The longest a knapformer exchange waits for the other ranks of its group (the
    balancer's own process groups are created with it). A rank that died or stopped answering
    makes every surviving rank raise :class:`~knapformer.errors.PeerLostError` naming the
    phase within this bound (a dead process is usually seen at once: its connections close).
    Set it above the longest time one rank may legitimately run ahead of the others between
    two exchanges (a checkpoint written on one rank, an evaluation pass, a slow first
    compilation)."""
    debug: bool = False
    """Expensive checks: every per-layer call (``attention``, ``pre_attn``, ``post_attn``)
    agrees on its shapes across ranks (a rendezvous of the whole group per call, so a bad layer
    raises at that call on every rank), and each plan's digest is agreed. Off (the default), the
    step's first per-layer call agrees, the first step of each kind agrees at every call and
    records them, and later steps check their calls locally against that record: a bad or
    divergent call on one rank runs the recorded call on zeros and every rank raises at the
    step's next agreement (``reverse_route``) — no rendezvous per layer (docs/failures.md)."""
    solver_options: SolverOptions = field(default_factory=SolverOptions)
    """Iteration counts and tie-breaking of the solvers."""
    time_budget_s: float | None = None
    """Planning budget per step for solvers that take one (``moldable``: more candidate plans,
    counted at a fixed rate so every rank plans the same ones). None = the solver's default."""
    measure: bool = False
    """Time each rank's own work in every step (route to the end of its backward, without the
    time spent waiting for other ranks in knapformer's exchanges; ``timer`` says how); the
    seconds ride on the gather the next ``plan`` does anyway and appear in the telemetry."""
    timer: str = "auto"
    """How ``measure`` times (:mod:`knapformer.distributed.timing`): ``auto`` (CUDA events on
    CUDA tensors, read one step later without a device synchronisation; thread CPU time on
    CPU), ``cuda``, ``cpu``, or ``wall`` (wall clock between exchanges: what CUDA events
    measure, on CPU)."""
    recalibrate: bool = False
    """Refit the cost model from the measured steps and plan with it (implies ``measure``)."""
    estimate_speed: bool = False
    """With ``recalibrate``: also estimate each rank's speed (a slow rank gets less work)."""
    recalibrate_window: int = 16
    """Timed steps the online fit keeps (older ones are forgotten)."""
    recalibrate_warmup: int = 1
    """Timed steps at the start the online fit skips (they pay one-time costs: allocator growth,
    lazy initialisation, autotuning, compilation); the configured model plans until then."""

    def __post_init__(self) -> None:
        layout = parse_layout(self.layout)
        object.__setattr__(self, "layout", layout)
        if self.solver is None:
            object.__setattr__(self, "solver", default_solver(layout))
        if isinstance(self.link, str) and self.link not in LINK_CHOICES:
            raise ValueError(f"BalancerConfig.link must be a LinkModel, None or one of {LINK_CHOICES}: {self.link!r}")
        if not isinstance(self.link, (str, LinkModel, type(None))):
            raise TypeError(f"BalancerConfig.link must be a LinkModel, None or a name, got {type(self.link).__name__}")
        cost = self.cost
        if isinstance(cost, (str, os.PathLike)):
            cost = WorkloadModel.from_profile(cost)
        if not isinstance(cost, WorkloadModel):
            raise TypeError(f"BalancerConfig.cost must be a WorkloadModel or a profile path, got {type(cost).__name__}")
        object.__setattr__(self, "cost", cost)
        info = get_solver(self.solver)
        if info.moldable != isinstance(layout, AutoLayout):
            raise ValueError(f"solver {self.solver!r} does not plan layout {layout.spec()!r}; leave solver unset")
        cap = self.max_tokens_per_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"BalancerConfig.max_tokens_per_rank must be a positive int or None, got {cap!r}")
        if self.rank_speed is not None:
            size = layout.num_ranks if isinstance(layout, AutoLayout) else layout.group_size
            object.__setattr__(self, "rank_speed", validate_rank_speed(self.rank_speed, size or len(self.rank_speed)))
        if self.attn_path not in ATTN_PATHS:
            raise ValueError(f"BalancerConfig.attn_path must be one of {list(ATTN_PATHS)}, got {self.attn_path!r}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attn_backend!r}; choose one of {list(ATTN_BACKENDS)}")
        if not isinstance(self.debug, bool):
            raise TypeError(f"BalancerConfig.debug must be a bool, got {self.debug!r}")
        if not isinstance(self.solver_options, SolverOptions):
            raise TypeError("BalancerConfig.solver_options must be a SolverOptions")
        if self.timer not in TIMER_MODES:
            raise ValueError(f"BalancerConfig.timer must be one of {list(TIMER_MODES)}, got {self.timer!r}")
        for name in ("measure", "recalibrate", "estimate_speed"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BalancerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.estimate_speed and not self.recalibrate:
            raise ValueError("BalancerConfig.estimate_speed needs recalibrate=True")
        if self.recalibrate and not self.measure:
            object.__setattr__(self, "measure", True)
        if (
            isinstance(self.recalibrate_window, bool)
            or not isinstance(self.recalibrate_window, int)
            or (self.recalibrate_window < 1)
        ):
            raise ValueError(f"BalancerConfig.recalibrate_window must be an int >= 1, got {self.recalibrate_window!r}")
        w = self.recalibrate_warmup
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"BalancerConfig.recalibrate_warmup must be an int >= 0, got {w!r}")
        t = self.collective_timeout_s
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"BalancerConfig.collective_timeout_s must be a finite number > 0, got {t!r}")
        if self.time_budget_s is not None:
            if not info.takes_time_budget:
                raise ValueError(f"solver {self.solver!r} takes no time budget; drop time_budget_s")
            if isinstance(self.time_budget_s, bool) or not (
                isinstance(self.time_budget_s, (int, float))
                and math.isfinite(self.time_budget_s)
                and self.time_budget_s > 0
            ):
                raise ValueError(
                    f"BalancerConfig.time_budget_s must be a finite number > 0, got {self.time_budget_s!r}"
                )

    @property
    def group_size(self) -> int:
        return self.layout.group_size

    def resolved(self, num_ranks: int) -> BalancerConfig:
        """This config for a balancing group of ``num_ranks`` ranks (``auto`` without a size
        takes it; the rest is unchanged)."""
        if isinstance(self.layout, AutoLayout) and self.layout.num_ranks is None:
            return dataclasses.replace(self, layout=self.layout.resolved(num_ranks))
        return self

    def settings(self) -> dict[str, str]:
        """Each setting as a canonical string: what ranks compare to agree on the configuration
        (the cost model by its coefficients, not by its provenance)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (BagLayout, AutoLayout)):
                v = v.spec()
            elif isinstance(v, LinkModel):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            elif isinstance(v, WorkloadModel):
                v = {k: x for k, x in v.to_dict().items() if k != "meta"}
            elif isinstance(v, SolverOptions):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            out[f.name] = json.dumps(v, sort_keys=True)
        return out

    def setting_digests(self) -> list[int]:
        """One 62-bit digest per setting (in field order), for a cross-rank comparison."""
        return [int(hashlib.sha256(s.encode()).hexdigest()[:15], 16) for s in self.settings().values()]
