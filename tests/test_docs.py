"""The README's and the docs' code runs, the docs site builds with no warnings, and every public
name has a docstring and a place in the API reference.

Each page's ``python`` blocks run in order as one script (a page is a session: a later block
uses what an earlier one defined). A page whose code calls ``init_process_group`` runs under
``torchrun --nproc-per-node 2`` on gloo; the others in one process. ``bash`` and ``text`` blocks
are shown, not run (commands that need a GPU or minutes of compute are there).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from knapformer.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PUBLIC = ["knapformer", "knapformer.plan", "knapformer.data", "knapformer.training"]
INTEGRATIONS = [
    "knapformer.integrations.flux",
    "knapformer.integrations.flux2",
    "knapformer.integrations.wan",
    "knapformer.integrations.qwenimage",
    "knapformer.integrations.hunyuanvideo15",
    "knapformer.integrations.hunyuanvideo15_official",
    "knapformer.integrations.sd3",
    "knapformer.integrations.torchtitan_flux",
    "knapformer.integrations.seam",
]


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


def _code(page: Path) -> str:
    return "\n\n".join(python_blocks(page))


def _run(script: Path, cwd: Path, *, ranks: int = 0) -> subprocess.CompletedProcess:
    for name in ("profiles", "examples"):  # pages refer to these by relative path
        if not (cwd / name).exists():
            (cwd / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, str(script)]
    if ranks:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            f"--master-port={free_port()}",
        ]
        cmd.append(str(script))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


LOCAL = [p for p in PAGES if python_blocks(p) and "init_process_group" not in _code(p)]
DISTRIBUTED = [p for p in PAGES if "init_process_group" in _code(p)]

_SESSIONS = """
import datetime, os, sys, traceback
import torch.distributed as dist

# every page calls init_process_group itself; each gets a fresh key space in torchrun's store
# (a second group over the same keys would read the first one's stale addresses)
base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=120))
real_init = dist.init_process_group
for i, (name, code) in enumerate(PAGES):
    def init(*args, _prefix=f"page{i}", **kwargs):
        kwargs.setdefault("store", dist.PrefixStore(_prefix, base))
        kwargs.setdefault("rank", int(os.environ["RANK"]))
        kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
        return real_init(*args, **kwargs)
    dist.init_process_group = init
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"PAGE FAILED: {name}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    finally:
        dist.init_process_group = real_init
        if dist.is_initialized():
            dist.destroy_process_group()
"""


@pytest.mark.parametrize("page", LOCAL, ids=lambda p: p.name)
def test_page_code_runs(page, tmp_path):
    script = tmp_path / f"{page.stem}_snippets.py"
    script.write_text(_code(page))
    proc = _run(script, tmp_path)
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_distributed_pages_run_on_two_ranks(tmp_path):
    """Every page whose code initialises a process group, one after another in the same two
    torchrun ranks (each page inits and the harness destroys the group between pages)."""
    if any("from diffusers" in _code(p) for p in DISTRIBUTED):
        pytest.importorskip("diffusers")
    # the torchtitan recipe needs knapformer[torchtitan] (Python >= 3.11): left out without it
    titan = importlib.util.find_spec("torchtitan") is not None
    pages = [(p.name, _code(p)) for p in DISTRIBUTED if titan or "from torchtitan" not in _code(p)]
    script = tmp_path / "distributed_pages.py"
    script.write_text(f"PAGES = {pages!r}\n" + _SESSIONS)
    proc = _run(script, tmp_path, ranks=2)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    assert len(DISTRIBUTED) >= 5  # README, balancing, training, integrations, failures, calibration


def test_own_model_page_is_the_example():
    """docs/own_model.md walks through examples/own_dit.py: its python blocks, in order, are that
    file after its docstring, line for line (blank lines aside), so the page cannot drift from
    the code test_examples runs (and the page's own run here is the example's run)."""
    lines = lambda text: [line for line in text.splitlines() if line.strip()]
    page = lines("\n".join(python_blocks(ROOT / "docs" / "own_model.md")))
    body = lines((ROOT / "examples" / "own_dit.py").read_text().split('"""', 2)[2])
    assert page == body, next(
        (f"line {i}: page {a!r} != example {b!r}" for i, (a, b) in enumerate(zip(page, body)) if a != b),
        f"{len(page)} lines on the page, {len(body)} in the example",
    )


def test_public_names_have_docstrings():
    missing = []
    for modname in PUBLIC + INTEGRATIONS:
        mod = importlib.import_module(modname) if "integrations" not in modname else _maybe(modname)
        if mod is None:
            continue
        for name in mod.__all__:
            obj = getattr(mod, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
                missing.append(f"{modname}.{name}")
    assert not missing, missing


def _maybe(modname: str):
    try:
        return importlib.import_module(modname)
    except ImportError:  # diffusers missing
        return None


MKDOCS = shutil.which("mkdocs", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(MKDOCS is None, reason="mkdocs not installed (pip install -e '.[docs]')")
def test_docs_site_builds_strict_with_every_public_name(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [MKDOCS, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    absent = [
        f"{m}.{n}"
        for m in PUBLIC + INTEGRATIONS
        for n in importlib.import_module(m).__all__
        if f'id="{m}.{n}"' not in api
    ]
    assert not absent, absent
