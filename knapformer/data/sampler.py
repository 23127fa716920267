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
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["TokenBudgetBatchSampler", "pack_batches"]

Lengths = Sequence[int] | np.ndarray | Callable[[int], int]


def _as_lengths(lengths: Lengths, num_samples: int | None) -> np.ndarray:
    if callable(lengths):
        if num_samples is None:
            raise ValueError("lengths is a callable: pass num_samples (the dataset's length) too")
        lengths = [lengths(i) for i in range(int(num_samples))]
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one token count per sample, got an array of shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(arr == np.floor(arr)):
            raise ValueError(f"lengths must be whole token counts, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if num_samples is not None and arr.size != num_samples:
        raise ValueError(f"lengths has {arr.size} entries but num_samples is {num_samples}")
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i} has {int(arr[i])} tokens: every sample needs at least one token")
    return arr


def _as_buckets(buckets: Sequence[Hashable] | Callable[[int], Hashable] | None, n: int) -> np.ndarray:
    """Bucket ids 0..B-1 per sample (in order of first appearance of each key)."""
    if buckets is None:
        return np.zeros(n, dtype=np.int64)
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
    for i in order:
        i = int(i)
        n = int(lengths[i])
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
    ``DistributedSampler``.
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
        self.lengths = _as_lengths(lengths, num_samples)
        self.bucket_ids = _as_buckets(buckets, self.lengths.size)
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
        if self.oversize == "error":  # fail at construction, not in the middle of an epoch
            over = np.flatnonzero(self.lengths > self.max_tokens)
            if over.size:
                pack_batches(over[:1], self.lengths, self.max_tokens)

    # -- the epoch's batches ------------------------------------------------------------------------------
    def steps(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every step of ``epoch`` (default: the current one): ``steps[s][r]`` is rank r's batch
        of step s (a list of sample indices, possibly empty). For an epoch resumed on another
        number of ranks (:meth:`load_state_dict`): the steps of the samples it had not consumed."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
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
        start = self._start if self._resumed_epoch == self.epoch else 0
        self._start, self._resumed_epoch = 0, None  # a resume applies to one pass only
        self._yielded = self._pass_start = start
        for step in self.steps()[start:]:
            self._yielded += 1
            yield step[self.rank]

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank); a resumed pass yields fewer."""
        if self._resumed_epoch == self.epoch:  # a resume not yet started
            return len(self.steps()) - self._start
        return len(self.steps()) - self._pass_start

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

        h = hashlib.sha256()
        for arr in (self.lengths, self.bucket_ids):
            h.update(np.ascontiguousarray(arr).tobytes())
        if world is None:
            h.update(repr((self.max_tokens, self.max_samples, self.shuffle, self.drop_last)).encode())
        else:
            h.update(repr((self.max_tokens, self.max_samples, world, self.shuffle, self.drop_last)).encode())
        h.update(self.oversize.encode())
        return h.hexdigest()[:16]


def _default_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 1, 0
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
