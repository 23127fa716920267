"""A torch-only reproduction of the abort at exit (for an upstream report): gloo's worker thread
frees a tensor's Python object after the interpreter began shutting down.

    torchrun --nproc-per-node 2 benchmarks/gloo_exit_repro.py            # aborts in ~45% of runs
    torchrun --nproc-per-node 2 benchmarks/gloo_exit_repro.py --hook     # knapformer's exit hook: none

Each rank all-reduces a temporary (Python drops it as soon as the call returns) and then the
interpreter shuts down. ``dist.all_reduce`` returns once the work is marked complete, but the
gloo worker thread drops its own reference to the work — and to the tensor — a little later
(~100 µs); a tensor whose Python object died meanwhile is then freed by the worker, which needs
the GIL. If that happens after ``Py_FinalizeEx`` started, the thread cannot take it and is
unwound through a noexcept destructor: "terminate called without an active exception",
SIGABRT, and torchrun reports ChildFailedError. ``destroy_process_group()`` does not help (it
unregisters the group; its threads live on), nor does ``gc.collect``.

Measured on the 2-core development VM (torch 2.13.0 CPU, Python 3.11): 9 aborts in 20 runs
without the hook, 0 in 20 with it (``python benchmarks/clean_exit.py --script repro``).
"""

import sys

import torch
import torch.distributed as dist

if "--hook" in sys.argv:  # what knapformer's first collective registers (knapformer.distributed.lifetime)
    from knapformer.distributed.lifetime import collective

    collective(lambda: None)
dist.init_process_group("gloo")
x = torch.ones(8)
for _ in range(50):
    dist.all_reduce(x * 1.0)  # a temporary
