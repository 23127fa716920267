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
