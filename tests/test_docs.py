"""The README's and the docs' code runs, the docs site builds with no warnings, and every public
name has a docstring and a place in the API reference.

Each page's ``python`` blocks run in order as one script (a page is a session: a later block
uses what an earlier one defined). A page whose code calls ``init_process_group`` runs under
``torchrun --nproc-per-node 2`` on gloo; the others in one process. ``bash`` and ``text`` blocks
are shown, not run (commands that need a GPU or minutes of compute are there).
"""

from __future__ import annotations

import importlib
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
INTEGRATIONS = ["knapformer.integrations.flux", "knapformer.integrations.flux2", "knapformer.integrations.wan"]


def python_blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_page_code_runs(page, tmp_path):
    if "diffusers" in page.read_text() and "import diffusers" in "".join(python_blocks(page)):
        pytest.importorskip("diffusers")
    code = "\n\n".join(python_blocks(page))
    distributed = "init_process_group" in code
    if distributed:
        code += "\nimport torch.distributed as _d\nif _d.is_initialized():\n    _d.destroy_process_group()\n"
    script = tmp_path / f"{page.stem}_snippets.py"
    script.write_text(code)
    for name in ("profiles", "examples"):  # pages refer to these by relative path
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, str(script)]
    if distributed:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
        cmd.append(str(script))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


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
