"""Clean exits: run a 2-rank script under torchrun N times and count the runs that did not exit 0.

    python benchmarks/clean_exit.py                         # the training loop, 50 runs
    python benchmarks/clean_exit.py --script repro          # torch only (gloo_exit_repro.py), with and without the hook
    python benchmarks/clean_exit.py --script examples/flux_train_step.py --runs 20
    python benchmarks/clean_exit.py --script demo --runs 5  # knapformer simulate (make demo's job), 2 steps

``train`` is a training loop as the docs show it: a reference Transformer through a
``SequenceBalancer`` (auto), the global-mean loss, summed gradients, an optimizer, three steps,
``destroy_process_group()`` and no ``gc.collect``. ``--no-hook`` skips knapformer's exit hook
(``knapformer.distributed.lifetime``) to show the rate it removes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

TRAIN = """
import sys, torch, torch.distributed as dist
from knapformer import SequenceBalancer, WorkloadModel
from knapformer.models import Transformer, TransformerConfig
from knapformer.training import global_mean_loss, sum_gradients
dist.init_process_group("gloo")
if "--no-hook" in sys.argv:
    import knapformer.distributed.lifetime as lifetime
    lifetime._registered = True  # pretend it is registered: it never is
torch.set_num_threads(1)
torch.manual_seed(0)
model = Transformer(TransformerConfig(in_dim=8, dim=32, num_heads=4, num_layers=2, out_dim=8))
bal = SequenceBalancer("auto", WorkloadModel(d_model=32, num_heads=4))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(3):
    lens = [64, 8] if dist.get_rank() == 0 else [200]
    bal.plan(lens)
    out = model(torch.randn(sum(lens), 8), lens, executor=bal)
    global_mean_loss((out ** 2).sum(), out.numel(), gradients="sum").backward()
    sum_gradients(model)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _command(script: str, hook: bool) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    if script == "demo":
        return [*torchrun, "-m", "knapformer.tools.simulate", "--steps", "2", "--warmup", "0", "--quiet"]
    if script == "repro":
        return [*torchrun, str(ROOT / "benchmarks" / "gloo_exit_repro.py"), *(["--hook"] if hook else [])]
    if script == "train":
        path = Path(tempfile.gettempdir()) / "knapformer_clean_exit_train.py"
        path.write_text(TRAIN)
        return [*torchrun, str(path), *([] if hook else ["--no-hook"])]
    return [*torchrun, str(ROOT / script)]


def run(script: str, runs: int, hook: bool) -> dict:
    from knapformer.testing import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    bad, aborts, t0 = 0, 0, time.perf_counter()
    for _ in range(runs):
        cmd = _command(script, hook)
        cmd.insert(cmd.index("2") + 1, f"--master-port={free_port()}")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        bad += proc.returncode != 0
        aborts += "terminate called without an active exception" in proc.stderr
    return {
        "script": script,
        "hook": hook,
        "runs": runs,
        "failed": bad,
        "aborts": aborts,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", default="train", help="train, repro, demo, or a script path (examples/...)")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--no-hook", action="store_true", help="without knapformer's exit hook (train, repro)")
    ap.add_argument("--out", default="runs/bench/clean_exit.json")
    args = ap.parse_args()
    hooks = [False, True] if args.script == "repro" else [not args.no_hook]
    rows = [run(args.script, args.runs, hook) for hook in hooks]
    print_table(
        rows, [("script", "s"), ("hook", "d"), ("runs", "d"), ("failed", "d"), ("aborts", "d"), ("seconds", ".0f")]
    )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
