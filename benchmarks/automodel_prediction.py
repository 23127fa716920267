"""Predicted gain of knapformer over NeMo Automodel's fixed ``cp_size`` on a mixed image + clip
manifest (docs/automodel.md), from ``knapformer cluster --manifest``.

    python benchmarks/automodel_prediction.py [--gpus 64] [--manifest examples/manifests/realistic.csv]
        [--models diffusers-wan-14b diffusers-hunyuanvideo15-8.3b] [--out runs/bench/automodel_prediction.json]

Data: ``examples/manifests/realistic.csv`` (5,000 samples: 90% images 256²–2,048², 10% clips of
33–161 frames at 16 fps; written by ``knapformer manifest --mix realistic``), tokenized by each
model family's preset. Hardware: the ``h100`` preset (8 GPUs per node, 450 GB/s inside, 50
GB/s across, 50% of peak).

Automodel with ``fsdp.cp_size = c`` loads one batch per data-parallel group of c GPUs and splits
every sample of it (images too) over the c GPUs with Ulysses: modelled as ``--loaders GPUS/c
--bags g<c>n<GPUS/c>`` with c × 65,536 tokens per loader. Its loaders batch one resolution
bucket at a time with a fixed sample count; the model's sampler approximates that with a token
budget and one latent shape per batch (``buckets``). knapformer: every GPU loads 65,536 tokens
(``TokenBudgetDataloaderConfig``), with one shape per batch or any shapes mixed (``mixed``:
what Automodel's issue #3245 asks for), planned with ``auto``. Steps hold different numbers of
tokens, so rows compare tokens per second; ``vs best cp`` = a row's tokens/s ÷ the best fixed
``cp_size``'s. Predictions of the cluster model, not GPU measurements; the model prices a
small image split over 8 GPUs by its FLOPs and exchanges, not by small-kernel inefficiency.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

BUDGET = 65536


def _cluster(manifest: str, gpus: int, model: str, *extra: str) -> dict:
    """The requested layout's row over every whole step of the manifest's first epoch (the
    CLI says how many there are when asked for too many)."""
    cmd = [sys.executable, "-m", "knapformer", "cluster", "--manifest", manifest, "--gpus", str(gpus)]
    cmd += ["--model", model, "--quiet", "--json", "--no-static", *extra]
    probe = subprocess.run([*cmd, "--steps", "1000000"], capture_output=True, text=True)
    found = re.search(r"fill (\d+) whole step", probe.stderr)
    if found is None:
        raise RuntimeError(f"cannot count the steps: {probe.stderr[-500:]}")
    out = subprocess.run([*cmd, "--steps", found[1]], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"][-1]  # rows: none, then the requested layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--manifest", default="examples/manifests/realistic.csv")
    ap.add_argument("--models", nargs="+", default=["diffusers-wan-14b", "diffusers-hunyuanvideo15-8.3b"])
    ap.add_argument("--out", default="runs/bench/automodel_prediction.json")
    args = ap.parse_args()
    rows = []
    for model in args.models:
        runs, fixed = [], {}
        for cp in (1, 2, 4, 8):
            loaders = ["--loaders", str(args.gpus // cp), "--budget", str(BUDGET * cp)]
            fixed[cp] = loaders
            runs.append(
                (
                    f"Automodel cp_size={cp}",
                    _cluster(args.manifest, args.gpus, model, "--bags", f"g{cp}n{args.gpus // cp}", *loaders),
                )
            )
        best_cp, best = max(((int(n.split("=")[1]), r) for n, r in runs), key=lambda x: x[1]["hfu"])
        same = _cluster(args.manifest, args.gpus, model, "--bags", "auto", *fixed[best_cp])
        runs.append((f"auto, cp_size={best_cp}'s batches", same))
        for name, extra in (("auto, own loader, buckets", []), ("auto, own loader, mixed", ["--no-buckets"])):
            runs.append((name, _cluster(args.manifest, args.gpus, model, "--bags", "auto", *extra)))
        for name, r in runs:
            same_steps = name.startswith("auto, cp_size")
            rows.append(
                {
                    "model": model,
                    "setup": name,
                    "steps": len(r["step_times"]),
                    "epoch_s": round(sum(r["step_times"]), 1),
                    "hfu": round(r["hfu"], 3),
                    "comm": round(r["comm_share"], 3),
                    "max_tok": r["max_tokens"],
                    # same batches: step time ratio; other loaders: throughput (HFU) ratio
                    "gain": round(
                        sum(best["step_times"]) / sum(r["step_times"]) if same_steps else r["hfu"] / best["hfu"], 3
                    ),
                }
            )
    cols = [
        ("model", "<30"),
        ("setup", "<30"),
        ("steps", "d"),
        ("epoch_s", ".1f"),
        ("hfu", ".3f"),
        ("comm", ".3f"),
        ("max_tok", "d"),
        ("gain", ".3f"),
    ]
    print(f"{args.gpus} x H100 (h100 preset), every whole step of epoch 0 of {args.manifest}; predictions")
    print("gain: vs the best fixed cp_size (same batches: its epoch time / the row's; other loaders: HFU / its HFU)")
    print_table(rows, cols)
    write_json(args.out, rows, gpus=args.gpus, manifest=args.manifest)


if __name__ == "__main__":
    main()
