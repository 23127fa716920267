"""Varlen attention backends on this machine: per-sequence SDPA vs one block-diagonal call.

    python benchmarks/attention_backends.py [--out runs/bench/attention_backends.json]

Forward + backward of packed batches with typical DiT mixes of lengths (8 heads of 64), median
of 5 runs; the ratio column is block-diagonal time / per-sequence time (> 1: per-sequence wins).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import print_table, write_json  # noqa: E402

from knapformer.attention import available_backends, varlen_attention  # noqa: E402

BATCHES = {
    "4x256": [256] * 4,
    "mixed 64..1024": [64, 128, 256, 512, 1024],
    "1x2048+8x64": [2048] + [64] * 8,
    "16x100": [100] * 16,
}


def time_backend(name, lens, causal, repeats=5):
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 8, 64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ts = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        varlen_attention(q, k, v, cu, max(lens), causal=causal, backend=name).sum().backward()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench/attention_backends.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    usable = [n for n, why in available_backends(torch.device("cpu")).items() if why is None]
    rows = []
    for batch, lens in BATCHES.items():
        for causal in (False, True):
            row = {"batch": batch, "causal": str(causal)}
            for n in usable:
                row[f"{n}_ms"] = time_backend(n, lens, causal)
            row["mask/per_seq"] = row["sdpa_mask_ms"] / row["sdpa_ms"]
            rows.append(row)
    print_table(
        rows, [("batch", "s"), ("causal", "s"), ("sdpa_ms", ".1f"), ("sdpa_mask_ms", ".1f"), ("mask/per_seq", ".2f")]
    )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
