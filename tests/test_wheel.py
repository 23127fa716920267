"""A release users can install: the wheel and sdist build, the wheel installs into a clean
virtual environment (no editable checkout on its path), and examples/balance_attention.py
runs from it under torchrun on 2 gloo ranks."""

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import knapformer
from knapformer.testing import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_into_a_clean_venv_and_runs_an_example(tmp_path):
    pytest.importorskip("build", reason="the 'build' package is not installed (pip install 'knapformer[dev]')")
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheels = list(dist.glob(f"knapformer-{knapformer.__version__}-*.whl"))
    assert wheels and list(dist.glob(f"knapformer-{knapformer.__version__}.tar.gz")), sorted(os.listdir(dist))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # no pip in it: this environment's pip installs into it
    py = env_dir / "bin" / "python"
    target = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target, str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert inst.returncode == 0, inst.stderr[-2000:]
    # torch and numpy from this environment's site-packages (plain path entries: its editable
    # knapformer hook is a .pth file, which only a site directory reads), knapformer from the wheel
    deps = os.pathsep.join(site.getsitepackages())
    env = {**os.environ, "PYTHONPATH": deps, "OMP_NUM_THREADS": "1"}
    where = subprocess.run(
        [str(py), "-c", "import knapformer; print(knapformer.__file__, knapformer.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert where.returncode == 0 and str(env_dir) in where.stdout and knapformer.__version__ in where.stdout, where
    example = tmp_path / "balance_attention.py"
    example.write_text((ROOT / "examples" / "balance_attention.py").read_text())
    run = subprocess.run(
        [str(py), "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", str(example)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
