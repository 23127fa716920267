"""The README's runnable examples run under torchrun (gloo ranks) and print their steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.testing import free_port

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(script: str, ranks: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port()}"]
    return subprocess.run(
        [*cmd, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT
    )


@pytest.mark.parametrize(
    "script",
    [
        "flux_train_step.py",
        "flux2_train_step.py",
        "wan_train_step.py",
        "qwenimage_train_step.py",
        "hunyuanvideo15_train_step.py",
    ],
)
def test_example_runs_under_torchrun(script):
    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
    proc = _torchrun(script, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: global mean loss" in proc.stdout, proc.stdout[-1000:]


def test_automodel_example_trains_with_automodels_recipe(tmp_path):
    """examples/automodel_train.py --tiny (docs/automodel.md): Automodel's launcher plus the one
    hook, 3 steps of mixed-size token-budget batches on 2 ranks."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
    pytest.importorskip("nemo_automodel", reason="nemo-automodel is not installed (make setup installs it)")
    proc = _torchrun("automodel_train.py", 2, "--tiny", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "knapformer: trained 3 steps with Automodel's recipe" in proc.stdout, proc.stdout[-1000:]


def test_balance_attention_runs_on_three_ranks():
    """Any number of ranks: 3 (a group size few degrees divide) with the default layout auto."""
    proc = _torchrun("balance_attention.py", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # ranks print concurrently: two lines can land on one, so find every figure, not every line
    errors = [float(x) for x in re.findall(r"max error vs local attention ([0-9.e+-]+\d)", proc.stdout)]
    assert len(errors) == 3 and max(errors) < 1e-5, proc.stdout


def test_sampler_example_trains_two_epochs_on_two_ranks():
    proc = _torchrun("sampler_train.py", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1: ")]
    assert steps and "epoch 1 step 0: global mean loss" in proc.stdout, proc.stdout[-1000:]


def test_sharded_example_reads_parquet_shards_and_matches_per_sample_math():
    """examples/sharded_train.py (docs/data.md): samples in Parquet shards read by DataLoader
    workers, windowed token-budget batches from memory-mapped lengths, balanced on 2 ranks: the
    gradients equal per-sample math in fp64."""
    pytest.importorskip("pyarrow", reason="Parquet shards need pyarrow (pip install 'knapformer[parquet]')")
    proc = _torchrun("sharded_train.py", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [float(x) for x in re.findall(r"gradient error vs per-sample math ([0-9.e+-]+\d)", proc.stdout)]
    assert len(errors) >= 3 and max(errors) < 1e-10, proc.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_own_dit_matches_per_sample_math_in_fp64(ranks):
    """examples/own_dit.py (docs/own_model.md): the FSDP2-sharded, balanced steps, with a rank
    holding no sample, equal the model run on each sample alone in one process: outputs and
    every parameter gradient to 1e-10 relative (fp64), in both steps it prints."""
    proc = _torchrun("own_dit.py", ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = r"step (\d): global mean loss [0-9.]+, .*outputs ([0-9.e+-]+\d), gradients ([0-9.e+-]+\d)"
    found = re.findall(line, proc.stdout)
    assert [step for step, _, _ in found] == ["0", "1"], proc.stdout[-2000:]
    assert max(float(x) for _, *errs in found for x in errs) < 1e-10, proc.stdout[-2000:]


def test_plans_ahead_example_trains_with_plans_made_in_dataloader_workers():
    """examples/plans_ahead_train.py: the token-budget sampler's steps planned in 2 DataLoader
    worker processes per rank, run with use_plan on 2 ranks for 2 epochs."""
    proc = _torchrun("plans_ahead_train.py", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 1 step 0: global mean loss" in proc.stdout and "plan made ahead in" in proc.stdout, proc.stdout
