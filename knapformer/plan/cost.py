"""The communication side of the cost: what a rank pays for the Ulysses exchanges of its groups.

One function prices a plan's exchanges per rank (:func:`ulysses_seconds`), used by the planner
(``Plan.time_after``, the moldable solver) and by the cluster model, so a group of 8 no longer
looks as cheap as 8 groups of 1. Per attention layer a member of a k-rank group sends its own
tokens' q, k, v heads of every other member and receives the other members' tokens for its own
heads (pre), then the reverse for the output (post); forward and backward each run both.

Per member m of a k-group holding ℓ_m of a sequence's L tokens, with w_k = (h/k + 2·kv_k)·D
and o_k = (h/k)·Dv elements per token (kv_k = h_kv/k, or 1 replicated head when h_kv < k):

    pre:  sends ℓ_m·(k−1)·w_k, receives (L − ℓ_m)·w_k       post: sends (L − ℓ_m)·o_k, receives ℓ_m·(k−1)·o_k

A rank's exchange costs ``latency + max(sent, received) / bandwidth`` per link class (inside a
node / across nodes), summed over its groups' sequences; every rank of a plan that has any
multi-rank group joins each exchange. Seconds become planner units through
``LinkModel.units_per_second`` (1 for a calibrated fwd+bwd profile; achievable FLOP/s ÷ 3 for
the paper's FLOP form, whose unit is one forward FLOP).

Pure numpy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from knapformer.plan.seqindex import DST, IDX, LEN, SRC, SeqIndex, group_arrays, spread_over_groups, sum_by
from knapformer.workload import WorkloadModel

__all__ = [
    "CommFeatures",
    "LinkModel",
    "a2a_seconds",
    "comm_features",
    "expected_max_normal",
    "jitter_factor",
    "kv_values",
    "ring_exposed",
    "ring_seconds",
    "route_seconds",
    "ulysses_seconds",
]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The links between the ranks of a balancing group, and how a second compares with the
    cost model's units. Build it by hand, from a hardware preset (``knapformer.cluster``'s
    ``Hardware.link``), or measure it: a balancer built without one
    (``BalancerConfig.link=None``, the default) probes its group's links when it is built
    (:mod:`knapformer.distributed.link_probe`). Only the planner's own functions
    (``plan_sequences(..., link=None)``) read a missing link as free exchanges, as
    ``BalancerConfig.link="free"`` does: the bag solvers' plans and times are then exactly those
    of the compute-only model."""

    intra_bw: float
    """Bytes/s per rank per direction between ranks of one node."""
    inter_bw: float
    """Bytes/s per rank per direction between nodes."""
    intra_latency: float = 15e-6
    inter_latency: float = 30e-6
    gpus_per_node: int = 8
    bytes_per_value: int = 2
    """Bytes of one activation value on the wire (2 for bf16)."""
    units_per_second: float = 1.0
    """Cost-model units per second (1.0 for a calibrated profile in seconds)."""
    exchange_passes: int = 2
    """Exchanges per layer and direction: forward + backward (3 with activation recompute)."""
    copy_bw: float | None = None
    """Bytes/s of the executor's local copies around each exchange (packing, permutations);
    None = free."""
    sync_jitter: float = 0.0
    """Share of its compute a member of a two-rank group loses waiting for the slower one at
    the exchanges (a k-rank group: × :func:`jitter_factor`); 0 = steady kernels."""

    def __post_init__(self) -> None:
        for name in ("intra_bw", "inter_bw", "units_per_second"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"LinkModel.{name} must be a finite number > 0, got {v!r}")
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LinkModel.{name} must be a finite number >= 0, got {v!r}")
        if self.copy_bw is not None and not (isinstance(self.copy_bw, (int, float)) and self.copy_bw > 0):
            raise ValueError(f"LinkModel.copy_bw must be > 0 or None, got {self.copy_bw!r}")
        if not (isinstance(self.sync_jitter, (int, float)) and 0 <= self.sync_jitter < 1):
            raise ValueError(f"LinkModel.sync_jitter must be in [0, 1), got {self.sync_jitter!r}")
        for name in ("gpus_per_node", "bytes_per_value", "exchange_passes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LinkModel.{name} must be an int >= 1, got {v!r}")


@functools.cache
def expected_max_normal(k: int) -> float:
    """E[max of k independent standard normals] (0 for k = 1, 1/√π for k = 2)."""
    if k <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0, 4001)
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    integrand = x * k * pdf * cdf ** (k - 1)
    return float(np.sum(integrand) * (x[1] - x[0]))


def jitter_factor(k) -> np.ndarray:
    """E[max of k] / E[max of 2] standard normals, per group size k (0 for k = 1): how much of
    a k-rank group's compute its members lose waiting for the slowest at each exchange, in
    units of the two-rank loss ``LinkModel.sync_jitter``."""
    k = np.asarray(k, dtype=np.int64)
    table = {int(v): expected_max_normal(int(v)) / expected_max_normal(2) for v in np.unique(k)}
    return np.vectorize(table.__getitem__, otypes=[np.float64])(k) if k.size else np.zeros(k.shape)


def heads_of(model: WorkloadModel) -> tuple[int, int, int]:
    """(h, h_kv, head dim) the exchanges move; without head counts a model is priced as one
    head of d_model values (the byte volume is the same for every k dividing the heads)."""
    h = model.num_heads or 1
    h_kv = model.num_kv_heads or h
    return h, h_kv, model.d_model / h


def widths(k: np.ndarray, model: WorkloadModel) -> tuple[np.ndarray, np.ndarray]:
    """(pre, post) elements per token a member of a k-group exchanges with each other member."""
    h, h_kv, d = heads_of(model)
    k = np.asarray(k, dtype=np.float64)
    hq = h / k
    if model.num_heads is None:  # heads unknown: kv heads split like the query heads
        kv = hq * (h_kv / h)
    else:  # h_kv/k each, or one replicated kv head when k does not divide h_kv
        kv = np.where(np.mod(h_kv, k) == 0, h_kv / k, 1.0)
    return (hq + 2.0 * kv) * d, hq * d


@dataclass(frozen=True)
class CommFeatures:
    """Per rank: elements sent and received in the pre and post exchanges of one layer and in
    the route (by link class: row 0 inside a node, row 1 across nodes), elements copied
    locally, and whether the plan has any multi-rank group (then every rank joins each
    exchange)."""

    pre_send: np.ndarray  # (2, S)
    pre_recv: np.ndarray
    post_send: np.ndarray
    post_recv: np.ndarray
    ulysses_copy: np.ndarray  # (S,) per layer: packing + gathering, pre and post
    route_send: np.ndarray  # (2, S) per route
    route_recv: np.ndarray
    route_copy: np.ndarray  # (S,) per route: the tokens the rank gathers and receives
    ring_kv: np.ndarray
    """(2, S) per layer forward: K/V values the rank sends (and receives) around its rings,
    Σ over its ring sequences of (r − 1) blocks of L/r tokens × its kv heads × (D + Dv)."""
    ring_attn: np.ndarray
    """(S,) Σ L²/k over its ring sequences: the attention its ring exchanges can hide behind."""
    ring_rounds: int
    """The largest ring of the plan (every rank joins its rounds)."""
    joins: bool
    routes: bool
    """Some token changes rank or some group has several members: route and reverse run (a plan
    that keeps every sequence whole at home routes nothing — the executor skips it)."""


def comm_features(
    index: SeqIndex,
    groups,
    seq_group: np.ndarray,
    chunks: np.ndarray,
    model: WorkloadModel,
    gpus_per_node: int,
    ring=None,
) -> CommFeatures:
    """The exchanges of a chunk table (see module docstring), exact per member for Ulysses
    groups; a ring group (``ring[g]`` = r > 1 sub-groups of u = k/r members) exchanges Ulysses
    rows inside each sub-group (over its block, priced as L/r tokens) and K/V blocks of L/r
    tokens between sub-groups (:func:`ring_seconds`)."""
    S = index.num_ranks
    sizes = group_arrays(groups)[0]
    rings = np.ones(len(groups), dtype=np.int64) if ring is None else np.asarray(ring, dtype=np.int64)
    us = sizes // rings
    # a group's Ulysses exchanges cross nodes when a sub-group spans several; its ring when the
    # group spans more nodes than a sub-group
    spans = np.ones(len(groups), dtype=np.int64)
    for i in np.flatnonzero(sizes > 1).tolist():
        spans[i] = len({m // gpus_per_node for m in groups[i]})
    sub_spans = spans.copy()
    for i in np.flatnonzero(rings > 1).tolist():
        g, u = groups[i], int(us[i])
        sub_spans[i] = max(len({m // gpus_per_node for m in g[j : j + u]}) for j in range(0, len(g), u))
    cross = sub_spans > 1
    ring_cross = spans > sub_spans
    k = us[seq_group].astype(np.float64)  # the Ulysses size of each sequence's group
    r_seq = rings[seq_group].astype(np.float64)
    multi = k > 1
    w, o = widths(np.maximum(k, 1), model)
    L = index.lengths.astype(np.float64) / r_seq  # the block a sub-group gathers
    gid = index.gid(chunks[:, SRC], chunks[:, IDX])
    ck = k[gid]
    cm = multi[gid]
    out = {}
    for name in ("pre_send", "pre_recv", "post_send", "post_recv", "route_send", "route_recv", "ring_kv"):
        out[name] = np.zeros((2, S))
    h, h_kv, d = heads_of(model)
    src, dst, ln = chunks[:, SRC], chunks[:, DST], chunks[:, LEN].astype(np.float64)
    same_node = (src // gpus_per_node) == (dst // gpus_per_node)
    for cls, sel in ((0, (src != dst) & same_node), (1, (src != dst) & ~same_node)):
        out["route_send"][cls] = sum_by(src[sel], ln[sel] * model.d_model, S)
        out["route_recv"][cls] = sum_by(dst[sel], ln[sel] * model.d_model, S)
    held_multi = sum_by(dst, ln * cm, S)
    attn_multi = spread_over_groups(groups, seq_group, np.where(multi, L * (w + o), 0.0), S)
    copy = held_multi * ((h + 2 * h_kv) * d + h * d) + attn_multi
    ring_seq = r_seq > 1
    sent = np.where(ring_seq, (r_seq - 1) * L * kv_values(k, model), 0.0)  # r − 1 blocks of L/r tokens
    mc = np.flatnonzero(cm)  # the chunks of split sequences (the others exchange nothing)
    m_dst, m_gid, m_ln = dst[mc], gid[mc], ln[mc]
    m_cross, m_k, m_w, m_o = cross[np.asarray(seq_group)[m_gid]], ck[mc], w[m_gid], o[m_gid]
    for cls in (0, 1):
        seq_sel = multi & (cross[seq_group] == bool(cls))
        held = m_ln * (m_cross == bool(cls))
        # per member: Σ L over its groups' sequences (a member holding nothing still receives)
        all_L_w = spread_over_groups(groups, seq_group, np.where(seq_sel, L * w, 0.0), S)
        all_L_o = spread_over_groups(groups, seq_group, np.where(seq_sel, L * o, 0.0), S)
        own_w = sum_by(m_dst, held * m_w, S)
        own_o = sum_by(m_dst, held * m_o, S)
        out["pre_send"][cls] = sum_by(m_dst, held * (m_k - 1) * m_w, S)
        out["pre_recv"][cls] = all_L_w - own_w
        out["post_send"][cls] = all_L_o - own_o
        out["post_recv"][cls] = sum_by(m_dst, held * (m_k - 1) * m_o, S)
        ring_sel = ring_seq & (ring_cross[seq_group] == bool(cls))
        out["ring_kv"][cls] = spread_over_groups(groups, seq_group, np.where(ring_sel, sent, 0.0), S)
    full = index.lengths.astype(np.float64)
    ring_attn = spread_over_groups(groups, seq_group, np.where(ring_seq, full * full / (k * r_seq), 0.0), S)
    route_copy = sum_by(dst, ln, S) * model.d_model
    routes = bool((sizes[seq_group] > 1).any() or (src != dst).any())
    return CommFeatures(
        joins=bool(multi.any()),
        routes=routes,
        ring_rounds=int(rings[_used(seq_group, len(groups))].max()) if seq_group.size else 1,
        ring_attn=ring_attn,
        ulysses_copy=copy,
        route_copy=route_copy,
        **out,
    )


def _used(seq_group: np.ndarray, num_groups: int) -> np.ndarray:
    """(G,) whether some sequence runs on each group (a mask: no sort)."""
    used = np.zeros(num_groups, dtype=bool)
    used[seq_group] = True
    return used


def a2a_seconds(sent: np.ndarray, recv: np.ndarray, bw: float, latency: float) -> np.ndarray:
    """Per-rank time of one all-to-all over one link class: latency (if the rank moves
    anything) + max(sent, received) / bandwidth."""
    moved = np.maximum(sent, recv)
    return np.where(moved > 0, latency + moved / bw, 0.0)


def _a2a(send: np.ndarray, recv: np.ndarray, link: LinkModel) -> np.ndarray:
    """(S,) one exchange over both link classes (a rank's traffic to each adds up)."""
    b = link.bytes_per_value
    return a2a_seconds(send[0] * b, recv[0] * b, link.intra_bw, link.intra_latency) + a2a_seconds(
        send[1] * b, recv[1] * b, link.inter_bw, link.inter_latency
    )


def ulysses_seconds(f: CommFeatures, link: LinkModel) -> np.ndarray:
    """(S,) seconds per layer (all exchange passes) each rank spends in Ulysses exchanges,
    local copies included."""
    if not f.joins:
        return np.zeros(f.pre_send.shape[1])
    t = _a2a(f.pre_send, f.pre_recv, link) + _a2a(f.post_send, f.post_recv, link)
    if link.copy_bw is not None:
        t = t + f.ulysses_copy * link.bytes_per_value / link.copy_bw
    return t * link.exchange_passes


def kv_values(u, model: WorkloadModel):
    """K and V values per token one member of a u-way Ulysses (sub-)group holds: its kv heads
    (h_kv/u, or one replicated head when u does not divide h_kv) × (D + Dv)."""
    h, h_kv, d = heads_of(model)
    u = np.maximum(np.asarray(u, dtype=np.float64), 1.0)
    if model.num_heads is None:  # heads unknown: kv heads split like the query heads
        return (h_kv / u) * 2 * d
    return np.where(np.mod(h_kv, u) == 0, h_kv / u, 1.0) * 2 * d


def ring_exposed(
    sent_intra, sent_inter, rounds, attn_seconds, link: LinkModel, *, latency: bool = True, gather: bool = False
):
    """Seconds per layer (all passes) a member's ring exchanges add to its time — what the block
    attention they overlap with does not hide (the executor issues round j + 1's exchange before
    computing round j). ``sent_*``: K/V values it sends per layer forward (= receives) over each
    link class; ``attn_seconds``: its ring attention per layer, forward + backward.

    Forward: ``rounds − 1`` exchanges of K/V, hidden behind all but the last round's blocks
    (⅓ of the attention is forward). Backward: the K/V again plus their gradients back to the
    owners (fp32 when activations travel in half precision), ``rounds`` exchanges, hidden
    behind ⅔ of the attention the same way. With activation recompute the forward runs twice.

    ``gather`` (the ``pre_attn`` path, :mod:`knapformer.distributed.kv_gather`): one
    all-gather of the same K/V per forward pass and one exchange of their gradients (in the
    activations' dtype) per backward, before and after the kernel call — nothing hides them."""
    R = np.asarray(rounds, dtype=np.float64)
    b = link.bytes_per_value
    kv = np.asarray(sent_intra) * b / link.intra_bw + np.asarray(sent_inter) * b / link.inter_bw
    lat = 0.0
    if latency:
        lat = np.where(np.asarray(sent_inter) > 0, link.inter_latency, link.intra_latency)
    fwd_passes = max(link.exchange_passes - 1, 1)
    if gather:
        return np.where(R > 1, (fwd_passes + 1) * (lat + kv), 0.0)
    grads = max(4.0 / b, 1.0)
    hide = np.where(R > 1, (R - 1) / np.maximum(R, 1), 0.0) * np.asarray(attn_seconds)
    fwd = np.maximum((R - 1) * lat + kv - hide / 3.0, 0.0)
    bwd = np.maximum(R * lat + kv * (1.0 + grads) - 2.0 * hide / 3.0, 0.0)
    return np.where(R > 1, fwd_passes * fwd + bwd, 0.0)


def ring_seconds(
    f: CommFeatures, link: LinkModel, model: WorkloadModel, speed: np.ndarray | float = 1.0, *, gather: bool = False
) -> np.ndarray:
    """(S,) seconds per layer each rank spends in ring exchanges beyond the attention they
    overlap with (:func:`ring_exposed`); every rank joins every round of the plan's largest
    ring (``gather``: the one all-gather of the ``pre_attn`` path instead)."""
    if f.ring_rounds <= 1:
        return np.zeros(f.ring_kv.shape[1])
    attn_s = model.quad_coef * f.ring_attn / np.asarray(speed, dtype=np.float64) / link.units_per_second
    return ring_exposed(f.ring_kv[0], f.ring_kv[1], f.ring_rounds, attn_s, link, gather=gather)


def route_seconds(f: CommFeatures, link: LinkModel) -> np.ndarray:
    """(S,) seconds per step of route and reverse, forward and backward (4 exchanges), local
    copies included (4 passes: gather, pack, unpack, scatter); none for a plan that routes
    nothing."""
    if not f.routes:
        return np.zeros(f.route_send.shape[1])
    t = _a2a(f.route_send, f.route_recv, link)
    if link.copy_bw is not None:
        t = t + 4 * f.route_copy * link.bytes_per_value / link.copy_bw
    return 4 * t


_MOVED = {
    "member_comm_estimate": "knapformer.plan.member_comm",
    "member_comm_lower": "knapformer.plan.member_comm",
    "route_home_estimate": "knapformer.plan.member_comm",
}
"""Names this module exported in 0.1.0 that moved in 0.2.0 (kept for one minor version)."""


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(
            f"knapformer.plan.cost.{name} moved to {_MOVED[name]} in 0.2.0; the old name goes in 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
