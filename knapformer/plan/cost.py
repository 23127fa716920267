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

import math
from dataclasses import dataclass

import numpy as np

from knapformer.plan.seqindex import DST, IDX, LEN, SRC, SeqIndex, spread_over_groups, sum_by
from knapformer.workload import WorkloadModel

__all__ = [
    "CommFeatures",
    "LinkModel",
    "a2a_seconds",
    "comm_features",
    "member_comm_estimate",
    "member_comm_lower",
    "route_seconds",
    "ulysses_seconds",
]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The links between the ranks of a balancing group, and how a second compares with the
    cost model's units. Build it by hand, from a hardware preset (``knapformer.cluster``'s
    ``Hardware.link``), or leave it out (no communication cost: the bag solvers' plans and
    times are then exactly those of the compute-only model)."""

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
        for name in ("gpus_per_node", "bytes_per_value", "exchange_passes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LinkModel.{name} must be an int >= 1, got {v!r}")


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
    joins: bool
    routes: bool
    """Some token changes rank or some group has several members: route and reverse run (a plan
    that keeps every sequence whole at home routes nothing — the executor skips it)."""


def comm_features(
    index: SeqIndex, groups, seq_group: np.ndarray, chunks: np.ndarray, model: WorkloadModel, gpus_per_node: int
) -> CommFeatures:
    """The exchanges of a chunk table (see module docstring), exact per member."""
    S = index.num_ranks
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
    cross = np.fromiter((len({r // gpus_per_node for r in g}) > 1 for g in groups), dtype=bool, count=len(groups))
    k = sizes[seq_group].astype(np.float64)
    multi = k > 1
    w, o = widths(np.maximum(k, 1), model)
    L = index.lengths.astype(np.float64)
    gid = index.gid(chunks[:, SRC], chunks[:, IDX])
    ck = k[gid]
    cm = multi[gid]
    out = {}
    for name in ("pre_send", "pre_recv", "post_send", "post_recv", "route_send", "route_recv"):
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
    for cls in (0, 1):
        seq_sel = multi & (cross[seq_group] == bool(cls))
        ch_sel = cm & (cross[np.asarray(seq_group)[gid]] == bool(cls))
        held = ln * ch_sel
        # per member: Σ L over its groups' sequences (a member holding nothing still receives)
        all_L_w = spread_over_groups(groups, seq_group, np.where(seq_sel, L * w, 0.0), S)
        all_L_o = spread_over_groups(groups, seq_group, np.where(seq_sel, L * o, 0.0), S)
        own_w = sum_by(dst, held * w[gid], S)
        own_o = sum_by(dst, held * o[gid], S)
        out["pre_send"][cls] = sum_by(dst, held * (ck - 1) * w[gid], S)
        out["pre_recv"][cls] = all_L_w - own_w
        out["post_send"][cls] = all_L_o - own_o
        out["post_recv"][cls] = sum_by(dst, held * (ck - 1) * o[gid], S)
    route_copy = sum_by(dst, ln, S) * model.d_model
    routes = bool(multi.any() or (src != dst).any())
    return CommFeatures(joins=bool(multi.any()), routes=routes, ulysses_copy=copy, route_copy=route_copy, **out)


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


def member_comm_lower(L: np.ndarray, k: int, model: WorkloadModel, link: LinkModel, *, cross: bool = False):
    """A lower bound on what the busiest member of a k-group pays for one sequence of length L,
    in cost units: it receives at least (L − ⌈L/k⌉) tokens' heads before and sends as many
    outputs after attention (latency left out: it is shared by all sequences of a rank)."""
    if k <= 1:
        return np.zeros(np.shape(L))
    w, o = widths(np.asarray([k]), model)
    bw = link.inter_bw if cross else link.intra_bw
    L = np.asarray(L, dtype=np.float64)
    other = L - np.ceil(L / k)
    seconds = other * (w[0] + o[0]) * link.bytes_per_value / bw * link.exchange_passes
    return seconds * link.units_per_second


def member_comm_estimate(L: np.ndarray, k: int, model: WorkloadModel, link: LinkModel, *, cross: bool = False):
    """What one member of a k-group typically pays for a sequence of length L, in cost units:
    it holds L/k tokens, so it sends and receives L·(k−1)/k tokens' heads per exchange (plus
    the local copies). The planner's per-sequence estimate; plans are then priced exactly by
    :func:`ulysses_seconds`."""
    if k <= 1:
        return np.zeros(np.shape(L))
    w, o = widths(np.asarray([k]), model)
    bw = link.inter_bw if cross else link.intra_bw
    L = np.asarray(L, dtype=np.float64)
    moved = L * (k - 1) / k * (w[0] + o[0]) * link.bytes_per_value
    seconds = moved / bw
    if link.copy_bw is not None:
        h, h_kv, d = heads_of(model)
        copied = L / k * ((h + 2 * h_kv) * d + h * d + k * (w[0] + o[0]))  # pack + gather, pre and post
        seconds = seconds + copied * link.bytes_per_value / link.copy_bw
    return seconds * link.exchange_passes * link.units_per_second
