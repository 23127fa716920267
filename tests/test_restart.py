"""A job that loses a rank and restarts from its last checkpoint loses nothing: under
``torchrun --max-restarts 1`` on 4 gloo ranks the restarted run's losses equal an
uninterrupted run's step for step (fp64) and every sample of the epoch is trained on exactly
once; resumed on 3 ranks instead, every sample is still trained on exactly once
(``examples/restart_train.py``: model, optimizer, sampler and balancer checkpointed every 2
steps; rank 1 or 2 killed with SIGKILL at step 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 64


def _torchrun(ranks: int, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    """``--link free``: two separate jobs (the uninterrupted one and the restarted one) plan alike
    only with the same links; measured ones differ with the machine's load at each start-up (a
    restart itself plans with the checkpoint's links)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port()}"]
    cmd += [f"--max-restarts={restarts}", str(ROOT / "examples" / "restart_train.py"), "--link", "free", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)


def _steps(record: Path) -> dict[int, dict]:
    """The steps that count, from a record written across attempts: a resumed attempt replaces
    whatever earlier attempts recorded after its checkpoint."""
    out: dict[int, dict] = {}
    for line in record.read_text().splitlines():
        row = json.loads(line)
        if row["step"] == row["resumed_at"] + 1:
            out = {s: r for s, r in out.items() if s <= row["resumed_at"]}
        out[row["step"]] = row
    return dict(sorted(out.items()))


def _exactly_once(steps: dict[int, dict]) -> None:
    seen = [i for row in steps.values() for batch in row["samples"] for i in batch]
    assert sorted(seen) == list(range(SAMPLES)), "every sample of the epoch exactly once"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    proc = _torchrun(4, "--ckpt", str(d / "ckpt"), "--record", str(d / "record.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _steps(d / "record.jsonl")


def test_a_restart_on_the_same_ranks_repeats_the_uninterrupted_run_exactly(tmp_path, uninterrupted):
    args = ["--ckpt", str(tmp_path / "ckpt"), "--record", str(tmp_path / "r.jsonl")]
    proc = _torchrun(4, *args, "--kill-at", "5", "--kill-rank", "2", restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 1: 4 ranks, resumed at step 4" in proc.stdout, proc.stdout
    assert "PeerLostError" in proc.stderr  # the survivors left with the named error
    steps = _steps(tmp_path / "r.jsonl")
    assert {r["attempt"] for r in steps.values()} == {0, 1}
    assert list(steps) == list(uninterrupted)
    for s, row in steps.items():
        assert row["loss"] == uninterrupted[s]["loss"], (s, row["loss"], uninterrupted[s]["loss"])
        assert row["samples"] == uninterrupted[s]["samples"], s
    _exactly_once(steps)


def test_a_resume_on_three_ranks_trains_on_every_sample_exactly_once(tmp_path):
    args = ["--ckpt", str(tmp_path / "ckpt"), "--record", str(tmp_path / "r.jsonl")]
    first = _torchrun(4, *args, "--kill-at", "5", "--kill-rank", "1")
    assert first.returncode != 0  # no restarts left: the job stops with the lost rank
    second = _torchrun(3, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "attempt 0: 3 ranks, resumed at step 4" in second.stdout, second.stdout
    steps = _steps(tmp_path / "r.jsonl")
    assert {r["ranks"] for r in steps.values()} == {4, 3}
    assert all(len(r["samples"]) == r["ranks"] for r in steps.values())
    _exactly_once(steps)
