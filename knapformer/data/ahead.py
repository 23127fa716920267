"""Plans made ahead of the step, in the DataLoader's worker processes.

The token-budget sampler is a pure function of ``(seed, epoch)`` and the lengths, so every
process knows every rank's lengths of every step: the step's plan needs no gather. A
:class:`PlannedSteps` iterates the sampler's steps in a DataLoader worker and hands each with
its plan (``Planner`` from ``SequenceBalancer.planner()``), made there — in another process,
which holds no interpreter lock the training loop's kernel launches need — while the main
process trains on earlier steps. The main process runs it with ``bal.use_plan(step.plan)``: a
digest agreement, no gather, no solve::

    steps = PlannedSteps(sampler, bal.planner(), dataset=ds, collate_fn=collate)
    loader = DataLoader(steps, batch_size=None, num_workers=2)
    for epoch in range(E):
        sampler.set_epoch(epoch)
        for step in loader:
            bal.use_plan(step.plan)
            out = model(step.batch["tokens"], step.batch["seq_lens"], ..., executor=bal)

Workers share the steps round-robin (worker k takes steps k, k + W, ...), which the
DataLoader reads back in order. Each ``iter(loader)`` copies the sampler to the workers, so
``set_epoch`` and ``load_state_dict`` before it take effect; with ``persistent_workers=True``
they would not (leave it off). Resuming: ``sampler.state_dict(steps_done=step.step + 1)``.

With :func:`with_next` the next step's plan is agreed in this step's ``route`` instead
(``bal.plan_ahead(next.plan)``), and ``use_plan`` then makes no collective at all: a steady
step meets its whole group once, in ``route``::

    for step, after in with_next(loader):
        bal.use_plan(step.plan)              # no collective (after the first step)
        if after is not None:
            bal.plan_ahead(after.plan)       # rides on this step's route
        out = model(step.batch["tokens"], ..., executor=bal)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data as tud

from knapformer.data.sampler import TokenBudgetBatchSampler
from knapformer.distributed.spec import prepared_spec
from knapformer.plan import Plan, Planner

__all__ = ["PlannedStep", "PlannedSteps", "with_next"]


@dataclass
class PlannedStep:
    """One step of one rank: its ``batch`` (the collated samples, or their indices without a
    dataset), the step's ``plan`` (the whole group's), the step's index in the pass and every
    rank's sample indices of it."""

    batch: Any
    plan: Plan
    step: int
    indices: list[list[int]]


class PlannedSteps(tud.IterableDataset):
    """Iterable dataset of :class:`PlannedStep` (module docstring). ``lengths``: the tokens each
    sample's sequence has *as the model lays it out* (``i -> int``; default: the sampler's
    lengths), which the plan is made for and ``use_plan`` checks the step's tensors against.
    ``group``: the ranks of one balancing group, in the group's order, when the group is
    smaller than the sampler's replicas (default: all of them)."""

    def __init__(
        self,
        sampler: TokenBudgetBatchSampler,
        planner: Planner,
        *,
        dataset: Sequence | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        lengths: Callable[[int], int] | None = None,
        group: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(sampler, TokenBudgetBatchSampler):
            raise TypeError(f"PlannedSteps needs a TokenBudgetBatchSampler, got {type(sampler).__name__}")
        if not callable(planner):
            raise TypeError(f"planner must be a Planner (SequenceBalancer.planner()), got {type(planner).__name__}")
        if collate_fn is not None and dataset is None:
            raise ValueError("collate_fn needs a dataset")
        ranks = list(range(sampler.num_replicas)) if group is None else [int(r) for r in group]
        if sampler.rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"group {ranks} must list distinct ranks including this one ({sampler.rank})")
        if any(not 0 <= r < sampler.num_replicas for r in ranks):
            raise ValueError(f"group {ranks} has ranks outside the sampler's {sampler.num_replicas} replicas")
        self.sampler, self.planner, self.dataset, self.collate_fn = sampler, planner, dataset, collate_fn
        self.lengths, self.group = lengths, ranks

    def _lens(self, batch: list[int]) -> list[int]:
        if self.lengths is None:
            return [int(self.sampler.lengths[i]) for i in batch]
        return [int(self.lengths(i)) for i in batch]

    def __iter__(self) -> Iterator[PlannedStep]:
        info = tud.get_worker_info()
        me, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for s, step in enumerate(self.sampler.iter_steps()):
            if s % workers != me:
                continue
            plan = self.planner([self._lens(step[r]) for r in self.group])
            # what use_plan checks and builds, done here (kept on the plan): validated, its
            # digest, this rank's route spec — the training loop then only agrees the digest
            plan.validate()
            plan.digest()
            prepared_spec(plan, self.group.index(self.sampler.rank))
            mine = step[self.sampler.rank]
            if self.dataset is None:
                batch: Any = list(mine)
            else:
                items = [self.dataset[i] for i in mine]
                batch = self.collate_fn(items) if self.collate_fn is not None else items
            yield PlannedStep(batch=batch, plan=plan, step=self.sampler.pass_start + s, indices=step)

    def __len__(self) -> int:
        return len(self.sampler)


def with_next(items: Iterable) -> Iterator[tuple[Any, Any]]:
    """``(item, the next item or None)`` for each item: what a loop needs to hand the next
    step's plan to ``bal.plan_ahead`` during this one (it fetches one item ahead, as a
    DataLoader's prefetch does anyway)."""
    it = iter(items)
    try:
        item = next(it)
    except StopIteration:
        return
    for after in it:
        yield item, after
        item = after
    yield item, None
