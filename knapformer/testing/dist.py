"""Start real gloo (CPU) or NCCL (GPU) processes on one machine and collect their results.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes on a free loopback
port, each with one CPU thread, runs ``fn(rank, world_size, *args)`` inside an initialised
process group, and returns the per-rank results. If any rank raises, all ranks are ended and
that rank's traceback is re-raised; if the whole run exceeds ``timeout`` seconds (a hang),
all ranks are ended and ``TimeoutError`` is raised.

Processes come from :func:`process_context`: a *forkserver* where the platform has one — a
clean server process, started once, that imports torch and knapformer's distributed layer and
forks each rank from itself. A rank then starts in milliseconds instead of re-importing torch
(~1.5 s of CPU per rank per run), and, as with ``spawn``, inherits nothing of the caller's
state (not its threads, modules or monkeypatches; its environment is the server's, taken when
the server started). ``spawn`` elsewhere.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "keep_freed_memory", "pin_to_core", "process_context", "run_distributed"]

PRELOAD = ["torch", "torch.distributed", "knapformer.distributed", "knapformer.testing"]
"""What the forkserver imports once for every rank it forks."""


def process_context(start_method: str | None = None):
    """The multiprocessing context ranks are started from (module docstring): a forkserver
    that has imported :data:`PRELOAD`, or ``spawn`` where there is no forkserver;
    ``start_method`` (``"spawn"``, ``"forkserver"``) chooses one instead."""
    if start_method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method must be None, 'spawn' or 'forkserver', got {start_method!r}")
    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first rank)
    return ctx


def pin_to_core(local_rank: int, local_world: int) -> int | None:
    """Pin every thread of this process (gloo's I/O threads included) to one core of its
    allowed set, one rank per core: fewer migrations, and collectives run on the rank's own
    core, where it waits anyway. Returns the core, or None if the platform cannot or there
    are fewer cores than local ranks."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if local_world > len(cores):
        return None
    core = {cores[local_rank]}
    tids = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # a thread that just exited
            pass
    return cores[local_rank]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Make glibc keep freed activation buffers for reuse instead of returning them to the OS.

    By default glibc serves large blocks with fresh ``mmap`` pages and trims the heap top
    beyond a threshold that adapts to the largest block freed so far, so a process whose
    buffers change size (a rank that was idle in one run and balanced in the next) page-faults
    and zero-fills tens of MB per step: measured ~7,000 faults and ~28 ms of system time per
    demo step on one rank. Fixed thresholds (what ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` set) keep those pages. Returns False where glibc's ``mallopt``
    is not available (other C libraries, non-Linux); call it early in each CPU rank."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, backend, args, results, pg_timeout):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = None,
    pg_timeout: float = 45.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by
    rank. ``start_method``: see :func:`process_context` (``"spawn"`` for ranks that must see
    environment variables set after the forkserver started)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    ctx = process_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, args, results, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s (hang?)")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
