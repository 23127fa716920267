"""``SequenceBalancer.plan_ahead``: the next step's plan settled during this step.

A step already meets its whole group once before its layers, in ``route``'s agreement (where
bad shapes raise on every rank). ``plan_ahead(next_lens)`` puts this rank's *next* lengths in
that row (:class:`AheadRequest`), so that the agreement that checks this step also gathers the
next step's lengths: from it every rank knows the whole group's next lengths, and the next plan
is solved in a worker process (:class:`AheadSolver`: a process holds no interpreter lock the
loop's kernel launches need) while this step computes. The next ``plan(next_lens)`` then makes
no collective and finds its plan ready; its digest rides on that step's ``route`` agreement.
``plan_ahead(plan)`` does the same for a plan made elsewhere (:class:`~knapformer.data.PlannedSteps`):
its digest is agreed in this step's row, and the next ``use_plan(plan)`` makes no collective.

Whatever goes wrong with a request — bad lengths or an invalid plan on one rank, a rank that
made no request, plans that differ — is seen by every rank in the same table
(:func:`settle`), and every rank raises it at the next ``plan``/``use_plan`` (:class:`Ahead`'s
``problem``): no rank is left waiting in a collective the others skip.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import dataclass

from knapformer.errors import BalancerInputError, DivergentCallError, PlanMismatchError
from knapformer.plan import Plan, Planner

__all__ = ["LENGTHS", "PLAN", "Ahead", "AheadRequest", "AheadSolver", "settle"]

_log = logging.getLogger("knapformer")

LENGTHS, PLAN = 1, 2
"""What a request carries: the next lengths, or the digest of a plan made elsewhere."""


@dataclass
class AheadRequest:
    """This rank's request, until an agreement carries it."""

    kind: int
    values: list[int]
    """The lengths (LENGTHS) or the plan's 62-bit digest (PLAN)."""
    error: str
    """Why the request is bad on this rank ("" if it is not)."""
    lens: list[int] | None = None
    plan: Plan | None = None
    planner: Planner | None = None
    """What the next plan is solved with (set when it is settled)."""

    def payload(self, seconds_bits: int) -> list[int]:
        """The row's payload: kind, error flag, this rank's last measured seconds, the values."""
        return [self.kind, 1 if self.error else 0, int(seconds_bits), *(self.values if not self.error else ())]


@dataclass
class Ahead:
    """What an agreement settled for the next step (the same on every rank)."""

    kind: int
    request: AheadRequest | None
    """This rank's request (what the next ``plan``/``use_plan`` is checked against)."""
    problem: tuple[type, str] | None = None
    """An error every rank raises at the next ``plan``/``use_plan``."""
    future: cf.Future | None = None
    """The next plan, being solved (LENGTHS)."""
    lens: list[list[int]] | None = None
    """Every rank's next lengths (LENGTHS)."""
    digest: int = 0
    """The agreed plan digest (PLAN)."""


def settle(rows: list[list[int]], request: AheadRequest | None, texts) -> tuple[Ahead, list[int] | None]:
    """Read the carrying agreement's payloads (``rows``: every rank's; empty where a rank made
    no request) into the next step's :class:`Ahead`, and return it with every rank's seconds
    (None unless every rank made a request). ``texts()``: every rank's error text (a collective
    every rank makes here, or none: the table says whether any rank failed)."""
    kinds = [r[0] if r else 0 for r in rows]
    if len(set(kinds)) > 1:
        made = [i for i, k in enumerate(kinds) if k]
        what = {LENGTHS: "plan_ahead(lengths)", PLAN: "plan_ahead(plan)"}
        detail = ", ".join(f"rank {i}: {what.get(k, 'no plan_ahead')}" for i, k in enumerate(kinds))
        message = (
            f"SequenceBalancer.plan_ahead: ranks made different requests for the next step ({detail}); every rank "
            "of the group must call plan_ahead alike"
        )
        return Ahead(kinds[made[0]], request, problem=(DivergentCallError, message)), None
    seconds = [r[2] for r in rows]
    if any(r[1] for r in rows):
        bad = [i for i, r in enumerate(rows) if r[1]]
        all_texts = texts()
        reasons = "; ".join(f"rank {i}: {all_texts[i]}" for i in bad)
        message = f"SequenceBalancer.plan_ahead: bad request on rank(s) {bad}: {reasons}"
        return Ahead(kinds[0], request, problem=(BalancerInputError, message)), seconds
    values = [r[3:] for r in rows]
    if kinds[0] == PLAN:
        digests = {v[0] for v in values}
        if len(digests) > 1:
            differ = [i for i, v in enumerate(values) if v[0] != values[0][0]]
            message = f"SequenceBalancer.plan_ahead: the plan differs on rank(s) {differ} from rank 0"
            return Ahead(PLAN, request, problem=(PlanMismatchError, message)), seconds
        return Ahead(PLAN, request, digest=values[0][0]), seconds
    return Ahead(LENGTHS, request, lens=values), seconds


def _solve(planner: Planner, lens: list[list[int]], rank: int) -> Plan:
    """The plan ``bal.plan`` would make from these lengths, with its digest and this rank's
    route spec (kept on the plan: built here, not on the training loop's thread)."""
    from knapformer.distributed.spec import prepared_spec

    plan = planner(lens)
    plan.digest()
    prepared_spec(plan, rank)
    return plan


def _watch_parent(parent: int) -> None:
    """In the worker: leave when the training process is gone (it may end without shutting
    the pool down, e.g. ``os._exit`` or a kill; the worker would then wait forever)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="knapformer-ahead-watch", daemon=True).start()


class AheadSolver:
    """One worker process per balancer, started at the first request (a few seconds: it
    imports torch), solving one plan at a time. ``inline=True`` solves on the caller's thread
    (what the next ``plan`` would do anyway; for tests and one-core machines). A broken worker
    (killed, out of memory) is not an error: the plan is solved inline, the same plan."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self._pool: cf.ProcessPoolExecutor | None = None

    def submit(self, planner: Planner, lens: list[list[int]], rank: int) -> cf.Future:
        if not self.inline:
            try:
                if self._pool is None:
                    context = multiprocessing.get_context("spawn")
                    self._pool = cf.ProcessPoolExecutor(
                        max_workers=1, mp_context=context, initializer=_watch_parent, initargs=(os.getpid(),)
                    )
                    _pools.add(self._pool)
                return self._pool.submit(_solve, planner, lens, rank)
            except (AssertionError, RuntimeError, OSError) as exc:  # no worker here (a daemonic process, a
                _log.warning("plan_ahead solves on the training thread: no worker process (%s)", exc)
                self.inline = True  # broken or shut-down pool): solve on this thread from now on
                self.close()
        done: cf.Future = cf.Future()
        try:
            done.set_result(_solve(planner, lens, rank))
        except Exception as exc:  # raised where the plan is taken (the same on every rank)
            done.set_exception(exc)
        return done

    def result(self, future: cf.Future, planner: Planner, lens: list[list[int]], rank: int) -> Plan:
        """The solved plan; a worker that died is replaced by an inline solve."""
        try:
            return future.result()
        except cf.process.BrokenProcessPool:
            self.close()
            return _solve(planner, lens, rank)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            _pools.discard(self._pool)
            self._pool = None


_pools: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown() -> None:  # pragma: no cover - exit path
    for pool in list(_pools):
        pool.shutdown(wait=False, cancel_futures=True)
