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
import collections
import concurrent.futures as cf
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

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
        return Ahead(PLAN, request), seconds  # (the request's plan: its digest is every rank's)
    return Ahead(LENGTHS, request, lens=values), seconds


def _solve(planner: Planner, lens: list[list[int]], rank: int) -> Plan:
    """The plan ``bal.plan`` would make from these lengths, with its digest and this rank's
    route spec (kept on the plan: built here, not on the training loop's thread)."""
    from knapformer.distributed.spec import prepared_spec

    plan = planner(lens)
    plan.digest()
    prepared_spec(plan, rank)
    return plan


class WorkerGone(RuntimeError):
    """The solver's worker process ended (killed, out of memory): the plan is solved inline."""


def _frame(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    return None if len(data) < n else pickle.loads(data)


class AheadSolver:
    """One worker process per balancer, started at the first request (a second or two: it
    imports torch), solving one plan at a time. It is a fresh interpreter (``python -c`` running
    :func:`_serve`), not a multiprocessing child: it does not import the
    training script again (a script without a ``__main__`` guard would otherwise run twice),
    and it leaves when the training process goes (its input closes). ``inline=True`` solves
    on the caller's thread (what ``plan`` does anyway). A worker that cannot start or dies is
    not an error: the plan is solved inline — the same plan."""

    def __init__(self, inline: bool = False) -> None:
        self.inline = inline
        self._proc: subprocess.Popen | None = None
        self._pending: collections.deque[cf.Future] = collections.deque()
        self._lock = threading.Lock()

    def _start(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where this knapformer is imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from knapformer.distributed.ahead import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        threading.Thread(target=self._read, args=(self._proc,), name="knapformer-ahead", daemon=True).start()
        _procs.add(self._proc)

    def _read(self, proc: subprocess.Popen) -> None:
        """Hand each answer to the oldest request (a thread: it waits on the pipe without the
        interpreter lock)."""
        while True:
            answer = _read_frame(proc.stdout)
            with self._lock:
                if answer is None:  # the worker is gone: every request still waiting is solved inline
                    while self._pending:
                        self._pending.popleft().set_exception(WorkerGone("the plan_ahead worker ended"))
                    return
                future = self._pending.popleft()
            ok, value = answer
            future.set_result(value) if ok else future.set_exception(value)

    def submit(self, planner: Planner, lens: list[list[int]], rank: int) -> cf.Future:
        future: cf.Future = cf.Future()
        if not self.inline and (self._proc is None or self._proc.poll() is not None):
            try:
                self._start()
            except OSError as exc:  # no worker here: solve on this thread from now on
                _log.warning("plan_ahead solves on the training thread: no worker process (%s)", exc)
                self.inline = True
        if not self.inline:
            try:
                with self._lock:
                    self._pending.append(future)
                    _frame(self._proc.stdin, (planner, lens, rank))
                return future
            except (OSError, ValueError, pickle.PicklingError):  # the worker just died: this one inline
                with self._lock:
                    if future in self._pending:
                        self._pending.remove(future)
                self.close()
        try:
            future.set_result(_solve(planner, lens, rank))
        except Exception as exc:  # raised where the plan is taken (the same on every rank)
            future.set_exception(exc)
        return future

    def result(self, future: cf.Future, planner: Planner, lens: list[list[int]], rank: int) -> Plan:
        """The solved plan; a worker that died is replaced by an inline solve."""
        try:
            return future.result()
        except WorkerGone:
            self.close()
            return _solve(planner, lens, rank)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _procs.discard(proc)
            try:
                proc.stdin.close()  # the worker leaves at the end of its input
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


_procs: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown() -> None:  # pragma: no cover - exit path
    for proc in list(_procs):
        try:
            proc.stdin.close()
        except OSError:
            pass


def _serve() -> None:  # pragma: no cover - runs in the worker process
    """The worker: solve each request read from standard input, answer on standard output, and
    leave when the input ends (the training process closed it, or is gone)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers
    while True:
        request = _read_frame(stdin)
        if request is None:
            return
        try:
            answer = (True, _solve(*request))
        except Exception as exc:
            answer = (False, exc)
        _frame(stdout, answer)
