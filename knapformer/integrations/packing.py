"""The family seam's packing: a rank's samples as packed token streams, before and after routing.

Every packed family lays each sample out as consecutive *segments* (Flux: its text, then its
image; HunyuanVideo 1.5: its video, then its image, glyph and MLLM context), embeds each
segment's rows of all samples at once, and groups the segments into named *streams* that its
blocks treat alike (Flux's ``txt`` and ``img``). :class:`Packing` merges the embedded segments
into the per-sample order the executor routes, then routes them with their side features
(positions, ids, per-token timesteps) and gathers the per-sample conditioning to the group in
one call; :class:`Routed` is what the rank holds after routing: each stream's rows, the
*joint* order (stream after stream, as the stock attention processors concatenate them) and
its inverse, attention within each sample in joint order, and the way home for the outputs.

The orders are the ones every family used before the seam (stable, by index), so packed math
is unchanged bit for bit.

Legend: T local tokens, R routed tokens, S samples (the group's, after gathering), K segments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from knapformer.attention.bounds import host_values, index_to
from knapformer.errors import BalancerInputError
from knapformer.executor import LocalExecutor, TokenExecutor, local_positions, present_sequences

__all__ = ["Packing", "Routed", "timing_tokens"]


def _inverse(order: np.ndarray) -> np.ndarray:
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    return inv


class Packing:
    """This rank's samples as segments (``counts[i][k]``: tokens of sample i's segment k, in
    that order within the sample) grouped into ``streams`` (name -> its segments; every segment
    in one stream; the streams' order is the joint order). Every index table is built on the
    host (the counts are host numbers) and uploaded once: no device synchronisation."""

    def __init__(self, counts: Sequence[Sequence[int]], streams: Mapping[str, Sequence[int]], device) -> None:
        self.streams = {name: tuple(int(k) for k in segs) for name, segs in streams.items()}
        K = sum(len(s) for s in self.streams.values())
        assert sorted(k for s in self.streams.values() for k in s) == list(range(K)), self.streams
        self.num_segments = K
        self.device = device
        self.counts_host = np.asarray([[int(n) for n in c] for c in counts], dtype=np.int64).reshape(-1, K)
        self.counts = torch.from_numpy(self.counts_host)  # (S, K) on the host
        self.seq_lens = self.counts_host.sum(1).tolist()
        seg = np.tile(np.arange(K), self.counts_host.shape[0])
        self._seg = np.repeat(seg, self.counts_host.reshape(-1))  # (T,) each token's segment
        order = np.argsort(self._seg, kind="stable")  # local rows, segment by segment
        self._inv = index_to(_inverse(order), device)
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def num_samples(self) -> int:
        return int(self.counts.shape[0])

    def merge(self, *parts: torch.Tensor) -> torch.Tensor:
        """(T, ...) local tokens in sample order from ``parts[k]``: segment k's rows of every
        sample, in sample order."""
        assert len(parts) == self.num_segments, (len(parts), self.num_segments)
        return torch.cat(parts).index_select(0, self._inv)

    def rows(self, *segments: int) -> torch.Tensor:
        """Local rows (sample order) of the tokens in ``segments`` (built once per segments)."""
        if segments not in self._rows:
            self._rows[segments] = index_to(np.flatnonzero(np.isin(self._seg, segments)), self.device)
        return self._rows[segments]

    def split(self, rows: torch.Tensor, *segments: int) -> list[torch.Tensor]:
        """``rows`` (the tokens of ``segments``, sample order, as :meth:`rows` selects them)
        split per sample."""
        sizes = self.counts_host[:, list(segments)].sum(1).tolist()
        return list(torch.split(rows, sizes)) if sizes else []

    def executor(self, executor: TokenExecutor | None) -> TokenExecutor:
        """The planned executor, or a :class:`LocalExecutor` of these samples (no balancing)."""
        return executor if executor is not None else LocalExecutor(self.seq_lens)

    def route(
        self,
        executor: TokenExecutor | None,
        h: torch.Tensor,
        *side: torch.Tensor,
        per_sample: Sequence[torch.Tensor] = (),
        names: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> Routed:
        """Route the local tokens ``h`` (T, ...) and their side features (T, ...) to their
        planned ranks, and gather ``per_sample`` rows (S, ...) of every rank of the group
        (``names``: what each is, for error messages) together with the samples' segment
        counts. ``min_tokens``: for a family whose blocks cannot run on fewer routed tokens (a
        stock block that reshapes per batch row with ``-1`` fails on zero rows): a plan that
        leaves a rank fewer raises :class:`~knapformer.errors.BalancerInputError` here, on
        every rank alike (each reads the step's plan), before any exchange — instead of one
        rank crashing inside a block while its peers wait for it."""
        ex = self.executor(executor)
        if min_tokens > 0:
            _require_tokens(ex, self.seq_lens, int(min_tokens))
        routed = ex.route(h, *side, seq_lens=self.seq_lens)
        routed = routed if isinstance(routed, tuple) else (routed,)
        gathered = ex.gather_sequences(*per_sample, names=tuple(names)) if per_sample else ()
        # the samples' segment counts on the host (a host exchange: the tables below are
        # built from them without reading a device tensor back)
        (counts_all,) = ex.gather_sequences(self.counts, names=("segment counts",))
        return Routed(ex, routed[0], tuple(routed[1:]), tuple(gathered), counts_all, self.streams, self)


def _require_tokens(ex, seq_lens: Sequence[int], least: int) -> None:
    """Raise if the step's plan leaves a rank fewer than ``least`` routed tokens (the same
    verdict on every rank: the plan is the group's)."""
    try:
        plan = ex.current_plan  # a balancer's step plan, the group's
    except AttributeError:  # a one-process executor: only this process's tokens
        plan = None
    held = plan.tokens_per_rank().tolist() if plan is not None else [sum(seq_lens)]
    short = [r for r, n in enumerate(held) if n < least]
    if short:
        raise BalancerInputError(
            f"rank(s) {short} of the balancing group would hold fewer than {least} routed token(s) under this "
            f"step's plan, and this family's blocks cannot run on fewer (min_tokens={least}); every rank raises "
            "this before any exchange. Give every rank samples, or plan a layout that spreads the tokens over "
            "every rank (e.g. one group of all of them)"
        )


class Routed:
    """The tokens this rank holds after routing (see the module docstring). ``h``: (R, ...)
    routed tokens; ``side``: the routed side features; ``per_sample``: the gathered rows
    (indexable by group sample id)."""

    def __init__(self, executor, h, side, per_sample, counts_all, streams, packing) -> None:
        self.executor: TokenExecutor = executor
        self.h, self.side, self.per_sample = h, side, per_sample
        self.packing: Packing = packing
        device = h.device
        self.seq_id, self.pos = executor.routed_positions(h)
        # every table from host numbers (the plan's routed ids, the gathered counts), uploaded once
        seq_host, pos_host = (host_values(t) for t in executor.routed_positions(None))
        counts = host_values(counts_all)  # (S, K) every sample's segment counts
        self.counts_all = index_to(counts, device).reshape(counts.shape)
        self._streams = streams
        ends = counts.cumsum(1)  # (S, K) the end of each segment within its sample
        seg = (pos_host[:, None] >= ends[seq_host]).sum(1) if seq_host.size else pos_host
        self.segment = index_to(seg, device)  # (R,) each routed token's segment
        rows = {name: np.flatnonzero(np.isin(seg, segs)) for name, segs in streams.items()}
        self.rows: dict[str, torch.Tensor] = {name: index_to(r, device) for name, r in rows.items()}
        joint = np.concatenate(list(rows.values())) if rows else np.zeros(0, dtype=np.int64)
        self.joint = index_to(joint, device)  # joint row j is routed row joint[j]
        self.inv = index_to(_inverse(joint), device)  # routed row i is joint row inv[i]
        self.present, self.slot = present_sequences(executor, h)  # host-built: no device sync
        self._sizes = {name: int(r.size) for name, r in rows.items()}

    def count(self, stream: str) -> int:
        """Routed tokens of ``stream`` on this rank."""
        return self._sizes[stream]

    def take(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """The rows of routed-order ``x`` that belong to ``stream``."""
        return x.index_select(0, self.rows[stream])

    def sample_of(self, stream: str) -> torch.Tensor:
        """Group sample id of each of ``stream``'s tokens (rows of ``per_sample``)."""
        return self.seq_id.index_select(0, self.rows[stream])

    def offset(self, stream: str) -> torch.Tensor:
        """Each of ``stream``'s tokens' position within the stream's part of its sample (0 at
        the sample's first token of the stream's first segment)."""
        rows = self.rows[stream]
        k = self._streams[stream][0]
        start = self.counts_all[:, :k].sum(1)  # (S,) where the stream starts in each sample
        return self.pos.index_select(0, rows) - start.index_select(0, self.seq_id.index_select(0, rows))

    def slot_of(self, stream: str) -> torch.Tensor:
        """Each of ``stream``'s tokens' row among the samples present here (``present``)."""
        return self.slot.index_select(0, self.rows[stream])

    def present_rows(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The rows of gathered ``per_sample`` of the samples with tokens here (``present``)."""
        return per_sample.index_select(0, self.present)

    def merge(self, *parts: torch.Tensor) -> torch.Tensor:
        """Routed-order tokens from one part per stream (its tokens in routed order), in the
        streams' order."""
        return torch.cat(parts).index_select(0, self.inv)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (R, H, Dh) in joint order -> attention within each sample -> (R, 1, H·Dh),
        joint order."""
        q, k, v = (t.index_select(0, self.inv) for t in (q, k, v))
        o = self.executor.attention(q, k, v).index_select(0, self.joint)
        return o.flatten(1, 2).unsqueeze(1).to(q.dtype)

    def home(self, out: torch.Tensor, *segments: int) -> torch.Tensor:
        """Routed-order outputs ``out`` (R, C) back to this rank's samples, then the rows of
        ``segments`` (sample order; :meth:`Packing.split` cuts them per sample)."""
        local = self.executor.reverse_route(out)
        return local.index_select(0, self.packing.rows(*segments))


def timing_tokens(seq_lens: Sequence[int], streams: Mapping[str, Sequence[int]], device) -> Routed:
    """The tokens the calibrator times one block on: each sequence's first ``n // 8`` tokens in
    segment 0 (its text or context), the rest in segment 1, held by a ``LocalExecutor``;
    ``side[0]``: each token's (0, row, column) grid position (p // 64, p % 64), int64."""
    pk = Packing([(n // 8, n - n // 8) for n in seq_lens], streams, device)
    _, pos = local_positions(pk.seq_lens, device)
    grid = torch.stack([torch.zeros_like(pos), pos // 64, pos % 64], dim=1)
    return pk.route(None, torch.zeros(len(pos), 0, device=device), grid)
