"""A rank that dies (SIGKILL) or hangs in the middle of a step: every surviving rank leaves the
exchange it waits in with PeerLostError naming the phase (and, on this host, the dead rank)
within ``collective_timeout_s``, and its process exits — no survivor waits for the job's own
(longer) timeout or hangs. Real gloo processes on loopback."""

from __future__ import annotations

import queue
import time

import pytest

from knapformer.testing import free_port, process_context
from tests import peer_workers as W

BOUND_S = 20.0
"""collective_timeout_s of the kill tests: a dead peer is seen at once (its socket closes); a
report after this long would be the timeout's, not the death's."""
JOB_TIMEOUT_S = 120.0  # the process group's own timeout (peer_workers): a report after it is not the balancer's


def _run(world: int, victim: int, phase: str, mode: str, timeout_s: float) -> tuple[dict, dict]:
    # the suite's forkserver: a forked rank leaves through os._exit at once, so a survivor that
    # raised first is gone (faster than a launcher's processes, which exit through interpreter
    # shutdown) before a slower one names the dead rank: it must still name only the victim
    ctx = process_context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=W.worker, args=(r, world, port, victim, phase, mode, timeout_s, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict = {}
    exited: dict = {}
    deadline = time.monotonic() + 60 + 2 * timeout_s
    try:
        while time.monotonic() < deadline and len(exited) < world - 1:
            try:
                rank, kind, msg, secs, tb = out.get(timeout=0.2)
                reports[rank] = {"kind": kind, "msg": msg, "secs": secs, "tb": tb, "at": time.monotonic()}
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r != victim and r not in exited and p.exitcode is not None:
                    exited[r] = {"code": p.exitcode, "at": time.monotonic()}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return reports, exited


@pytest.mark.parametrize("phase, victim", list(zip(W.PHASES, (3, 1, 2, 0, 3))))
def test_a_killed_rank_ends_every_survivor_quickly_with_the_phase_named(phase, victim):
    world = 4
    reports, exited = _run(world, victim, phase, "kill", BOUND_S)
    survivors = [r for r in range(world) if r != victim]
    assert sorted(reports) == survivors, (reports, exited)
    for r in survivors:
        rep = reports[r]
        assert rep["kind"] == "PeerLostError", rep["tb"]
        assert f"rank(s) [{victim}]" in rep["msg"] and "died" in rep["msg"], rep["msg"]
        assert rep["secs"] < BOUND_S, rep
        assert r in exited and exited[r]["code"] != 0, (r, exited)  # the process ended, with the error
        assert exited[r]["at"] - rep["at"] < 30, "the process exits after the error (it does not hang)"
    named = {reports[r]["msg"].split(" exchange failed")[0] for r in survivors}
    assert any(phase in n for n in named), (phase, named)


def test_a_hung_rank_ends_every_survivor_within_the_timeout():
    """The victim stays alive but never joins (a stuck kernel, a deadlock): the survivors raise
    once collective_timeout_s has passed, not after the job's own two minutes (the bounds tell
    the two timeouts apart: a busy machine only delays a report by seconds)."""
    timeout_s = 6.0
    reports, exited = _run(3, 1, "route", "hang", timeout_s)
    for r in (0, 2):
        rep = reports[r]
        assert rep["kind"] == "PeerLostError" and "did not answer within collective_timeout_s=6" in rep["msg"], rep
        assert timeout_s * 0.8 < rep["secs"] < JOB_TIMEOUT_S, rep
        assert r in exited and exited[r]["code"] != 0
