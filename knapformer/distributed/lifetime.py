"""Exit without an abort: wait for gloo's worker threads before the interpreter shuts down.

Why a process that trained could abort at exit (``terminate called without an active
exception``, SIGABRT): a gloo worker thread marks a collective complete *before* it drops its
own reference to the work object, and with it to the work's tensors. Measured here: right after
``dist.all_reduce`` returns, the worker still holds the tensor in about 30% of calls, for
~100 µs on a loaded 2-core machine. If Python drops its last reference in that window (a
temporary), PyTorch keeps the tensor's Python object alive, owned by the tensor, and the worker
frees it later — which needs the interpreter lock. While the program runs that is harmless; if
the interpreter has begun to shut down, the worker cannot take the lock, its thread is unwound
through a ``noexcept`` destructor and the process aborts. Running the garbage collector before
``destroy_process_group()`` only changes when the last tensors die, not whether a worker still
holds them.

The fix: the first collective knapformer issues registers an ``atexit`` hook (:func:`wait_idle`).
``atexit`` hooks run before the interpreter starts shutting down, while the lock can still be
taken; the hook releases it (sleeping) until every gloo worker thread of the process
(``pt_gloo_runloop``) has been seen blocked in a wait twice in a row — idle, its last work
dropped and any Python object it held freed — or 5 s have passed. Then no worker touches Python
during shutdown, whoever issued the last collective (knapformer or the training loop). Nothing
runs per collective: the hook costs a few milliseconds once, at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Sequence

import knapformer.distributed.timing as timing
from knapformer.errors import PeerLostError

__all__ = ["collective", "gloo_workers_busy", "register_peers", "wait", "wait_idle"]

_log = logging.getLogger("knapformer")
_registered = False
_WORKER = "pt_gloo_runloop"


def collective(fn: Callable[[], object], tensors: Sequence = (), phase: str = "exchange", group=None):
    """Run the collective ``fn`` (over ``tensors``), with the exit hook in place. A failure
    that says a peer is gone or timed out becomes :class:`~knapformer.errors.PeerLostError`
    naming ``phase`` (and, from ``group``'s :func:`register_peers`, the dead ranks)."""
    global _registered
    if not _registered:
        atexit.register(wait_idle)
        _registered = True
    timing.pause()  # waiting for other ranks is not this rank's own work
    try:
        return fn()
    except RuntimeError as exc:
        raise _classified(exc, phase, group) from exc
    finally:
        timing.resume()


def wait(work, phase: str, group=None) -> None:
    """``work.wait()`` of an asynchronous collective, its failures classified as :func:`collective`'s."""
    timing.pause()
    try:
        work.wait()
    except RuntimeError as exc:
        raise _classified(exc, phase, group) from exc
    finally:
        timing.resume()


# -- a lost peer ---------------------------------------------------------------------------------
_peers: dict[int, tuple] = {}
"""id(process group) -> (the group, global ranks, hosts, pids, timeout seconds)."""
_LOST = (
    "closed by peer",
    "reset by peer",
    "timed out",
    "timeout",
    "broken pipe",
    "connection refused",
    "connection closed",
    "remote process exited",  # NCCL's ncclRemoteError
    "network error",
    "aborted",
)


def register_peers(group, ranks: Sequence[int], hosts: Sequence[str], pids: Sequence[int], timeout_s: float) -> None:
    """Who the members of ``group`` are (global rank, host, process id), for naming the dead
    one when an exchange fails."""
    _peers[id(group)] = (group, tuple(ranks), tuple(hosts), tuple(pids), float(timeout_s))


def _marker(pid: int) -> str:
    import tempfile

    user = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"knapformer-{user}", f"left-{pid}")


def _mark_leaving() -> None:
    """Leave a note (a file named by this process id) that this rank is about to raise and
    exit: a slower survivor that finds this process gone must not name it as the dead rank. A
    killed rank leaves none. Written before the raise, so before any exit (forked ranks leave
    through ``os._exit`` at once, without exit hooks)."""
    try:
        path = _marker(os.getpid())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(str(time.time()))
    except OSError:  # a read-only temp dir: the naming may then include survivors, as before
        pass


def _left_after_raising(pid: int) -> bool:
    """Process ``pid`` noted that it raised a lost-peer error and exited (within the hour: an
    old note of a reused process id does not count)."""
    try:
        return time.time() - os.path.getmtime(_marker(pid)) < 3600
    except OSError:
        return False


def _gone(pid: int) -> bool:
    """The process is gone (or a zombie: killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


def _classified(exc: RuntimeError, phase: str, group) -> RuntimeError:
    if isinstance(exc, PeerLostError):
        return exc
    import socket

    info = _peers.get(id(group)) if group is not None else None
    if info is not None and info[0] is not group:
        info = None
    host = socket.gethostname()
    text = str(exc)
    # by what the error says, not by its type: NCCL raises DistBackendError for lost peers and for
    # its own failures alike (an illegal address, invalid usage, out of memory), and "restart from
    # the last checkpoint" on those would send a launcher into a restart loop
    lost = any(w in text.lower() for w in _LOST)
    dead: list[int] = []
    local = [(r, pid) for r, h, pid in zip(info[1], info[2], info[3]) if h == host] if info is not None else []
    deadline = time.monotonic() + (1.0 if lost else 0.0)
    while True:  # a killed peer's sockets close a moment before its process is gone: look for a second
        # a peer that raised this error first and exited is a survivor, not the dead rank
        dead = [r for r, pid in local if pid != os.getpid() and _gone(pid) and not _left_after_raising(pid)]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not (lost or dead):
        return exc  # not about a peer: the error as it is
    import torch.distributed as dist

    me = dist.get_rank() if dist.is_initialized() else "?"
    if dead:
        who = f"rank(s) {dead} of the balancing group died (process gone)"
    else:
        bound = f"collective_timeout_s={info[4]:g}" if info is not None else "the group's timeout"
        who = f"a peer of the balancing group is gone or did not answer within {bound}"
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    _mark_leaving()
    return PeerLostError(
        f"SequenceBalancer: the {phase} exchange failed on rank {me}: {who}; this group cannot go on — "
        f"exit and restart from the last checkpoint (torchrun --max-restarts) [{first}]"
    )


def gloo_workers_busy() -> int | None:
    """gloo worker threads of this process that are not blocked in a wait (None: the platform
    cannot tell — no ``/proc``)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    busy = 0
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != _WORKER:
                    continue
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread just exited
            continue
        busy += state not in ("S", "D", "I")
    return busy


def wait_idle(timeout: float = 5.0) -> bool:
    """Sleep (the interpreter lock released) until every gloo worker thread has been seen idle
    twice in a row; True when they were, False after ``timeout`` seconds (logged) or where
    threads cannot be inspected (then a short grace period is all it can do)."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(0.002)
        busy = gloo_workers_busy()
        if busy is None:
            time.sleep(0.05)
            return False
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True
    _log.warning("knapformer: gloo worker threads still busy %.0f s after the program ended", timeout)
    return False
