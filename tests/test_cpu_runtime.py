"""CPU rank set-up helpers of ``knapformer.testing`` that change how a process runs."""

import subprocess
import sys

import pytest

_REFAULT = """
import ctypes, ctypes.util, resource, sys
from knapformer.testing import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def step():  # like a training step: activations live together, then all are freed
    blocks = [libc.malloc(4 << 20) for _ in range(10)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _REFAULT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_stops_refaulting_the_next_steps_buffers():
    # default glibc trims the 40 MB freed at the heap top and faults it in again every step
    assert _faults("default") > 5000
    assert _faults("tuned") < 500


def _caller_state(rank: int, world: int) -> tuple:
    import os

    import knapformer.testing.dist as D

    return os.getppid(), getattr(D, "_caller_mark", None), torch_threads()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def test_ranks_start_from_a_clean_process_not_from_the_caller(monkeypatch):
    """run_distributed's ranks (forked from a forkserver where there is one) see none of the
    caller's state — here a monkeypatched module attribute — and run one thread each, as
    spawned ones do; they are not the caller's children."""
    import os

    import knapformer.testing.dist as D
    from knapformer.testing import process_context, run_distributed

    monkeypatch.setattr(D, "_caller_mark", "set in the caller", raising=False)
    out = run_distributed(_caller_state, 2)
    assert all(mark is None and threads == 1 for _, mark, threads in out), out
    if process_context().get_start_method() == "forkserver":
        assert all(ppid != os.getpid() for ppid, _, _ in out)  # forked by the server


def test_spawn_can_be_asked_for():
    from knapformer.testing import process_context, run_distributed

    assert process_context("spawn").get_start_method() == "spawn"
    assert run_distributed(_caller_state, 2, start_method="spawn")[0][1] is None
    with pytest.raises(ValueError, match="start_method"):
        process_context("fork")
