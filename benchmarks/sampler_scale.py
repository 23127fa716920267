"""The token-budget sampler at dataset scale: 1M, 10M and 100M samples.

    python benchmarks/sampler_scale.py [--samples 1000000 10000000 100000000] [--baseline-ref REF]
        [--manifest-rows N] [--out runs/bench/sampler_scale.json]

Lengths lognormal (median ~1,100 tokens, clipped to 16–65,536), read from an int32
memory-mapped ``.npy`` file; buckets by length class (log2, an int8 memory-mapped file); a
65,536-token budget, 512 replicas, rank 3 (the setting of issue 60). Each size runs in a fresh
process: the sampler's construction, its first batch, the median time of the next 200 steps,
and the process's peak *anonymous* memory (``RssAnon``, sampled every 5 ms: what it allocates
beyond the mapped files, whose pages the processes of a node share). A process gets at most
``--timeout`` seconds (90). ``--baseline-ref`` measures the same on that commit's code first
(a ``git worktree``; before issue 60 the sampler dealt the whole epoch before its first batch).
``--manifest-rows N`` also writes a synthetic sharded manifest of N rows (1,000 shards,
``knapformer manifest --shards``), computes its Flux lengths and buckets into memory-mapped
files and samples it, timing each part. Writes JSON next to the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _peak_anon() -> tuple[threading.Event, dict]:
    """Poll this process's RssAnon every 5 ms; returns (stop event, {"peak_kb": ...})."""
    stop, out = threading.Event(), {"peak_kb": 0}

    def poll() -> None:
        while not stop.is_set():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        out["peak_kb"] = max(out["peak_kb"], int(line.split()[1]))
            time.sleep(0.005)

    threading.Thread(target=poll, daemon=True).start()
    return stop, out


def one(lengths_path: str, buckets_path: str, steps: int) -> dict:
    """One measurement in this process (the child's side)."""
    stop, mem = _peak_anon()
    from knapformer.data import TokenBudgetBatchSampler

    lengths = np.load(lengths_path, mmap_mode="r")
    buckets = np.load(buckets_path, mmap_mode="r")
    t0 = time.perf_counter()
    sampler = TokenBudgetBatchSampler(lengths, 65_536, buckets=buckets, num_replicas=512, rank=3, seed=0)
    t1 = time.perf_counter()
    it = iter(sampler)
    first = next(it)
    t2 = time.perf_counter()
    per = []
    for _ in range(steps):
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        per.append(time.perf_counter() - t)
    stop.set()
    time.sleep(0.01)
    per.sort()
    return {
        "construct_s": t1 - t0,
        "first_batch_s": t2 - t1,
        "step_ms_median": 1e3 * per[len(per) // 2] if per else None,
        "step_ms_mean": 1e3 * sum(per) / len(per) if per else None,
        "step_ms_max": 1e3 * per[-1] if per else None,
        "peak_anon_gb": mem["peak_kb"] / 2**20,
        "first_batch_samples": len(first),
        "windowed": bool(getattr(sampler, "windowed", False)),
    }


def _lengths_files(n: int, folder: Path) -> tuple[str, str]:
    """The int32 lengths and int8 buckets of ``n`` samples, written in chunks."""
    lp, bp = folder / f"lengths-{n}.npy", folder / f"buckets-{n}.npy"
    if not lp.exists():
        lens = np.lib.format.open_memmap(lp, mode="w+", dtype=np.int32, shape=(n,))
        buck = np.lib.format.open_memmap(bp, mode="w+", dtype=np.int8, shape=(n,))
        rng = np.random.default_rng(n)
        for lo in range(0, n, 1 << 22):
            k = min(1 << 22, n - lo)
            chunk = np.clip(rng.lognormal(7.0, 1.2, k), 16, 65_536).astype(np.int32)
            lens[lo : lo + k] = chunk
            buck[lo : lo + k] = np.floor(np.log2(chunk)).astype(np.int8)
        lens.flush()
        buck.flush()
        del lens, buck
    return str(lp), str(bp)


def _run_child(lp: str, bp: str, steps: int, timeout: float, pythonpath: str | None, cwd: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, str(HERE / "sampler_scale.py"), "--one", lp, bp, "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"no first batch within {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _manifest(rows: int, folder: Path) -> dict:
    """Write a sharded manifest of ``rows`` rows, its Flux lengths, and sample it (timed)."""
    stop, mem = _peak_anon()
    from knapformer.data import ShardedManifest, TokenBudgetBatchSampler, tokenizer_for_model, write_sharded_manifest

    root = folder / f"manifest-{rows}"
    t0 = time.perf_counter()
    if not (root / "index.json").exists():
        write_sharded_manifest(root, "realistic", rows, shards=1000, seed=0)
    t1 = time.perf_counter()
    sm = ShardedManifest(root)
    lens, buckets = sm.seq_lens(tokenizer_for_model("diffusers-flux-dev"))
    t2 = time.perf_counter()
    sampler = TokenBudgetBatchSampler(lens, 65_536, buckets=buckets, num_replicas=512, rank=3, oversize="alone")
    first = next(iter(sampler))
    t3 = time.perf_counter()
    stop.set()
    return {
        "rows": rows,
        "write_s": t1 - t0,
        "lengths_s": t2 - t1,
        "first_batch_s": t3 - t2,
        "first_batch_samples": len(first),
        "peak_anon_gb": mem["peak_kb"] / 2**20,
        "disk_gb": sum(p.stat().st_size for p in root.iterdir()) / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--baseline-ref", default=None)
    p.add_argument("--manifest-rows", type=int, default=0)
    p.add_argument("--folder", default=None, help="where the length files go (default: a temporary folder)")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="runs/bench/sampler_scale.json")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        files = {n: _lengths_files(n, folder) for n in args.samples}
        codes = [("after", None, None)]
        tree = None
        if args.baseline_ref:
            tree = Path(tmp) / "baseline"
            subprocess.run(
                ["git", "-C", str(HERE.parent), "worktree", "add", "--detach", str(tree), args.baseline_ref], check=True
            )
            codes.insert(0, (f"before ({args.baseline_ref})", str(tree), str(tree)))
        rows = []
        try:
            for code, pythonpath, cwd in codes:
                for n in args.samples:
                    r = _run_child(*files[n], args.steps, args.timeout, pythonpath, cwd)
                    rows.append({"code": code, "samples": n, **r})
                    print(rows[-1], flush=True)
        finally:
            if tree is not None:
                subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(tree)], check=False)
        manifest = _manifest(args.manifest_rows, folder) if args.manifest_rows else None
    from _common import print_table, write_json

    cols = [
        ("code", "s"),
        ("samples", "d"),
        ("construct_s", ".2f"),
        ("first_batch_s", ".2f"),
        ("step_ms_median", ".3f"),
        ("step_ms_mean", ".2f"),
        ("step_ms_max", ".1f"),
        ("peak_anon_gb", ".3f"),
        ("error", "s"),
    ]
    print()
    print_table(rows, cols)
    if manifest:
        print(f"\nsharded manifest: {manifest}")
    write_json(args.out, rows, manifest=manifest, args=vars(args))


if __name__ == "__main__":
    main()
