"""Predict one training step's time per rank from a plan: compute plus communication.

- **Compute**: each rank's FLOPs (linear part of the tokens it holds, plus 1/k of the
  attention of every sequence of its bag; × layers; forward + backward = 3×, + 1× with
  activation recompute) over the hardware's achievable rate — or, with a calibrated
  profile, the profile's seconds directly.
- **Routing**: route and reverse move each chunk whose destination differs from its source,
  ``d`` values per token; with their backward exchanges that is 4 all-to-alls per step.
- **Ulysses**: in a k-rank group every attention layer sends (k−1)/k of q, k, v before
  attention and of the output (1 unit) after, in forward and again in backward (and recompute).
- **Ring**: a group run as r sub-groups of u (Ulysses inside each, over its block of L/r
  tokens) passes K/V blocks around the ring: r − 1 blocks per layer forward, the blocks and
  their gradients backward, hidden behind the block attention they overlap with
  (:func:`~knapformer.plan.cost.ring_exposed`); the zigzag cut keeps causal work even.
- An all-to-all costs ``latency + max(sent, received) / bandwidth`` per link class (inside
  a node / across nodes), a rank's traffic to both classes adding up, plus the executor's
  local copies at the hardware's ``copy_bw`` (route/reverse: gather, pack, unpack, scatter =
  4 passes over the payload; Ulysses: one packing copy and one row permutation = 2).
- **Sync jitter**: ranks of a multi-rank bag meet 4× per layer; at every meeting all wait for
  the slowest. With the hardware's ``sync_jitter`` j (measured for two ranks doing identical
  work) a k-rank bag loses ``j · E[max of k] / E[max of 2] · compute`` (normal noise).
- With a calibrated profile, the per-call cost ``d`` of every block call (profile meta
  ``per_call_seconds``) is paid by every rank in every layer, balanced or not.
- **Waiting at exchanges**: an exchange involves only the ranks that move data in it, but the
  ranks of a synchronised set (overlapping multi-rank groups, :mod:`knapformer.plan.sync`)
  meet at every exchange of every layer, so each leaves a segment of the layer (the linear
  work; the attention with the ring's exposed exchanges; the Ulysses exchanges) when the
  set's slowest member does: a rank's step adds what it waits there (``wait_s``).
- Step time = max over ranks of compute + communication + waiting (nothing overlapped but
  the ring's exchanges; the gradient all-reduce, the same with and without balancing, is
  left out).

Pure numpy: no torch, no devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from knapformer.cluster.hardware import Hardware
from knapformer.plan import Plan, RankFeatures, SeqIndex, validate_seq_lens
from knapformer.plan.cost import (
    a2a_seconds,
    comm_features,
    expected_max_normal,
    jitter_factor,
    ring_exposed,
    route_seconds,
    ulysses_seconds,
)
from knapformer.plan.plan import spread_over_groups
from knapformer.plan.problem import sum_by
from knapformer.plan.sync import sync_sets, synced_times
from knapformer.workload import WorkloadModel

__all__ = ["ModelShape", "StepPrediction", "predict_step", "predict_unbalanced", "a2a_seconds", "expected_max_normal"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the cluster model needs of a model."""

    dim: int
    heads: int
    layers: int
    kv_heads: int | None = None
    """Key/value heads (GQA/MQA); None = ``heads``. Sets the k/v projection FLOPs and the kv
    share of each Ulysses exchange."""
    causal: bool = False
    recompute: bool = False
    bytes_per_value: int = 2
    """bf16 activations on the wire."""
    cost: WorkloadModel | None = None
    """The model's own cost in FLOPs per layer (the paper's form at γ = 1 with its terms: the
    linear FLOPs per token of its blocks, cross-attention over ``context_len`` text tokens —
    Wan): compute is priced from it. None: a standard block (``24·d²`` per token with the
    GQA share of the k/v projections, ``4·L²·d`` of attention)."""

    @classmethod
    def from_config(cls, cfg, *, recompute: bool = False) -> ModelShape:
        """The shape of a model config; a config with a ``workload(gamma)`` method (the
        integrated families') gives its cost terms too."""
        cost = cfg.workload(1.0) if callable(getattr(cfg, "workload", None)) else None
        return cls(
            dim=cfg.dim,
            heads=cfg.num_heads,
            kv_heads=getattr(cfg, "kv_heads", None),
            layers=cfg.num_layers,
            causal=getattr(cfg, "causal", False),
            recompute=recompute,
            cost=cost,
        )

    def workload(self) -> WorkloadModel:
        """The shape as the cost functions read it (width, heads, kv heads, layers, and the
        model's own terms): in FLOPs per layer, forward."""
        if self.cost is not None:
            return dataclasses.replace(
                self.cost,
                gamma=1.0,
                num_heads=self.heads,
                num_kv_heads=self.kv_heads,
                num_layers=self.layers,
                causal=self.causal,
            )
        return WorkloadModel(
            d_model=self.dim,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            num_layers=self.layers,
            causal=self.causal,
        )

    def with_context(self, context_len: int) -> ModelShape:
        """The same model cross-attending to ``context_len`` text tokens per sequence (the
        manifest's mean; only a model whose cost has a cross-attention term changes)."""
        if self.cost is None or not self.cost.context_len:
            return self
        return dataclasses.replace(self, cost=dataclasses.replace(self.cost, context_len=int(context_len)))

    @property
    def kv_ratio(self) -> float:
        return 1.0 if self.kv_heads is None else self.kv_heads / self.heads

    @property
    def passes(self) -> int:
        """Forward-equivalents per step: forward + backward (2×) (+ recompute)."""
        return 4 if self.recompute else 3


@dataclass(frozen=True)
class StepPrediction:
    compute_s: np.ndarray
    """(S,) compute seconds per rank."""
    route_s: np.ndarray
    """(S,) routing seconds per rank (4 all-to-alls)."""
    ulysses_s: np.ndarray
    """(S,) Ulysses seconds per rank (all layers, all passes)."""
    sync_s: np.ndarray
    """(S,) seconds waiting for the slowest bag member at Ulysses exchanges (sync jitter)."""
    flops: float
    """Hardware FLOPs of the step, all ranks."""
    tokens: int
    fixed_s: float = 0.0
    """Per-step time outside the blocks, the same for every rank and layout (optimizer,
    FSDP/DDP parameter and gradient traffic)."""
    ring_s: np.ndarray | float = 0.0
    """(S,) ring exchange seconds per rank not hidden behind attention (all layers, passes)."""
    wait_s: np.ndarray | float = 0.0
    """(S,) seconds a rank waits at its exchanges for the slowest rank of its synchronised set,
    segment by segment (:mod:`knapformer.plan.sync`; 0 for a rank that exchanges with nobody)."""
    control_s: float = 0.0
    """Seconds of the control plane on the step's critical path, every rank alike: the
    planner's measured time when the step is planned inline (``bal.plan``), 0 when it was
    planned ahead (``knapformer.data.PlannedSteps``)."""

    @property
    def rank_s(self) -> np.ndarray:
        parts = self.compute_s + self.route_s + self.ulysses_s + self.ring_s + self.sync_s + self.fixed_s
        return parts + self.wait_s + self.control_s

    @property
    def step_s(self) -> float:
        return float(self.rank_s.max())

    @property
    def comm_share(self) -> float:
        """Communication share of the critical rank's time."""
        r = int(np.argmax(self.rank_s))
        comm = self.route_s[r] + self.ulysses_s[r] + np.broadcast_to(self.ring_s, self.rank_s.shape)[r]
        return float(comm / self.rank_s[r]) if self.rank_s[r] > 0 else 0.0

    @property
    def imbalance(self) -> float:
        """Compute max/mean − 1."""
        m = self.compute_s.mean()
        return float(self.compute_s.max() / m - 1) if m > 0 else 0.0

    def hfu(self, hw: Hardware) -> float:
        return self.flops / (self.step_s * hw.peak_flops * self.compute_s.size) if self.step_s > 0 else 0.0

    def summary(self, hw: Hardware) -> dict:
        return {
            "step_s": self.step_s,
            "tokens_per_s": self.tokens / self.step_s if self.step_s else 0.0,
            "hfu": self.hfu(hw),
            "comm_share": self.comm_share,
            "imbalance": self.imbalance,
        }


def _compute_seconds(f: RankFeatures, shape: ModelShape, hw: Hardware, profile: WorkloadModel | None):
    """(S,) compute seconds of ranks with features ``f``: the profile's seconds (the planner's
    own cost function, per layer), else FLOPs over the achievable rate."""
    if profile is not None:
        # profile units: seconds per layer for what it timed (forward + backward by default)
        per_layer = f.cost(profile) + float(profile.meta.get("per_call_seconds", 0.0))
        mode = profile.meta.get("mode", "fwd+bwd")
        scale = shape.passes / (3 if mode == "fwd+bwd" else 1)
        return per_layer * shape.layers * scale
    flops = shape.passes * shape.layers * f.cost(shape.workload())
    return flops / hw.achievable_flops


def predict_step(
    plan: Plan,
    shape: ModelShape,
    hw: Hardware,
    *,
    profile: WorkloadModel | None = None,
    fixed_s: float = 0.0,
    rank_speed=None,
    attn_backend: str = "auto",
    control_s: float = 0.0,
) -> StepPrediction:
    """Per-rank prediction for a balanced step under ``plan`` (ranks = global GPU ids); with
    ``rank_speed`` a rank of speed s computes 1/s as fast. ``attn_backend="sdpa_mask"`` prices
    attention as the dense block-diagonal call it is (every pair of a rank's attention tokens of
    one degree), the other backends as per-sequence work. ``control_s``: the control plane's
    seconds on the critical path (planning inline: the plan's ``plan_seconds``; ahead: 0)."""
    if not (isinstance(control_s, (int, float)) and not isinstance(control_s, bool) and control_s >= 0):
        raise ValueError(f"control_s must be seconds >= 0, got {control_s!r}")
    S = plan.num_ranks
    feats = _masked(plan.features(), plan) if attn_backend == "sdpa_mask" else plan.features()
    compute = _compute_seconds(feats, shape, hw, profile) / _speeds(rank_speed, S)
    # -- exchanges: the planner's own cost function (knapformer.plan.cost)
    link = hw.link(shape)
    work = shape.workload()
    comm = comm_features(plan.index, plan.groups, plan.seq_group, plan.chunks, work, hw.gpus_per_node, plan.ring)
    route = route_seconds(comm, link)
    ulysses = ulysses_seconds(comm, link) * shape.layers
    # the ring hides behind the attention it overlaps with: that attention in seconds per layer
    attn_per_layer = (
        _compute_seconds(
            dataclasses.replace(feats, tokens=np.zeros(S), seqs=np.zeros(S), attn=comm.ring_attn), shape, hw, profile
        )
        / _speeds(rank_speed, S)
        / shape.layers
    )
    ring = _ring_seconds(comm, link, attn_per_layer) * shape.layers
    # -- sync jitter: every member of a multi-rank group waits for the slowest member at each
    # exchange; a rank pays for the largest group it is in
    sizes = np.fromiter((len(b) for b in plan.groups), dtype=np.int64, count=len(plan.groups))
    kmax = np.ones(S, dtype=np.int64)
    for b in np.unique(plan.seq_group).tolist() if plan.seq_group.size else []:
        members = list(plan.groups[b])
        kmax[members] = np.maximum(kmax[members], sizes[b])
    sync = hw.sync_jitter * jitter_factor(kmax) * compute
    # -- waiting: segment by segment, every rank of a synchronised set leaves with its slowest
    zero = dataclasses.replace(feats, tokens=np.zeros(S), seqs=np.zeros(S), attn=np.zeros(S))
    calls = _compute_seconds(zero, shape, hw, profile) / _speeds(rank_speed, S)  # per-call cost, if any
    attn = (
        _compute_seconds(dataclasses.replace(feats, tokens=np.zeros(S), seqs=np.zeros(S)), shape, hw, profile)
        / _speeds(rank_speed, S)
        - calls
    )
    segments = [compute - attn, attn + ring, ulysses]
    wait = synced_times(sync_sets(plan.groups, plan.seq_group, S), segments) - sum(segments)
    lens = plan.index.lengths
    flops = _model_flops(lens, shape)
    return StepPrediction(compute, route, ulysses, sync, flops, int(lens.sum()), fixed_s, ring, wait, float(control_s))


def _ring_seconds(comm, link, attn_per_layer: np.ndarray) -> np.ndarray:
    """Ring seconds per layer given each rank's ring attention in seconds per layer (all passes)."""
    if comm.ring_rounds <= 1:
        return np.zeros(comm.ring_kv.shape[1])
    return ring_exposed(comm.ring_kv[0], comm.ring_kv[1], comm.ring_rounds, attn_per_layer, link)


def _masked(f: RankFeatures, plan: Plan) -> RankFeatures:
    """Attention share of a block-diagonal masked call: per rank and degree k, one call over all
    A attention tokens with h/k heads costs A²/k instead of Σ L²/k."""
    S = plan.num_ranks
    k = plan.group_sizes().astype(np.float64)
    L = plan.index.lengths.astype(np.float64)
    attn = np.zeros(S)
    for degree in np.unique(k):
        tokens = spread_over_groups(plan.groups, plan.seq_group, np.where(k == degree, L, 0.0), S)
        attn += tokens * tokens / degree
    return dataclasses.replace(f, attn=attn)


def _speeds(rank_speed, S: int) -> np.ndarray:
    if rank_speed is None:
        return np.ones(S)
    s = np.asarray(rank_speed, dtype=np.float64)
    if s.shape != (S,):
        raise ValueError(f"rank_speed has {s.size} entries for {S} GPUs")
    return s


def predict_unbalanced(
    seq_lens,
    shape: ModelShape,
    hw: Hardware,
    *,
    profile: WorkloadModel | None = None,
    fixed_s: float = 0.0,
    rank_speed=None,
    attn_backend: str = "auto",
) -> StepPrediction:
    """Plain data parallel: every rank computes its own sequences, nothing moves."""
    index = SeqIndex(validate_seq_lens(seq_lens))
    S = index.num_ranks
    lens = index.lengths.astype(np.float64)
    feats = RankFeatures(  # every sequence alone on its source rank
        tokens=index.rank_tokens.astype(np.float64),
        attn=sum_by(index.src_rank, lens * lens, S),
        seqs=index.counts.astype(np.float64),
    )
    if attn_backend == "sdpa_mask":  # one dense masked call over all of a rank's tokens
        feats = dataclasses.replace(feats, attn=feats.tokens**2)
    compute = _compute_seconds(feats, shape, hw, profile) / _speeds(rank_speed, S)
    flops = _model_flops(lens, shape)
    return StepPrediction(compute, np.zeros(S), np.zeros(S), np.zeros(S), flops, int(lens.sum()), fixed_s)


def _model_flops(lens: np.ndarray, shape: ModelShape) -> float:
    """Hardware FLOPs of a step's sequences (each once, wherever it runs), all layers and passes."""
    return float(shape.passes * shape.layers * np.asarray(shape.workload().cost(lens)).sum())
