"""Evaluate layouts over sampled steps, and search for the best one (``--bags auto``).

Candidates: every uniform layout ``g{k}n{N/k}`` and mixed layouts of two or three bag sizes
sharing the ranks (equal shares, and 3:1 / 1:3 for pairs); bag sizes must divide the head
count, and no bag may straddle a node boundary unless allowed. Two baselines: ``none`` (plain
data parallel) and the best *static* uniform layout a team would configure by hand
(:func:`best_static`: Ulysses groups inside a node, rings of them beyond).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from knapformer.cluster.hardware import Hardware
from knapformer.cluster.model import ModelShape, predict_step, predict_unbalanced
from knapformer.config import BalancerConfig
from knapformer.layout import AutoLayout, BagLayout, parse_layout
from knapformer.plan import Planner
from knapformer.plan.solvers.menu import layout_menu
from knapformer.plan.solvers.uniform import UNIFORM_NODES
from knapformer.workload import WorkloadModel

__all__ = [
    "LayoutResult",
    "bag_sizes_for",
    "best_static",
    "candidate_layouts",
    "default_config",
    "evaluate",
    "search_layouts",
    "static_layouts",
]


@dataclass
class LayoutResult:
    bags: str
    step_s: float
    tokens_per_s: float
    hfu: float
    comm_share: float
    imbalance: float
    plan_ms: float
    speedup: float = 1.0
    largest_group: int = 1
    """The most ranks any sequence ran on, over the sampled steps."""
    rings: str = ""
    """Ring shapes used (``"r×u"`` = ring of r Ulysses sub-groups of u ranks), "" for none."""
    step_times: list = field(default_factory=list)
    """Predicted seconds of each sampled step."""
    max_tokens: int = 0
    """Memory: the most tokens any rank holds in any sampled step (routed; with ``none`` the
    tokens it loads; gathered K/V of the ``pre_attn`` path counted as tokens)."""
    over_cap: bool | None = None
    """Whether ``max_tokens`` exceeds the balancer's ``max_tokens_per_rank`` (None: no cap)."""
    speedup_static: float | None = None
    """The best static layout's mean step time over this one's (None when not compared)."""

    def row(self) -> dict:
        return dict(self.__dict__)


def _bar(items, desc: str, enabled: bool):
    """A tqdm bar when asked for and stderr is a TTY (the cluster model is otherwise silent)."""
    from knapformer.tools.cli_support import progress

    return progress(items, desc=desc, enabled=enabled)


def bag_sizes_for(heads: int, gpus_per_node: int, num_gpus: int, allow_cross_node: bool) -> list[int]:
    """Bag sizes that split the heads evenly and fit the node (or the cluster)."""
    limit = num_gpus if allow_cross_node else min(gpus_per_node, num_gpus)
    return [k for k in range(1, limit + 1) if heads % k == 0 and num_gpus % k == 0]


def _fits_nodes(layout: BagLayout, gpus_per_node: int) -> bool:
    return all(len({r // gpus_per_node for r in bag}) == 1 for bag in layout.bags)


def candidate_layouts(num_gpus: int, heads: int, gpus_per_node: int, *, allow_cross_node: bool = False) -> list[str]:
    """Uniform then mixed layouts, each valid for the head count and node size."""
    sizes = bag_sizes_for(heads, gpus_per_node, num_gpus, allow_cross_node)
    if not sizes:
        raise ValueError(f"no bag size divides both {heads} heads and {num_gpus} GPUs")
    out = []
    for spec in layout_menu(num_gpus, sizes):
        lay = parse_layout(spec)
        if lay.group_size == num_gpus and (allow_cross_node or _fits_nodes(lay, gpus_per_node)):
            out.append(spec)
    return out


def evaluate(
    steps: Sequence[Sequence[Sequence[int]]],
    balancer: BalancerConfig | str,
    shape: ModelShape,
    hw: Hardware,
    *,
    profile: WorkloadModel | None = None,
    fixed_s: float = 0.0,
    rank_speed: Sequence[float] | None = None,
    attn_backend: str = "auto",
    progress: bool = False,
    planning: str = "ahead",
) -> LayoutResult:
    """Mean prediction over sampled steps. ``balancer`` is the balancer's configuration (its
    layout, planning cost model, solver, cap, rank speeds), a layout spec (planned with the
    default config: ``profile`` or the paper form with γ=1), or ``"none"`` for plain data
    parallel (then ``rank_speed`` gives the GPUs' speeds). Compute time comes from ``profile``
    (a calibrated profile's seconds) if given, else from FLOPs. ``planning``: ``"ahead"`` (plans
    made before the step needs them, ``knapformer.data.PlannedSteps``: nothing on the critical
    path) or ``"inline"`` (``bal.plan`` on the training loop: each step adds its plan's time as
    measured here — this machine's CPU, not the cluster's)."""
    if planning not in ("ahead", "inline"):
        raise ValueError(f"planning must be 'ahead' or 'inline', got {planning!r}")
    if isinstance(balancer, str) and balancer != "none":
        balancer = default_config(shape, balancer, profile)
    if isinstance(balancer, BalancerConfig):
        # inside a node a bag runs Ulysses over the heads; beyond one, a ring of Ulysses sub-groups
        bad = [k for k, _ in getattr(balancer.layout, "terms", ()) if shape.heads % k and k <= hw.gpus_per_node]
        if bad:
            raise ValueError(f"bag size {bad[0]} does not divide the model's {shape.heads} heads")
        rank_speed, attn_backend = balancer.rank_speed, balancer.attn_backend
        name = "auto" if isinstance(balancer.layout, AutoLayout) else balancer.layout.spec()
    elif balancer == "none":
        name = "none"
    else:
        raise ValueError(f"balancer must be a BalancerConfig or 'none', got {balancer!r}")
    preds, plan_ms = [], []
    largest, rings, tokens = 1, set(), 0
    planner = Planner.from_config(balancer) if isinstance(balancer, BalancerConfig) else None
    for lens in _bar(steps, f"{name}: steps", progress):
        if not isinstance(balancer, BalancerConfig):
            preds.append(
                predict_unbalanced(
                    lens, shape, hw, profile=profile, fixed_s=fixed_s, rank_speed=rank_speed, attn_backend=attn_backend
                )
            )
            plan_ms.append(0.0)
            tokens = max([tokens] + [sum(r) for r in lens])
            continue
        t = time.perf_counter()
        plan = planner(lens)
        plan_ms.append(1e3 * (time.perf_counter() - t))
        held = plan.memory_per_rank()
        tokens = max(tokens, int(held.max()) if held.size else 0)
        used = set(plan.seq_group.tolist())
        largest = max([largest] + [len(plan.groups[b]) for b in used])
        rings |= {(int(plan.rings[b]), len(plan.groups[b]) // int(plan.rings[b])) for b in used if plan.rings[b] > 1}
        control = plan_ms[-1] / 1e3 if planning == "inline" else 0.0
        preds.append(
            predict_step(
                plan,
                shape,
                hw,
                profile=profile,
                fixed_s=fixed_s,
                rank_speed=rank_speed,
                attn_backend=attn_backend,
                control_s=control,
            )
        )
    s = [p.summary(hw) for p in preds]
    mean = lambda k: statistics.mean(x[k] for x in s)  # noqa: E731
    return LayoutResult(
        bags=name,
        step_s=mean("step_s"),
        tokens_per_s=mean("tokens_per_s"),
        hfu=mean("hfu"),
        comm_share=mean("comm_share"),
        imbalance=mean("imbalance"),
        plan_ms=statistics.mean(plan_ms),
        largest_group=largest,
        rings=", ".join(f"{r}×{u}" for r, u in sorted(rings)),
        step_times=[p.step_s for p in preds],
        max_tokens=tokens,
    )


def default_config(shape: ModelShape, layout: str, profile: WorkloadModel | None = None) -> BalancerConfig:
    """The balancer the cluster model assumes when none is given: plans with ``profile`` when
    there is one, else the model's own FLOP form (γ = 1)."""
    return BalancerConfig(layout=layout, cost=profile or shape.workload())


def static_layouts(num_gpus: int, shape: ModelShape, gpus_per_node: int) -> list[str]:
    """The uniform layouts a team configures by hand (``g{k}n{N/k}``): every rank in k-rank
    Ulysses groups for each k inside a node that divides the heads (and the kv heads, or is a
    multiple of them) and the GPUs, then rings of the widest such group over 2, 4, 8, … of
    them that span whole nodes, up to 8 nodes (``knapformer.plan.solvers.uniform.UNIFORM_NODES``,
    the widest ``auto`` tries too), dividing the GPUs."""
    h, h_kv = shape.heads, shape.kv_heads or shape.heads
    inside = [
        k
        for k in range(1, min(gpus_per_node, num_gpus) + 1)
        if gpus_per_node % k == 0 and num_gpus % k == 0 and h % k == 0 and (h_kv % k == 0 or k % h_kv == 0)
    ]
    out = [f"g{k}n{num_gpus // k}" for k in inside]
    k = max(inside) * 2
    while k <= min(num_gpus, UNIFORM_NODES * gpus_per_node):
        if k > gpus_per_node and k % gpus_per_node == 0 and num_gpus % k == 0:
            out.append(f"g{k}n{num_gpus // k}")
        k *= 2
    return out


def best_static(
    steps, shape: ModelShape, hw: Hardware, balancer: BalancerConfig, **kw
) -> tuple[LayoutResult | None, list[LayoutResult]]:
    """(the uniform static layout with the best mean step time, all of them): each of
    :func:`static_layouts` planned by ``balancer``'s settings without its memory cap (a team's
    static layout either fits or does not: ``over_cap`` says which)."""
    cap = balancer.max_tokens_per_rank
    results = []
    for spec in static_layouts(len(steps[0]), shape, hw.gpus_per_node):
        cfg = dataclasses.replace(balancer, layout=spec, max_tokens_per_rank=None, solver=None, time_budget_s=None)
        r = evaluate(steps, cfg, shape, hw, **kw)
        r.over_cap = None if cap is None else r.max_tokens > cap
        results.append(r)
    results.sort(key=lambda r: (r.step_s, r.bags))
    return (results[0] if results else None), results


def search_layouts(
    steps,
    shape: ModelShape,
    hw: Hardware,
    balancer: BalancerConfig | None = None,
    *,
    profile: WorkloadModel | None = None,
    allow_cross_node: bool = False,
    fixed_s: float = 0.0,
    progress: bool = False,
    planning: str = "ahead",
) -> tuple[LayoutResult, list[LayoutResult], LayoutResult]:
    """(best, all candidates sorted by step time, the 'none' baseline). Every candidate layout
    is planned with ``balancer``'s other settings (its own layout is ignored); ``planning`` as
    :func:`evaluate` takes it."""
    num_gpus = len(steps[0])
    if balancer is None:
        balancer = default_config(shape, f"g1n{num_gpus}", profile)
    base = evaluate(
        steps,
        "none",
        shape,
        hw,
        profile=profile,
        fixed_s=fixed_s,
        rank_speed=balancer.rank_speed,
        attn_backend=balancer.attn_backend,
    )
    results = []
    specs = candidate_layouts(num_gpus, shape.heads, hw.gpus_per_node, allow_cross_node=allow_cross_node)
    for spec in _bar(specs, "layouts", progress):
        cfg = dataclasses.replace(balancer, layout=spec)
        r = evaluate(steps, cfg, shape, hw, profile=profile, fixed_s=fixed_s, planning=planning)
        r.speedup = base.step_s / r.step_s
        results.append(r)
    results.sort(key=lambda r: (r.step_s, r.bags))
    return results[0], results, base
