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
