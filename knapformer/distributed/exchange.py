"""The one exchange primitive: batched point-to-point with exactly the peers that move data.

Every data exchange of the balancer — route and reverse, the Ulysses exchanges around
attention, each ring round, the K/V gather of ``pre_attn``, the context and per-sequence rows,
and all their backward passes — goes through :func:`exchange`. It posts one receive per peer
that sends this rank something and one send per peer it sends something to, in one
``batch_isend_irecv`` (one NCCL group call), and copies the rows it keeps to itself locally. A
rank with no peer in an exchange posts nothing and waits for nobody.

Why not ``all_to_all_single`` over the balancing group: a collective with empty splits still
waits for every member (and under NCCL posts a zero-byte send and receive to every peer), so
each exchange would make every rank of the group wait for the slowest — a barrier per layer
and direction, where the plan prices each group's exchanges as its own members' business.

Deadlock freedom (any plan: overlapping groups, rings): every rank issues the step's exchanges
in one order that all ranks share — the calls are the same on every rank (agreed, or checked
against the step's schedule, :mod:`.checks`), autograd runs their backward passes in the same
order, and a rank skips the exchanges it has no peer in. One exchange is one group call (NCCL
completes a group's sends and receives in any order), and the pending exchange with the
smallest position in that shared order always has all its peers at it or on their way, so it
completes. On NCCL, ``batch_isend_irecv`` reuses the group's communicator, which construction
creates with an exchange among all members (:func:`warm_up`): the first call on a communicator
must involve every rank, later ones may involve any subset. Plain ``send``/``recv`` would open
a 2-rank communicator per pair instead.

On gloo every kind of exchange has its own tag (:data:`TAGS`), so messages of two exchanges in
flight between the same pair (a ring round's K/V and the previous round's gradients) can never
be matched with each other: gloo aborts the process on a receive of another size.

Split sizes are given once per plan as a :class:`Peers` value (the non-zero entries only), so
the work per call is proportional to the peers, not to the group's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

import knapformer.distributed.lifetime as lifetime

__all__ = ["TAGS", "Exchange", "Peers", "exchange", "exchange_async", "global_ranks", "handshake", "warm_up"]

TAGS = {
    "route": 1,
    "reverse_route": 2,
    "pre_attn": 3,
    "post_attn": 4,
    "kv_gather": 5,
    "ring": 6,
    "ring grads": 7,
    "route_context": 8,
    "route_context sizes": 9,
    "gather_sequences": 10,
    "probe": 11,
    "header": 12,
}
"""The gloo tag of each kind of exchange (a backward pass adds 32: its messages never meet the
forward's). NCCL ignores tags."""

_BACKWARD_TAG = 32
_PART_TAG = 64
"""Tensors of several dtypes exchanged together travel in one exchange per dtype: the k-th adds
k × this to its tag, so a pair's messages of two dtypes are never matched with each other."""


@dataclass(frozen=True)
class Peers:
    """One rank's side of an exchange: rows (or elements) to and from each peer, non-zero only.

    ``send``/``recv``: ``(peer, offset, count)`` for each other member of the group that this
    rank sends to / receives from, in ascending peer order; ``local``: ``(send offset, receive
    offset, count)`` of the rows this rank keeps."""

    send: tuple[tuple[int, int, int], ...]
    recv: tuple[tuple[int, int, int], ...]
    local: tuple[int, int, int]
    num_send: int
    """Rows of the input (the sum of every count sent, kept included)."""
    num_recv: int
    """Rows of the output."""
    holes: bool = False
    """Some peers of the plan's exchange are left out (:meth:`without`): their rows of the
    output are zeros."""

    @classmethod
    def from_splits(cls, send_splits: Sequence[int], recv_splits: Sequence[int], rank: int) -> Peers:
        """From dense split sizes indexed by group rank (``all_to_all_single``'s form): O(group
        size), so build it once per plan."""
        send, recv, local = [], [], [0, 0, 0]
        off = 0
        for peer, n in enumerate(send_splits):
            n = int(n)
            if peer == rank:
                local[0], local[2] = off, n
            elif n:
                send.append((peer, off, n))
            off += n
        num_send, off = off, 0
        for peer, n in enumerate(recv_splits):
            n = int(n)
            if peer == rank:
                local[1] = off
                if n != local[2]:
                    raise ValueError(f"rank {rank} keeps {local[2]} rows but receives {n} from itself")
            elif n:
                recv.append((peer, off, n))
            off += n
        return cls(tuple(send), tuple(recv), (local[0], local[1], local[2]), num_send, off)

    @classmethod
    def from_parts(cls, send: Sequence[tuple[int, int]], recv: Sequence[tuple[int, int]], rank: int) -> Peers:
        """From ``(peer, count)`` pairs in buffer order: a peer's parts are consecutive (they
        become one message), this rank's own part is the kept one; O(peers)."""
        sides = []
        for parts in (send, recv):
            rows: list[tuple[int, int, int]] = []
            own_at, own, off = 0, 0, 0
            for peer, n in parts:
                n = int(n)
                if n and peer == rank:
                    if own and own_at + own != off:
                        raise ValueError(f"rank {rank}'s own parts are not consecutive")
                    own_at, own = (off if not own else own_at), own + n
                elif n:
                    if rows and rows[-1][0] == peer and rows[-1][1] + rows[-1][2] == off:
                        rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] + n)
                    elif any(p == peer for p, _, _ in rows):
                        raise ValueError(f"peer {peer}'s parts are not consecutive")
                    else:
                        rows.append((int(peer), off, n))
                off += n
            sides.append((tuple(rows), own_at, own, off))
        (s, s_at, s_own, ns), (r, r_at, r_own, nr) = sides
        if s_own != r_own:
            raise ValueError(f"rank {rank} keeps {s_own} rows but receives {r_own} from itself")
        return cls(s, r, (s_at, r_at, s_own), ns, nr)

    def reversed(self) -> Peers:
        """The opposite exchange (what a backward pass sends back)."""
        s, r, n = self.local
        return Peers(self.recv, self.send, (r, s, n), self.num_recv, self.num_send, self.holes)

    def without(self, skip: frozenset[int]) -> Peers:
        """This exchange with the peers in ``skip`` left out (both ways; their rows of the
        output are zeros): what a rank and a peer whose calls differ do, each on its side."""
        if not skip or not (self.peers & skip):
            return self
        return Peers(
            tuple(x for x in self.send if x[0] not in skip),
            tuple(x for x in self.recv if x[0] not in skip),
            self.local,
            self.num_send,
            self.num_recv,
            True,
        )

    @property
    def peers(self) -> frozenset[int]:
        """Every other rank this exchange moves data with."""
        return frozenset(p for p, _, _ in self.send) | frozenset(p for p, _, _ in self.recv)

    @property
    def moves(self) -> bool:
        """Some row leaves or reaches this rank (else the exchange is a local copy)."""
        return bool(self.send or self.recv)


_RANKS: dict[int, tuple] = {}
"""id(group) -> (the group, global rank of each group rank)."""


def global_ranks(group) -> tuple[int, ...]:
    """The global rank of each rank of ``group`` (cached per group)."""
    key = id(group)
    hit = _RANKS.get(key)
    if hit is None or hit[0] is not group:
        if group is None or group is dist.group.WORLD:
            ranks = tuple(range(dist.get_world_size()))
        else:
            ranks = tuple(dist.get_process_group_ranks(group))
        hit = _RANKS[key] = (group, ranks)
    return hit[1]


class Pending:
    """An exchange in flight: :meth:`wait` blocks until it is done (on NCCL: makes the current
    stream wait, without blocking the host)."""

    __slots__ = ("_works", "_phase", "_group", "_keep")

    def __init__(self, works, phase: str, group, keep) -> None:
        self._works, self._phase, self._group, self._keep = works, phase, group, keep

    def wait(self) -> None:
        works, self._works = self._works, ()
        for w in works:
            lifetime.wait(w, self._phase, self._group)
        self._keep = None


_DONE = Pending((), "", None, None)


def _post(x: torch.Tensor, out: torch.Tensor, peers: Peers, group, phase: str, tag: int) -> Pending:
    s, r, n = peers.local
    if n:
        out.narrow(0, r, n).copy_(x.narrow(0, s, n))
    if not peers.moves:
        return _DONE
    if x.device.type != "cpu" and _staged(group, x.device.type):
        return _post_staged(x, out, peers, group, phase, tag)
    ranks = global_ranks(group)
    ops = [dist.P2POp(dist.irecv, out.narrow(0, o, c), ranks[p], group, tag) for p, o, c in peers.recv]
    ops += [dist.P2POp(dist.isend, x.narrow(0, o, c), ranks[p], group, tag) for p, o, c in peers.send]
    works = lifetime.collective(lambda: dist.batch_isend_irecv(ops), (x, out), phase, group)
    return Pending(works or (), phase, group, (x, out))


_STAGED: dict = {}


def _staged(group, device_type: str) -> bool:
    """``group`` moves ``device_type`` tensors with gloo, whose point-to-point reads host
    memory only (its collectives stage device tensors themselves; send/recv do not)."""
    key = (id(group), device_type)
    if key not in _STAGED:
        from knapformer.distributed.backends import device_backends

        _STAGED[key] = device_backends(group).get(device_type, "gloo") == "gloo"
    return _STAGED[key]


class _Staged(Pending):
    """A device exchange through host copies (gloo): the received rows go to the device at
    :meth:`wait`."""

    __slots__ = ("_host", "_out", "_holes")

    def __init__(self, works, phase, group, keep, host, out, holes) -> None:
        super().__init__(works, phase, group, keep)
        self._host, self._out, self._holes = host, out, holes

    def wait(self) -> None:
        super().wait()
        host, self._host = self._host, None
        if host is not None:
            for _, o, c in self._holes:
                self._out.narrow(0, o, c).copy_(host.narrow(0, o, c))


def _post_staged(x, out, peers: Peers, group, phase: str, tag: int) -> Pending:
    """What gloo's own collectives do with device tensors, done here for its send/recv: copy
    to the host and back (blocking copies: a gloo job on a GPU, e.g. several ranks sharing
    one, pays them in every exchange, as it did in gloo's all-to-all)."""
    host_x = torch.empty(x.shape, dtype=x.dtype).copy_(x)
    host_out = torch.empty((out.shape[0], *out.shape[1:]), dtype=out.dtype)
    ranks = global_ranks(group)
    ops = [dist.P2POp(dist.irecv, host_out.narrow(0, o, c), ranks[p], group, tag) for p, o, c in peers.recv]
    ops += [dist.P2POp(dist.isend, host_x.narrow(0, o, c), ranks[p], group, tag) for p, o, c in peers.send]
    works = lifetime.collective(lambda: dist.batch_isend_irecv(ops), (host_x, host_out), phase, group)
    return _Staged(works or (), phase, group, (host_x, host_out), host_out, out, peers.recv)


def _checked(x: torch.Tensor, peers: Peers, phase: str) -> torch.Tensor:
    if x.shape[0] != peers.num_send:  # our own invariant: callers size buffers from the same Peers
        raise AssertionError(f"{phase}: {x.shape[0]} rows to send, the exchange sends {peers.num_send}")
    return x.contiguous()


def exchange(x: torch.Tensor, peers: Peers, group, phase: str, *, tag: int | None = None) -> torch.Tensor:
    """Rows of ``x`` (``peers.num_send``, *F) sent as ``peers`` says -> the received rows
    (``peers.num_recv``, *F); blocking, not differentiable (:class:`Exchange` is)."""
    x = _checked(x, peers, phase)
    out = (x.new_zeros if peers.holes else x.new_empty)((peers.num_recv, *x.shape[1:]))
    _post(x, out, peers, group, phase, _tag(phase) if tag is None else tag).wait()
    return out


def exchange_async(
    x: torch.Tensor, peers: Peers, group, phase: str, *, tag: int | None = None
) -> tuple[torch.Tensor, Pending]:
    """:func:`exchange` without waiting: the output buffer and the exchange in flight (read
    the buffer after ``Pending.wait()``)."""
    x = _checked(x, peers, phase)
    out = (x.new_zeros if peers.holes else x.new_empty)((peers.num_recv, *x.shape[1:]))
    return out, _post(x, out, peers, group, phase, _tag(phase) if tag is None else tag)


def _tag(phase: str) -> int:
    name, _, rest = phase.partition(" ")
    base = TAGS.get(phase, TAGS.get(name, 0))
    return base + (_BACKWARD_TAG if "backward" in rest else 0)


class Exchange(torch.autograd.Function):
    """:func:`exchange` along dim 0, differentiable: the backward sends the gradients back the
    opposite way (``peers.reversed()``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, peers: Peers, group, name: str, part: int = 0) -> torch.Tensor:  # type: ignore[override]
        tag = _tag(name) + _PART_TAG * part
        ctx.peers, ctx.group, ctx.name, ctx.tag = peers, group, name, tag
        import knapformer.distributed.trace as trace

        with trace.span(f"{trace.EXCHANGE}.{name}"):
            return exchange(x, peers, group, name, tag=tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import knapformer.distributed.trace as trace

        with trace.span(f"{trace.EXCHANGE}.{ctx.name}.backward"):
            back = exchange(grad, ctx.peers.reversed(), ctx.group, f"{ctx.name} backward", tag=ctx.tag + _BACKWARD_TAG)
            return back, None, None, None, None


def handshake(peers: Sequence[int], header: Sequence[int], rank: int, group, phase: str) -> dict[int, tuple]:
    """Send ``header`` (a few ints) to each of ``peers`` and receive theirs: {peer: header}.
    One small exchange with exactly those peers, on host tensors (``group``: a CPU group, so
    no device synchronisation)."""
    others = sorted({int(p) for p in peers} - {rank})
    if not others:
        return {}
    width = len(header)
    parts = [(p, width) for p in others]
    row = torch.tensor(list(header), dtype=torch.int64)
    got = exchange(row.repeat(len(others)), Peers.from_parts(parts, parts, rank), group, phase, tag=TAGS["header"])
    table = got.view(len(others), width).numpy()  # host memory: never a device synchronisation
    return {p: tuple(int(v) for v in h) for p, h in zip(others, table)}


def warm_up(group, device: torch.device) -> None:
    """Create ``group``'s communicator for ``device`` with an exchange every member joins (a
    ring: each member sends one value to the next), so that later exchanges among subsets of
    its members reuse it (NCCL's rule for ``batch_isend_irecv``). Collective over ``group``."""
    size = dist.get_world_size(group)
    if size < 2:
        return
    me = dist.get_rank(group)
    ranks = global_ranks(group)
    x = torch.zeros(1, device=device)
    y = torch.empty(1, device=device)
    ops = [
        dist.P2POp(dist.isend, x, ranks[(me + 1) % size], group, TAGS["probe"]),
        dist.P2POp(dist.irecv, y, ranks[(me - 1) % size], group, TAGS["probe"]),
    ]
    works = lifetime.collective(lambda: dist.batch_isend_irecv(ops), (x, y), "construction", group)
    for w in works or ():
        lifetime.wait(w, "construction", group)
