"""The prepared accelerator check runs on CPU (--smoke): every part ok or skipped with a reason."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_accelerator_check_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "accelerator_check.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "check.json").read_text())
    parts = report["parts"]
    assert len(parts) == 8 and report["meta"]["smoke"] is True  # 0 preflight ... 8; 5 (CPU ranks) dropped
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        if part["status"] == "skipped":
            assert part["reason"], name
    executor = parts["2 executor on the device (gloo ranks sharing it; one NCCL rank)"]
    for name, case in executor["multi_rank"]["worlds"]["2"]["cases"].items():  # data moved between ranks
        assert case["ok"] and case["ranks_with_data"] >= 2 and case["syncs_layers_after_first"] == 0, (name, case)
    assert parts["6 ring block math"]["worst_rel_err"]["fp64"] <= 1e-9
    kernels = parts["7 ring block kernels"]
    assert {"cpu_flash", "tiled"} <= set(kernels["usable"]) and kernels["worst_rel_err"] <= 1e-4, kernels
    gathered = parts["8 pre_attn kernel on ring blocks"]
    assert "sdpa" in gathered["backends"] and gathered["worst"] <= 1e-4 and len(gathered["rel_err"]) >= 2, gathered
    assert (tmp_path / "check.txt").read_text().startswith("accelerator check")
