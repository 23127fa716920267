"""What one sequence costs a member of its group in exchanges, per group size: the estimates
the moldable planner picks degrees by, and the lower figures the bounds are made of (cost
units per layer; arrays broadcast, so many sizes are priced in one call). Plans themselves are
priced exactly from their chunk tables by :mod:`knapformer.plan.cost`.

Pure numpy.
"""

from __future__ import annotations

import numpy as np

from knapformer.plan.cost import LinkModel, heads_of, kv_values, ring_exposed, widths
from knapformer.workload import WorkloadModel

__all__ = ["member_comm_estimate", "member_comm_lower", "route_home_estimate", "split_total_lower", "ulysses_member"]


def route_home_estimate(L, k, model: WorkloadModel, link: LinkModel):
    """Cost units the source rank of a sequence of length L split over a k-group pays to send
    the (k − 1)/k of it that leaves (route and reverse, forward and backward), per layer as
    :func:`~knapformer.plan.plan.rank_times` adds it; across nodes when the group spans more
    than a node. A video of 250k tokens sends ~1.5 GB: its source rank should take less other
    work (the moldable planner adds this to it before placing)."""
    L = np.asarray(L, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    cross = k > link.gpus_per_node
    bw = np.where(cross, link.inter_bw, link.intra_bw)
    lat = np.where(cross, link.inter_latency, link.intra_latency)
    sent = L * (k - 1) / k * model.d_model * link.bytes_per_value
    one = lat + sent / bw
    if link.copy_bw is not None:  # 4 local passes per exchange, as route_seconds prices them
        one = one + 4 * L / k * model.d_model * link.bytes_per_value / link.copy_bw
    return np.where(k > 1, 4 * one / model.num_layers * link.units_per_second, 0.0)


def _ring_member(L, k, ring, model: WorkloadModel, link: LinkModel, cross, latency: bool, gather: bool = False):
    """Cost units one member of a k-group run as ``ring`` sub-groups pays for its ring exchanges
    of a sequence of length L (see :func:`ring_exposed`; ``gather``: the ``pre_attn`` path's
    all-gather); arrays broadcast."""
    L = np.asarray(L, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    ring = np.asarray(ring, dtype=np.float64)
    u = k // ring
    sent = (ring - 1) * (L / ring) * kv_values(u, model)
    attn_s = model.quad_coef * L * L / k / link.units_per_second
    intra, inter = np.where(cross, 0.0, sent), np.where(cross, sent, 0.0)
    return ring_exposed(intra, inter, ring, attn_s, link, latency=latency, gather=gather) * link.units_per_second


def ulysses_member(L, u, model: WorkloadModel, link: LinkModel, cross, *, lower: bool):
    """Cost units one member of a u-way Ulysses (sub-)group pays for a block of L tokens: the
    least it must receive and send (``lower``: L − ⌈L/u⌉ tokens' heads, latency left out), or
    what it typically moves (L·(u − 1)/u, plus the local copies); arrays broadcast."""
    L = np.asarray(L, dtype=np.float64)
    u = np.maximum(np.asarray(u, dtype=np.float64), 1.0)
    w, o = widths(u, model)
    bw = np.where(cross, link.inter_bw, link.intra_bw)
    if lower:
        # (a ring's block L/r may be under a token: never a negative volume)
        seconds = np.maximum(L - np.ceil(L / u), 0.0) * (w + o) * link.bytes_per_value / bw
    else:
        seconds = L * (u - 1) / u * (w + o) * link.bytes_per_value / bw
        if link.copy_bw is not None:
            h, h_kv, d = heads_of(model)
            copied = L / u * ((h + 2 * h_kv) * d + h * d + u * (w + o))  # pack + gather, pre and post
            seconds = seconds + copied * link.bytes_per_value / link.copy_bw
    return np.where(u > 1, seconds * link.exchange_passes * link.units_per_second, 0.0)


def _member_comm(
    L, k, model: WorkloadModel, link: LinkModel, cross, ring, *, lower: bool, gather: bool = False, exposed: bool = True
):
    L = np.asarray(L, dtype=np.float64)
    k = np.asarray(k, dtype=np.int64)
    ring = np.asarray(ring, dtype=np.int64)
    u = k // ring
    gpn = link.gpus_per_node
    ringed = ring > 1
    sub = ulysses_member(L / ring, u, model, link, np.where(ringed, u > gpn, cross), lower=lower)
    if not exposed:  # the ring's exchanges left out (what the attention they overlap hides varies)
        return np.where(k > 1, sub, 0.0)
    ring_cross = k > gpn if lower else cross
    around = _ring_member(L, k, np.maximum(ring, 1), model, link, ring_cross, latency=not lower, gather=gather)
    out = np.where(k > 1, sub + np.where(ringed, around, 0.0), 0.0)
    return out


def member_comm_lower(
    L: np.ndarray, k, model: WorkloadModel, link: LinkModel, *, cross=False, ring=1, gather=False, exposed=True
):
    """A lower bound on what the busiest member of a k-group pays for one sequence of length L,
    in cost units: it receives at least (L − ⌈L/k⌉) tokens' heads before and sends as many
    outputs after attention (latency left out: it is shared by all sequences of a rank). Run as
    ``ring`` sub-groups of u = k/r: that over its block of L/r tokens inside the sub-group
    (across nodes when u exceeds a node), plus its ring exchanges (across nodes when k exceeds
    a node) beyond the attention they overlap with (per sequence: what a rank's attention
    hides depends on all its ring sequences and the plan's largest ring, see
    :mod:`knapformer.plan.bound`).
    ``k``, ``ring`` (and ``cross``) may be arrays that broadcast against L: many group sizes
    priced in one call. ``gather``: rings run as the ``pre_attn`` path's K/V all-gather;
    ``exposed=False`` leaves the ring exchanges out (a proof where the per-sequence ring
    pricing is none: see :func:`~knapformer.plan.bound.size_costs`)."""
    return _member_comm(L, k, model, link, cross, ring, lower=True, gather=gather, exposed=exposed)


def split_total_lower(L: np.ndarray, k, model: WorkloadModel, link: LinkModel, *, ring=1) -> np.ndarray:
    """A lower bound on what all members of a k-group together pay for one sequence of length
    L beyond :func:`member_comm_lower` each, in cost units per layer: the local copies of its
    Ulysses exchanges (exactly what :func:`ulysses_seconds` charges for it: its tokens' heads
    packed and its block's heads gathered, pre and post, every pass), and its route — a plan
    that splits a sequence routes (:func:`route_seconds`): every token of it is copied 4 times
    in each of the 4 exchanges, and its source sends at least the L − ⌈L/k⌉ tokens it cannot
    keep (at the faster link, latency left out). Arrays broadcast as in :func:`member_comm_lower`."""
    L = np.asarray(L, dtype=np.float64)
    k = np.asarray(k, dtype=np.int64)
    ring = np.asarray(ring, dtype=np.int64)
    u = k // np.maximum(ring, 1)
    b, d_model = link.bytes_per_value, model.d_model
    h, h_kv, d = heads_of(model)
    send = np.maximum(L - np.ceil(L / np.maximum(k, 1)), 0.0) * d_model * b / max(link.intra_bw, link.inter_bw)
    seconds = 4 * send / model.num_layers
    if link.copy_bw is not None:
        w, o = widths(np.maximum(u, 1), model)
        ulysses = np.where(u > 1, L * ((h + 2 * h_kv) * d + h * d) + k * (L / np.maximum(ring, 1)) * (w + o), 0.0)
        seconds = seconds + ulysses * b / link.copy_bw * link.exchange_passes
        seconds = seconds + 16 * L * d_model * b / link.copy_bw / model.num_layers
    return np.where(k > 1, seconds * link.units_per_second, 0.0)


def member_comm_estimate(L: np.ndarray, k, model: WorkloadModel, link: LinkModel, *, cross=False, ring=1, gather=False):
    """What one member of a k-group typically pays for a sequence of length L, in cost units:
    it holds L/k tokens, so it sends and receives L·(k−1)/k tokens' heads per exchange (plus
    the local copies). Run as ``ring`` sub-groups: that inside its sub-group over a block of
    L/r tokens, plus its exposed ring exchanges (``cross``: the ring crosses nodes). The
    planner's per-sequence estimate; plans are then priced exactly by :func:`ulysses_seconds`
    and :func:`ring_seconds`. Arrays broadcast as in :func:`member_comm_lower`; ``gather`` as
    there."""
    return _member_comm(L, k, model, link, cross, ring, lower=False, gather=gather)
