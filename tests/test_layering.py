"""Layers import one way: planning never imports torch; importing knapformer touches no device."""

import subprocess
import sys

PURE = [
    "knapformer",
    "knapformer.workload",
    "knapformer.layout",
    "knapformer.plan",
    "knapformer.data",
    "knapformer.cli",
    "knapformer.model_configs",
    "knapformer.cluster",
    "knapformer.workload_fit",
    "knapformer.tools.cluster_cli",
]


def test_pure_layers_do_not_import_torch():
    code = (
        "import sys\n"
        f"for m in {PURE!r}: __import__(m)\n"
        "bad = [m for m in ('torch', 'torch.distributed', 'flash_attn', 'matplotlib', 'scipy') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"pure layers imported: {out.stdout.strip()}"


def test_models_and_attention_do_not_use_torch_distributed():
    """Models are single-device user code; attention backends are local; planning and the
    cluster model are numpy. Only distributed/, tools/, integrations/ and testing/ import
    torch.distributed."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "knapformer"
    dist_import = re.compile(r"^\s*(import|from)\s+torch\.distributed", re.M)
    torch_import = re.compile(r"^\s*(import|from)\s+torch\b", re.M)
    offenders = [
        str(p.relative_to(root))
        for sub in ("models", "attention")
        for p in (root / sub).rglob("*.py")
        if dist_import.search(p.read_text())
    ]
    pure = [*(root / "plan").rglob("*.py"), *(root / "cluster").rglob("*.py")]
    pure += [root / f for f in ("workload.py", "layout.py", "model_configs.py", "workload_fit.py")]
    offenders += [str(p.relative_to(root)) for p in pure if torch_import.search(p.read_text())]
    assert offenders == [], offenders
