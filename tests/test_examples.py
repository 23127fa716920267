"""The README's runnable examples run under torchrun (2 gloo ranks) and print their steps."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["flux_train_step.py", "flux2_train_step.py", "wan_train_step.py"])
def test_example_runs_under_torchrun(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    from knapformer.testing import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.run(
        [*cmd, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: global mean loss" in proc.stdout, proc.stdout[-1000:]
