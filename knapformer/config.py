"""``BalancerConfig``: every setting of the balancer, in one kw-only value (torch-free).

The same object configures :class:`~knapformer.distributed.SequenceBalancer`, the simulator
(``SimConfig.balancer_config``) and the cluster model; the CLI flags that set it are defined
once (:func:`knapformer.tools.cli_support.add_balancer_args`), so ``knapformer plan``,
``simulate`` and ``cluster`` spell each setting the same way.

    cfg = BalancerConfig(layout="g1n2+g2n1", cost=WorkloadModel(d_model=3072), max_tokens_per_rank=65536)
    bal = SequenceBalancer(cfg)                      # after init_process_group
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, fields

from knapformer.layout import BagLayout, parse_layout
from knapformer.plan import DEFAULT_SOLVER, SolverOptions, get_solver
from knapformer.plan.problem import validate_rank_speed
from knapformer.workload import WorkloadModel

__all__ = ["ATTN_BACKENDS", "BalancerConfig"]

ATTN_BACKENDS = ("auto", "sdpa", "sdpa_mask", "flash")
"""Attention backend names (``knapformer.attention.BACKENDS`` plus ``auto``; a test keeps the two
in step so this module stays torch-free)."""


@dataclass(frozen=True, kw_only=True)
class BalancerConfig:
    """Settings of one balancer; validated on construction (errors name the field)."""

    layout: str | BagLayout
    """Bag layout of one balancing group, e.g. ``"g1n4+g2n2"``; a group smaller than the world
    is tiled into replicas."""
    cost: WorkloadModel | str | os.PathLike
    """The planner's cost model, or the path of a calibrated profile (``knapformer calibrate``)."""
    solver: str = DEFAULT_SOLVER
    """Planner name (``knapformer.plan.SOLVERS``)."""
    max_tokens_per_rank: int | None = None
    """Memory cap: no rank holds more routed tokens in a step. None = unlimited."""
    rank_speed: tuple[float, ...] | None = None
    """Relative throughput of each rank of the group (a 0.5 rank gets half the work)."""
    attn_backend: str = "auto"
    """Varlen attention kernel: ``auto`` (flash-attn on CUDA when importable, else SDPA), ``sdpa``,
    ``sdpa_mask`` or ``flash``."""
    debug: bool = False
    """Expensive checks: every per-layer call agrees on its shapes across ranks (a host sync
    per layer). Off, errors are still raised on every rank at the per-step agreement points."""
    solver_options: SolverOptions = field(default_factory=SolverOptions)
    """Iteration counts and tie-breaking of the solvers."""

    def __post_init__(self) -> None:
        layout = parse_layout(self.layout)
        object.__setattr__(self, "layout", layout)
        cost = self.cost
        if isinstance(cost, (str, os.PathLike)):
            cost = WorkloadModel.from_profile(cost)
        if not isinstance(cost, WorkloadModel):
            raise TypeError(f"BalancerConfig.cost must be a WorkloadModel or a profile path, got {type(cost).__name__}")
        object.__setattr__(self, "cost", cost)
        get_solver(self.solver)
        cap = self.max_tokens_per_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"BalancerConfig.max_tokens_per_rank must be a positive int or None, got {cap!r}")
        if self.rank_speed is not None:
            object.__setattr__(self, "rank_speed", validate_rank_speed(self.rank_speed, layout.group_size))
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attn_backend!r}; choose one of {list(ATTN_BACKENDS)}")
        if not isinstance(self.debug, bool):
            raise TypeError(f"BalancerConfig.debug must be a bool, got {self.debug!r}")
        if not isinstance(self.solver_options, SolverOptions):
            raise TypeError("BalancerConfig.solver_options must be a SolverOptions")

    @property
    def group_size(self) -> int:
        return self.layout.group_size

    def settings(self) -> dict[str, str]:
        """Each setting as a canonical string: what ranks compare to agree on the configuration
        (the cost model by its coefficients, not by its provenance)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, BagLayout):
                v = v.spec()
            elif isinstance(v, WorkloadModel):
                v = {k: x for k, x in v.to_dict().items() if k != "meta"}
            elif isinstance(v, SolverOptions):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            out[f.name] = json.dumps(v, sort_keys=True)
        return out

    def setting_digests(self) -> list[int]:
        """One 62-bit digest per setting (in field order), for a cross-rank comparison."""
        return [int(hashlib.sha256(s.encode()).hexdigest()[:15], 16) for s in self.settings().values()]
