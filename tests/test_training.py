"""A real training loop: FSDP2 with the global-mean loss (mixed precision, checkpointing,
gradient accumulation), autocast, divergent calls, resumable state and device meshes, on gloo
ranks; clean exits without a manual garbage collection."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from knapformer.testing import free_port, run_distributed
from tests import train_workers as W

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")


@pytest.mark.parametrize("world, mixed, checkpointing", [(2, False, True), (4, True, False)])
def test_fsdp2_global_mean_loss_equals_the_full_batch_gradient(world, mixed, checkpointing):
    """Two micro-batches per step (a rank empty in one), auto layout, FSDP2 averaging the
    gradients: global_mean_loss makes them the single-process gradients of the mean over every
    token (fp64; with mixed precision the blocks compute in fp32)."""
    res = run_distributed(W.fsdp_global_mean, world, mixed, checkpointing, timeout=240)
    tol = 1e-5 if mixed else 1e-10
    assert all(err < tol for err in res), res


def test_global_mean_loss_rejects_bad_arguments():
    from knapformer.training import global_mean_loss

    with pytest.raises(ValueError, match="gradients must be one of"):
        global_mean_loss(torch.zeros(()), 1, gradients="avg")
    with pytest.raises(ValueError, match="one-element tensor"):
        global_mean_loss(torch.zeros(3), 1)


def test_attention_under_autocast_equals_local_executor():
    res = run_distributed(W.autocast_equals_local, 2, timeout=120)
    assert all(err < 1e-2 for err in res), res  # bf16 on both sides: the same casts, other orders


@pytest.mark.parametrize("world", [2, 4])
def test_divergent_calls_raise_on_every_rank_naming_each_call(world):
    res = run_distributed(W.divergent_calls, world, timeout=120)
    for case, where in (("layer drop", "attention (call 3 of step 1)"), ("extra plan", "plan (call")):
        for kind, msg in (r[case] for r in res):
            assert kind == "DivergentCallError", (case, msg)
            assert "ranks made different calls" in msg and where in msg, (case, msg)
    assert "rank 0 at attention (call 3 of step 1)" in res[1]["layer drop"][1]
    assert "at reverse_route (call 3 of step 1)" in res[0]["layer drop"][1]


def test_resume_from_state_dict_plans_identically():
    res = run_distributed(W.resume_identical, 2, timeout=120)
    for r in res:
        assert r["resumed"] == r["whole"], "plans after a resume differ from the uninterrupted run"
        assert r["fresh"][0] != r["whole"][0], "the test's step 4 must depend on the restored state"
        assert r["num_plans"] == 6 and r["model_changed"]
        assert r["speeds"] is not None and r["speeds"][1] < r["speeds"][0]  # the slow rank was found


def test_device_mesh_names_the_balancing_group():
    res = run_distributed(W.device_mesh_groups, 4, timeout=120)
    for rank, r in enumerate(res):
        assert r["1-D"] == [0, 1, 2, 3]
        assert r["2-D balance"] == ([0, 1] if rank < 2 else [2, 3])


@pytest.mark.parametrize("script", ["flux_train_step.py"])
def test_examples_exit_cleanly_without_a_manual_garbage_collection(script):
    """Two of the 50 clean exits benchmarks/clean_exit.py counts (exit status 0 each time; a
    third is test_examples' run of the same script)."""
    pytest.importorskip("diffusers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
        ]
        proc = subprocess.run(
            [*cmd, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=180, env=env
        )
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_jsonl_writer_on_every_rank_writes_one_record_per_step(tmp_path):
    import json

    run_distributed(W.telemetry_files, 2, str(tmp_path), timeout=60)
    shared = [json.loads(line) for line in (tmp_path / "shared.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shared] == [1, 2, 3]
    for rank in (0, 1):
        assert len((tmp_path / f"rank_{rank}.jsonl").read_text().splitlines()) == 3
