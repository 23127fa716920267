"""A distributed batch sampler that fills each rank's batch up to a token budget.

Mixed-resolution image and video data has samples of 256 to 100k+ tokens, so a fixed number of
samples per rank gives ranks wildly different work before the balancer runs (and a batch size
small enough for the largest samples wastes memory on the small ones). This sampler packs each
rank's batch up to ``max_tokens`` instead, optionally only from one *bucket* per batch
(resolution, aspect ratio, frame count: the grouping image/video trainers use), and hands out
the batches so that

- each sample appears exactly once per epoch over all ranks (``drop_last=False``), or at most
  once (``drop_last=True``: the trailing batches that do not fill a whole step are dropped);
- every rank runs the same number of steps (no rank waits in a collective for one that ran
  out): with ``drop_last=False`` a step that lacks batches for some ranks first splits other
  batches of that step's epoch, and only when no batch can be split gives a rank an empty batch
  (``[]``; the balancer gives such a rank work from the others);
- the batches are a pure function of ``(seed, epoch)`` and the lengths, identical in every
  process (numpy's PCG64 seeded with ``[seed, epoch]``), so ranks need not talk to agree;
- resuming mid-epoch yields exactly the remaining batches (:meth:`state_dict` /
  :meth:`load_state_dict`), and on another number of ranks the remaining *samples*, dealt
  over the new ranks under the same rules (a restart after a resize loses and repeats none).

What each budget bounds: ``max_tokens`` bounds the tokens a rank *loads* per step (its
activations before balancing, the data-loader memory); the balancer's ``max_tokens_per_rank``
bounds the tokens a rank *computes on* after routing (activation memory of the balanced
step). Choose ``max_tokens ≤ max_tokens_per_rank`` and every plan is feasible without moving
tokens for memory alone; a larger sampler budget relies on the balancer to spread the excess.

A sample longer than ``max_tokens`` cannot share a batch with anything: ``oversize="error"``
(the default) raises naming it, ``oversize="alone"`` gives it a batch of its own (that batch
exceeds the budget — the balancer's ``max_tokens_per_rank`` then splits it over ranks).

**Datasets of millions of samples** (more than ``window`` samples, 2^20 by default) are dealt
*window by window*, so that a step costs the same whatever the dataset's size (100M samples:
the first batch in about a second, well under 1 GB of memory, `benchmarks/sampler_scale.py`):

- the epoch's order: the blocks of ``block`` consecutive samples (1,024) in a random order from
  ``(seed, epoch)``, cut into windows of ``window`` samples; inside a window the samples in a
  random order, packed per bucket, the batches in a random order — each window a pure function
  of ``(seed, epoch, window)`` and the lengths;
- every ``num_replicas`` batches make a step; what a window leaves over (fewer batches than
  ranks) is carried into the next; the last window's queue is dealt like a whole epoch
  (batches split to fill its last step, or dropped with ``drop_last``);
- the lengths (and integer bucket ids) may be a memory-mapped file: they are read a window at a
  time and never copied whole (:mod:`knapformer.data.shards` writes such files from Parquet
  shards);
- what is traded: the order is a shuffle of blocks, then of samples within a window — two
  samples of one block always land in the same window (within about ``window`` samples of each
  other in the epoch), so a dataset stored in a meaningful order keeps that order's
  correlations at the scale of a block (1,024 samples) inside each window; across windows, and
  between blocks, the order is random. Batches stay as full as in a whole-epoch deal (a
  window's leftovers move on to the next), except one partial batch per bucket per window;
- the state (:meth:`state_dict`) then also holds the batches carried into the window the step
  is in (fewer than the ranks), or — in the window an epoch resumed on another number of ranks
  continues in — the state it resumed from (recomputing that window's remaining batches costs
  one window's work); ``len()`` and :meth:`steps` pack the whole epoch (O(samples), cached).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from knapformer.plan.seqindex import concat_ranges

__all__ = ["DEFAULT_BLOCK", "DEFAULT_WINDOW", "TokenBudgetBatchSampler", "pack_batches"]

DEFAULT_WINDOW = 1 << 20
"""Samples up to which an epoch is dealt in one piece (and beyond which, window by window)."""
DEFAULT_BLOCK = 1024
"""Consecutive samples that move together in the windowed shuffle (one read of the lengths and of
sharded data per block)."""

Lengths = Sequence[int] | np.ndarray | Callable[[int], int]


_CHUNK = 1 << 22
"""Rows checked at a time when validating a large integer array (bounded temporary memory)."""


def _as_lengths(lengths: Lengths, num_samples: int | None) -> np.ndarray:
    """The lengths as an integer array. An integer numpy array (a memory-mapped file too) is
    kept as it is — validated in chunks, never copied — so that the processes of a node share
    its pages; anything else becomes an int64 array."""
    if callable(lengths):
        if num_samples is None:
            raise ValueError("lengths is a callable: pass num_samples (the dataset's length) too")
        lengths = [lengths(i) for i in range(int(num_samples))]
    keep = isinstance(lengths, np.ndarray) and lengths.dtype.kind in "iu"
    arr = lengths if keep else np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one token count per sample, got an array of shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(arr == np.floor(arr)):
            raise ValueError(f"lengths must be whole token counts, got dtype {arr.dtype}")
    if not keep:
        arr = arr.astype(np.int64)
    if num_samples is not None and arr.size != num_samples:
        raise ValueError(f"lengths has {arr.size} entries but num_samples is {num_samples}")
    for lo in range(0, arr.size, _CHUNK):
        chunk = arr[lo : lo + _CHUNK]
        if chunk.size and int(chunk.min()) < 1:
            i = lo + int(np.flatnonzero(chunk < 1)[0])
            raise ValueError(f"sample {i} has {int(arr[i])} tokens: every sample needs at least one token")
    return arr


def _as_buckets(
    buckets: Sequence[Hashable] | Callable[[int], Hashable] | None, n: int, window: int
) -> np.ndarray | None:
    """Bucket ids per sample: 0..B-1 in order of first appearance of each key; for a dataset
    larger than one window (:class:`TokenBudgetBatchSampler`), an integer numpy array (a
    memory-mapped file too) is taken as the ids themselves, not copied, and no buckets are
    None (one bucket)."""
    if buckets is None:
        return None if n > window else np.zeros(n, dtype=np.int64)
    if isinstance(buckets, np.ndarray) and buckets.dtype.kind in "iu" and n > window:
        if buckets.shape != (n,):
            raise ValueError(f"buckets has shape {buckets.shape} for {n} samples")
        return buckets
    keys = [buckets(i) for i in range(n)] if callable(buckets) else list(buckets)
    if len(keys) != n:
        raise ValueError(f"buckets has {len(keys)} keys for {n} samples")
    ids: dict[Hashable, int] = {}
    return np.array([ids.setdefault(key, len(ids)) for key in keys], dtype=np.int64)


def pack_batches(
    order: Sequence[int] | np.ndarray,
    lengths: np.ndarray,
    max_tokens: int,
    *,
    max_samples: int | None = None,
    oversize: str = "error",
) -> list[list[int]]:
    """Cut ``order`` (sample indices) into consecutive batches of at most ``max_tokens`` tokens
    and ``max_samples`` samples: a batch closes when the next sample would not fit. Returns the
    batches as lists of indices."""
    if oversize not in ("error", "alone"):
        raise ValueError(f"oversize must be 'error' or 'alone', got {oversize!r}")
    batches: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    idx = np.asarray(order, dtype=np.int64).reshape(-1)
    # one vectorised read (a memory-mapped array indexed per element costs a Python call each)
    for i, n in zip(idx.tolist(), np.asarray(lengths)[idx].tolist()):
        if n > max_tokens:
            if oversize == "error":
                raise ValueError(
                    f"sample {i} has {n} tokens, more than max_tokens={max_tokens}: raise the budget, "
                    "filter the sample out, or pass oversize='alone' to give it a batch of its own"
                )
            batches.append([i])
            continue
        if cur and (tokens + n > max_tokens or (max_samples is not None and len(cur) >= max_samples)):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        batches.append(cur)
    return batches


class TokenBudgetBatchSampler:
    """Per-rank batches of sample indices under a token budget, for
    ``DataLoader(dataset, batch_sampler=...)``.

    ``lengths``: each sample's token count (a list, an array, or a callable ``i -> int`` with
    ``num_samples``); the same on every rank. ``max_tokens``: tokens per rank per step (see the
    module docstring for how it relates to the balancer's ``max_tokens_per_rank``);
    ``max_samples``: optional cap on samples per batch. ``buckets``: a key per sample (or a
    callable ``i -> key``): a batch holds samples of one key only. ``num_replicas``/``rank``
    default to the default process group's (1 and 0 without one). ``shuffle``: draw samples and
    batches in a random order from ``(seed, epoch)``; call :meth:`set_epoch` each epoch as with
    ``DistributedSampler``. ``window``/``block``: samples per window and per block of the
    windowed deal of a dataset larger than one window (module docstring; the defaults suit
    anything from a million to billions of samples).
    """

    def __init__(
        self,
        lengths: Lengths,
        max_tokens: int,
        *,
        num_samples: int | None = None,
        max_samples: int | None = None,
        buckets: Sequence[Hashable] | Callable[[int], Hashable] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        oversize: str = "error",
        window: int | None = None,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if max_samples is not None and (not isinstance(max_samples, (int, np.integer)) or max_samples < 1):
            raise ValueError(f"max_samples must be a positive int or None, got {max_samples!r}")
        if oversize not in ("error", "alone"):
            raise ValueError(f"oversize must be 'error' or 'alone', got {oversize!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if num_replicas is None or rank is None:
            world, me = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank!r}")
        window = DEFAULT_WINDOW if window is None else window
        for name, v in (("window", window), ("block", block)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.window, self.block = int(window), int(block)
        self.lengths = _as_lengths(lengths, num_samples)
        self.bucket_ids = _as_buckets(buckets, self.lengths.size, self.window)
        self.windowed = self.lengths.size > self.window
        """More samples than one window: the epoch is dealt window by window (module docstring)."""
        self.max_tokens, self.max_samples = int(max_tokens), None if max_samples is None else int(max_samples)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last, self.oversize = bool(shuffle), int(seed), bool(drop_last), oversize
        self.epoch = 0
        self._start = 0  # batches of this epoch already consumed (resume)
        self._resumed_epoch: int | None = None
        self._yielded = 0  # steps of the current epoch handed out by the current pass
        self._pass_start = 0  # where the current (or last) pass of self.epoch began
        self._cache: tuple[tuple, list[list[list[int]]]] | None = None
        self._chain: tuple[tuple[int, int], ...] = ()  # (ranks, steps consumed) of earlier passes
        self._chain_epoch: int | None = None  # the epoch the chain belongs to
        self._marks: list[tuple[int, int, tuple]] = []  # windowed: (window, steps before it, carry) of this pass
        self._resume: tuple[int, int, tuple] | None = None  # windowed: where a loaded state continues
        self._counts: dict = {}  # windowed: steps per (epoch, ranks, start) (len)
        self._windowed_origin: tuple[int, tuple] | None = None  # windowed: where a resized epoch resumed
        self._origin_state: dict | None = None  # windowed: the state it resumed from
        self._digest = None  # the arrays' hash state (hashlib), computed once
        if self.oversize == "error":  # fail at construction, not in the middle of an epoch
            for lo in range(0, self.lengths.size, _CHUNK):
                over = np.flatnonzero(self.lengths[lo : lo + _CHUNK] > self.max_tokens)
                if over.size:
                    pack_batches(over[:1] + lo, self.lengths, self.max_tokens)

    # -- the epoch's batches ------------------------------------------------------------------------------
    def steps(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every step of ``epoch`` (default: the current one): ``steps[s][r]`` is rank r's batch
        of step s (a list of sample indices, possibly empty). For an epoch resumed on another
        number of ranks (:meth:`load_state_dict`): the steps of the samples it had not consumed."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self.windowed:  # the whole epoch in memory: O(samples) (iterate instead for a large dataset)
            return [step for kind, _, step in self._stream(epoch, self.num_replicas, *self._origin(epoch)) if kind]
        chain = self._chain if epoch == self._chain_epoch else ()
        key = (epoch, self.max_tokens, self.max_samples, self.num_replicas, self.shuffle, self.drop_last, self.oversize)
        key += (chain,)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        remaining = None
        for world, done in chain:  # earlier passes of this epoch on other numbers of ranks
            earlier = self._build(epoch, world, remaining)
            remaining = np.ones(self.lengths.size, dtype=bool) if remaining is None else remaining.copy()
            used = [i for step in earlier[:done] for batch in step for i in batch]
            remaining[np.asarray(used, dtype=np.int64)] = False
        steps = self._build(epoch, self.num_replicas, remaining)
        self._cache = (key, steps)
        return steps

    def _build(self, epoch: int, world: int, remaining: np.ndarray | None) -> list[list[list[int]]]:
        """The steps of ``epoch`` on ``world`` ranks over the samples ``remaining`` marks (None:
        all): drawn, packed per bucket, interleaved and dealt from ``[seed, epoch]`` alone."""
        rng = np.random.default_rng([self.seed, epoch])
        n = self.lengths.size
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if remaining is not None:  # the draw order of what is left
            order = order[remaining[order]]
        batches: list[list[int]] = []
        # one bucket at a time (bucket ids in order of first appearance), each in draw order
        by_bucket = order[np.argsort(self.bucket_ids[order], kind="stable")]
        cuts = np.flatnonzero(np.diff(self.bucket_ids[by_bucket])) + 1
        for mine in np.split(by_bucket, cuts) if order.size else []:
            batches += pack_batches(
                mine, self.lengths, self.max_tokens, max_samples=self.max_samples, oversize=self.oversize
            )
        if self.shuffle and batches:  # interleave the buckets
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return self._deal(batches, world)

    def _deal(self, batches: list[list[int]], w: int) -> list[list[list[int]]]:
        """Batches -> steps of ``w`` batches each (see the module docstring)."""
        full, rest = divmod(len(batches), w)
        if self.drop_last or rest == 0:
            return [batches[s * w : (s + 1) * w] for s in range(full)]
        missing = w - rest
        # fill the last step by halving the largest batches (the step's own or earlier ones; a
        # half can be halved again): both halves stay under the budget, the step count stays
        out = [list(b) for b in batches]
        heap = [(-len(b), i) for i, b in enumerate(out) if len(b) >= 2]
        heapq.heapify(heap)
        extra: list[int] = []  # slots of the halves moved to the last step
        while len(extra) < missing and heap:
            _, i = heapq.heappop(heap)
            half = len(out[i]) // 2
            out.append(out[i][half:])
            out[i] = out[i][:half]
            extra.append(len(out) - 1)
            for j in (i, len(out) - 1):
                if len(out[j]) >= 2:
                    heapq.heappush(heap, (-len(out[j]), j))
        last = out[full * w : len(batches)] + [out[j] for j in extra]
        last += [[] for _ in range(w - len(last))]
        return [out[s * w : (s + 1) * w] for s in range(full)] + [last]

    # -- the Sampler protocol -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        for step in self.iter_steps():
            yield step[self.rank]

    def iter_steps(self) -> Iterator[list[list[int]]]:
        """The current pass's steps, every rank's batch of each (``step[r]``: rank r's), from
        where the pass starts (a resume included), window by window for a large dataset: what
        :meth:`__iter__` yields this rank's part of. Every process can so know every rank's
        lengths for a step without a gather (plans made ahead: :class:`knapformer.data.PlannedSteps`)."""
        start = self._start if self._resumed_epoch == self.epoch else 0
        resume = self._resume if self._resumed_epoch == self.epoch else None
        self._start, self._resumed_epoch, self._resume = 0, None, None  # a resume applies to one pass only
        self._yielded = self._pass_start = start
        if not self.windowed:
            for step in self.steps()[start:]:
                self._yielded += 1
                yield step
            return
        # window by window: (window, steps before it, the batches carried into it), then skip to `start`
        if resume is None:
            first, carried = self._origin(self.epoch)
            resume = (first, 0, carried)
        k, before, carry = resume
        self._marks = []
        steps = before
        for kind, w, step in self._stream(self.epoch, self.num_replicas, k, carry):
            if not kind:  # a window starts: where a state saved from here on resumes
                self._marks = [*self._marks[-7:], (w, steps, step)]
                continue
            if steps >= start:
                self._yielded += 1
                yield step
            steps += 1

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank); a resumed pass yields fewer.
        For a dataset of more than one window this packs the whole epoch once (cached): O(samples)."""
        total = self._num_steps() if self.windowed else len(self.steps())
        if self._resumed_epoch == self.epoch:  # a resume not yet started
            return total - self._start
        return total - self._pass_start

    # -- the windowed deal (more samples than one window) -------------------------------------------------
    def _origin(self, epoch: int) -> tuple[int, tuple]:
        """(first window, batches carried into it) of ``epoch``'s steps on this many ranks: the
        epoch's start, or for an epoch resumed on another number of ranks where it resumed."""
        if self._chain_epoch == epoch and self._windowed_origin is not None:
            return self._windowed_origin
        return 0, ()

    def _window_blocks(self, epoch: int) -> list[np.ndarray]:
        """The blocks of each window of ``epoch``: a permutation of the blocks of ``block``
        consecutive samples (from ``[seed, epoch]``), cut into runs of ``window`` samples."""
        n, k = self.lengths.size, self.block
        num = -(-n // k)
        order = np.random.default_rng([self.seed, epoch]).permutation(num) if self.shuffle else np.arange(num)
        per = max(1, -(-self.window // k))
        return [order[i : i + per] for i in range(0, num, per)]

    def _window_batches(self, epoch: int, w: int, blocks: np.ndarray) -> list[list[int]]:
        """Window ``w``'s batches: its samples in a random order (from ``[seed, epoch, 1, w]``),
        packed per bucket under the budget, the batches in a random order (``[seed, epoch, 2, w]``)."""
        n, k = self.lengths.size, self.block
        starts = blocks.astype(np.int64) * k
        idx = concat_ranges(starts, np.minimum(starts + k, n) - starts)
        if self.shuffle:
            idx = idx[np.random.default_rng([self.seed, epoch, 1, w]).permutation(idx.size)]
        srt = np.argsort(idx, kind="stable")  # read the lengths (and buckets) block by block
        lens = np.empty(idx.size, dtype=np.int64)
        lens[srt] = self.lengths[idx[srt]]
        cuts: np.ndarray | list = []
        if self.bucket_ids is not None:
            keys = np.empty(idx.size, dtype=np.int64)
            keys[srt] = self.bucket_ids[idx[srt]]
            by = np.argsort(keys, kind="stable")  # one bucket at a time, each in draw order
            idx, lens, keys = idx[by], lens[by], keys[by]
            cuts = np.flatnonzero(np.diff(keys)) + 1
        batches: list[list[int]] = []
        for part, part_lens in zip(np.split(idx, cuts), np.split(lens, cuts)):
            batches += _pack_run(part, part_lens, self.max_tokens, self.max_samples)
        if self.shuffle and batches:  # interleave the buckets
            batches = [batches[i] for i in np.random.default_rng([self.seed, epoch, 2, w]).permutation(len(batches))]
        return batches

    def _stream(self, epoch: int, world: int, first: int = 0, carry=()):
        """``epoch``'s steps on ``world`` ranks from window ``first`` on, ``carry`` (batches)
        dealt first: yields ``(False, w, carry)`` as window w starts (the batches carried into
        it) and ``(True, w, step)`` for each step. Each window's batches join the queue and
        every ``world`` of them make a step; what is left (< ``world``) is carried into the next
        window; the last window's queue is dealt as a whole epoch's (``_deal``: batches split to
        fill its last step, or the trailing ones dropped). O(one window) memory."""
        windows = self._window_blocks(epoch)
        queue = [list(b) for b in carry]
        for w in range(first, len(windows)):
            yield False, w, tuple(tuple(b) for b in queue)
            queue += self._window_batches(epoch, w, windows[w])
            if w == len(windows) - 1:
                for step in self._deal(queue, world):
                    yield True, w, step
                return
            full = len(queue) // world
            for s in range(full):
                yield True, w, queue[s * world : (s + 1) * world]
            queue = queue[full * world :]
        # resumed past the last window: what was carried is all that is left
        yield False, len(windows), tuple(tuple(b) for b in queue)
        for step in self._deal(queue, world):
            yield True, len(windows), step

    def _num_steps(self) -> int:
        """Steps of the current epoch from its origin (packs every window once; cached)."""
        first, carry = self._origin(self.epoch)
        key = (self.epoch, self.num_replicas, first, hash(carry))
        if key not in self._counts:
            self._counts = {key: sum(kind for kind, _, _ in self._stream(self.epoch, self.num_replicas, first, carry))}
        return self._counts[key]

    def _mark_at(self, steps_done: int) -> tuple[int, int, tuple]:
        """(window, steps before it, carry) of the window whose steps contain step
        ``steps_done`` of the current epoch (a remembered one, else by streaming up to it)."""
        if steps_done <= self._yielded:  # the pass got this far: its windows up to here are marked
            for mark in reversed(self._marks):
                if mark[1] <= steps_done:
                    return mark
        first, carry = self._origin(self.epoch)
        mark, steps = (first, 0, carry), 0
        for kind, w, x in self._stream(self.epoch, self.num_replicas, first, carry):
            if not kind:
                if steps > steps_done:
                    break
                mark = (w, steps, x)
                continue
            steps += 1
        if steps_done > steps:
            raise ValueError(f"steps_done must be in [0, {steps}] for epoch {self.epoch}, got {steps_done}")
        return mark

    @property
    def pass_start(self) -> int:
        """The step of :meth:`steps` the next (or current) pass begins at: 0, or where a resume
        left off — add the steps your loop consumed to it for :meth:`state_dict`'s
        ``steps_done``."""
        return self._start if self._resumed_epoch == self.epoch else self._pass_start

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s batches from the next pass on (as ``DistributedSampler.set_epoch``).
        A resumed position (:meth:`load_state_dict`) holds for its own epoch only."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if int(epoch) != self.epoch:
            self._pass_start = 0
            self._marks = []
        self.epoch = int(epoch)
        if self.epoch != self._resumed_epoch:
            self._yielded = 0

    # -- resuming -------------------------------------------------------------------------------------------
    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """What :meth:`load_state_dict` needs to continue this epoch after ``steps_done`` steps:
        a few numbers (the epoch, the steps consumed, the number of ranks, and for an epoch
        already resumed on another number of ranks the (ranks, steps) of its earlier passes),
        never the sample indices. Pass the steps your loop *consumed*: a ``DataLoader`` with
        workers draws batches ahead of the loop (``prefetch_factor × num_workers``), so the
        default — the batches this sampler has handed out in the current pass, counted from
        :attr:`pass_start` — is right only without workers (with them: ``pass_start`` + the
        batches consumed)."""
        if steps_done is None:
            steps_done = self._yielded
        if isinstance(steps_done, bool) or not isinstance(steps_done, (int, np.integer)):
            raise ValueError(f"steps_done must be an int, got {steps_done!r}")
        if self.windowed:  # where the window holding that step starts: its carried batches come along
            if steps_done < 0:
                raise ValueError(f"steps_done must be >= 0, got {steps_done}")
            w, before, carry = self._mark_at(int(steps_done))
            first, _ = self._origin(self.epoch)
            resized = self._origin_state is not None and self._chain_epoch == self.epoch and w == first
            return {
                "epoch": self.epoch,
                "steps_done": int(steps_done),
                "seed": self.seed,
                "num_replicas": self.num_replicas,
                "window": int(w),
                "window_step": int(before),
                # what the window starts with: fewer batches than ranks, or — in the window a
                # resized epoch resumed at — the state it resumed from, to recompute them
                "carry": None if resized else [list(b) for b in carry],
                "origin": self._origin_state if resized else None,
                "fingerprint": self._fingerprint(),
            }
        if not 0 <= steps_done <= len(self.steps()):
            raise ValueError(f"steps_done must be in [0, {len(self.steps())}] for epoch {self.epoch}, got {steps_done}")
        chain = self._chain if self._chain_epoch == self.epoch else ()
        return {
            "epoch": self.epoch,
            "steps_done": int(steps_done),
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "resumed_from": [list(c) for c in chain],
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next pass yields the rest of its epoch. Saved
        with the same number of ranks: exactly the remaining steps. Saved with another number
        (a job restarted after a resize): the samples that epoch had not consumed, packed under
        the same budget and buckets and dealt over this sampler's ranks (a pure function of the
        state, the same in every process), so that over the interrupted epoch every sample is
        seen exactly once (at most once with ``drop_last``); later epochs are whole as usual.
        Raises if the lengths, budget, buckets or seed changed (the batches would differ)."""
        if not isinstance(state, dict):
            raise ValueError(f"a sampler state is a dict, got {type(state).__name__}")
        world = state.get("num_replicas")
        if world is None:  # saved before resizes were possible: its fingerprint holds the world
            same = state.get("fingerprint") == self._fingerprint(self.num_replicas)
            world = self.num_replicas
        else:
            same = state.get("fingerprint") == self._fingerprint()
        if not same or state.get("seed") != self.seed:
            raise ValueError(
                "this state was saved by a sampler with other lengths, budget, buckets or seed"
                + ("" if state.get("num_replicas") is not None else " or number of ranks")
                + ": its remaining batches do not exist here"
            )
        if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
            raise ValueError(f"num_replicas in the state must be a positive int, got {world!r}")
        if self.windowed:
            self._load_windowed(state, int(world))
            return
        try:
            chain = tuple((int(w), int(d)) for w, d in state.get("resumed_from", []))
            epoch, steps_done = int(state["epoch"]), int(state["steps_done"])
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"malformed sampler state: {exc}") from None
        self.set_epoch(epoch)
        self._chain, self._chain_epoch = chain, epoch
        saved_steps = len(self._steps_on(int(world)))
        if not 0 <= steps_done <= saved_steps:
            raise ValueError(f"steps_done {steps_done} is outside epoch {epoch}'s {saved_steps} steps")
        if int(world) != self.num_replicas:  # resized: deal what is left over this many ranks
            self._chain = chain + ((int(world), steps_done),)
            steps_done = 0
        self._start, self._resumed_epoch = steps_done, self.epoch
        self._yielded = steps_done  # a checkpoint taken before iterating keeps the position

    def _load_windowed(self, state: dict[str, Any], world: int) -> None:
        """:meth:`load_state_dict` for a windowed epoch: continue from the saved window with the
        batches it carried; on another number of ranks, that window's batches not yet consumed
        are carried into the next window and dealt over this sampler's ranks from there (the
        state then keeps the one it resumed from: it recomputes them, one window's work)."""
        try:
            epoch, steps_done = int(state["epoch"]), int(state["steps_done"])
            w, before = int(state["window"]), int(state["window_step"])
            carry = self._carry_of(state)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"malformed sampler state (a sampler of more than one window): {exc}") from None
        if not 0 <= before <= steps_done or epoch < 0:
            raise ValueError("malformed sampler state: its steps are out of range")
        self.set_epoch(epoch)
        if world == self.num_replicas:
            if state.get("origin") is not None:  # resumed earlier, on other ranks: the same origin
                self._windowed_origin, self._origin_state = (w, carry), state["origin"]
                self._chain_epoch = epoch
            self._resume = (w, before, carry)
            self._start = steps_done
        else:  # resized: what that window had not handed out yet is carried on, over these ranks
            self._windowed_origin = self._remainder(epoch, world, w, before, steps_done, carry)
            self._origin_state = {k: v for k, v in state.items() if k != "fingerprint"}
            self._chain_epoch = epoch
            self._resume = (self._windowed_origin[0], 0, self._windowed_origin[1])
            self._start = 0
        self._resumed_epoch = self.epoch
        self._yielded = self._start

    def _carry_of(self, state: dict[str, Any]) -> tuple:
        """The batches a state's window starts with: saved, or recomputed from its origin."""
        if state.get("origin") is None:
            carry = tuple(tuple(int(i) for i in b) for b in state["carry"])
            n = self.lengths.size
            if any(not 0 <= i < n for b in carry for i in b):
                raise ValueError("its carried samples are out of range")
            return carry
        o = state["origin"]
        first, carry = self._remainder(
            int(o["epoch"]),
            int(o["num_replicas"]),
            int(o["window"]),
            int(o["window_step"]),
            int(o["steps_done"]),
            self._carry_of(o),
        )
        if first != int(state["window"]):
            raise ValueError("its window does not follow its origin's")
        return carry

    def _remainder(self, epoch: int, world: int, w: int, before: int, steps_done: int, carry: tuple) -> tuple:
        """(next window, batches left) of ``epoch`` dealt on ``world`` ranks after ``steps_done``
        steps, window ``w`` having started at step ``before`` with ``carry``."""
        done = steps_done - before
        queue = [list(b) for b in carry]
        windows = self._window_blocks(epoch)
        if w < len(windows):
            queue += self._window_batches(epoch, w, windows[w])
        if w >= len(windows) - 1:  # the last window's steps were dealt as a whole epoch's
            steps = self._deal(queue, world)
            if done > len(steps):
                raise ValueError(f"steps_done {steps_done} is past the epoch's end")
            left = [b for step in steps[done:] for b in step if b]
        else:
            if done * world > len(queue):
                raise ValueError(f"steps_done {steps_done} is outside window {w}'s steps")
            left = queue[done * world :]
        return w + 1, tuple(tuple(b) for b in left)

    def _steps_on(self, world: int) -> list[list[list[int]]]:
        """This epoch's steps (its chain applied) as a sampler of ``world`` ranks would deal them."""
        if world == self.num_replicas:
            return self.steps()
        mine, self.num_replicas = self.num_replicas, world
        try:
            return self.steps()
        finally:
            self.num_replicas = mine

    def _fingerprint(self, world: int | None = None) -> str:
        """The batches' inputs; with ``world``, also the number of ranks (the old format)."""
        import hashlib

        if self._digest is None:  # of the arrays, in chunks (a memory-mapped file is never copied whole)
            d = hashlib.sha256()
            for arr in (self.lengths, self.bucket_ids):
                if arr is None:
                    d.update(b"one bucket")
                    continue
                if self.windowed:
                    d.update(str(arr.dtype).encode())
                for lo in range(0, arr.size, _CHUNK):  # as int64: the bytes states saved before hashed
                    d.update(np.ascontiguousarray(arr[lo : lo + _CHUNK], dtype=np.int64).tobytes())
            self._digest = d
        h = self._digest.copy()
        if world is None:
            h.update(repr((self.max_tokens, self.max_samples, self.shuffle, self.drop_last)).encode())
        else:
            h.update(repr((self.max_tokens, self.max_samples, world, self.shuffle, self.drop_last)).encode())
        h.update(self.oversize.encode())
        return h.hexdigest()[:16]


def _pack_run(idx: np.ndarray, lens: np.ndarray, max_tokens: int, max_samples: int | None) -> list[list[int]]:
    """:func:`pack_batches` of one bucket's samples (in order) with a loop over batches, not
    samples (a window of a million samples in well under a second): each batch is the longest
    run from where the last ended whose tokens fit the budget (and ``max_samples``); a sample
    over the budget gets a batch of its own (only ``oversize="alone"`` lets one through)."""
    out: list[list[int]] = []
    alone = lens > max_tokens
    if alone.any():
        out += [[int(i)] for i in idx[alone]]
        idx, lens = idx[~alone], lens[~alone]
    csum = np.concatenate([[0], np.cumsum(lens)])
    i, m = 0, idx.size
    while i < m:
        j = int(np.searchsorted(csum, csum[i] + max_tokens, side="right")) - 1
        if max_samples is not None:
            j = min(j, i + max_samples)
        out.append(idx[i:j].tolist())
        i = j
    return out


def _default_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 1, 0
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
