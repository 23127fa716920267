"""One prepared accelerator check: what is installed, the executor's exchanges on CUDA tensors,
CUDA attention backends, a measured Flux-block profile, the cluster model from it, and ring
attention's block kernels — what CI, which has no GPU, cannot run.

    PYTHONPATH=. python benchmarks/accelerator_check.py --out DIR   # the GPU machine: one command, ≤ 6 min
    python benchmarks/accelerator_check.py --smoke                   # on CPU, under a minute (CI runs it)

Parts run in the order given (``--parts``, default 0, 2, 1, 3, 4, 6, 7, 8: the new executor
part first); a part that would start after ``--budget-s`` (330 s) is skipped and says so.

Writes ``runs/accelerator/check.json`` and ``check.txt`` (``--smoke``: ``runs/accelerator/smoke/``),
and for part 3 ``<gpu>-flux.json`` + PNG, all in the output folder. Each part reports ``ok``, ``failed`` (with
the error) or ``skipped`` (with the reason, e.g. no CUDA); one failing part does not stop the
others. Uses whatever torch is installed (CUDA or CPU): run it from the working tree with
``PYTHONPATH=.`` — it needs numpy and matplotlib; diffusers is not used.

Parts:
0. preflight (seconds): torch, CUDA, the GPU, NCCL and flash-attn versions;
1. attention backends vs the per-sequence reference (bf16 and fp32, causal and not, GQA) and
   timed on DiT-typical packed batches; the fastest measured backend is reported per batch;
2. the executor on CUDA tensors (``benchmarks/accel_executor.py``): 2 and 4 gloo ranks sharing
   the GPU run route, Ulysses, ring rounds, the K/V gather of ``pre_attn``, cross-attention, an
   empty rank and ``measure=True``, against one-process math, with knapformer's host reads
   counted per phase (layers after the first: none) and the bytes each rank routed; then one
   NCCL rank runs plan, route, layers and the CUDA-event timer under CUDA's sync debug mode;
3. ``knapformer calibrate`` of the ``flux`` preset's double and single blocks (bf16 on CUDA);
4. ``knapformer cluster`` for paper-mixres and paper-joint at 32 and 1,024 GPUs from that
   profile, next to the paper's 32-H100 g8n4 figures (8.05 s -> 3.44 s);
(5, an 8-rank simulation on CPU cores, is dropped: CPU-only work does not need the GPU's time);
6. ring attention's block math on the device: a sequence cut into r contiguous blocks
   (r = 2, 4; causal and not; GQA), each block pair run and merged by log-sum-exp as a ring
   rank would, forward and backward against whole-sequence attention (fp64 exact, bf16
   close), and the blocks' time next to SDPA on the whole sequence (what the tiled GPU
   fallback costs; CPU ranks use PyTorch's fused kernel instead);
7. ring attention's block kernels (``knapformer.attention.lse``): each kernel's probe verdict
   on the device (bf16, 24 heads of 128), agreement with the tiled reference, and one ring
   rank's block work (L/4 queries against 4 blocks, forward + backward) timed with its peak
   memory for L = 8k, 32k, 128k — fused kernels vs the tiled path vs SDPA in one call;
8. the ``pre_attn`` path's kernel call on ring plans (``knapformer.attention.varlen_attention_qk``,
   what a custom kernel gets after the K/V all-gather): one ring member's zigzag block of a
   sequence (r = 4; causal: two query runs over their key prefixes, bottom-right masks; not
   causal: the block over all keys) against whole-sequence attention (every backend the
   device runs: flash-attn's causal alignment is the point), then timed forward + backward
   with its peak memory next to part 7's ring block work, L = 8k, 32k, 128k.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PAPER_32_H100_G8N4 = {"none_s": 8.05, "g8n4_s": 3.44, "speedup": 8.05 / 3.44}
"""KnapFormer paper: Flux, paper-joint, 32 H100s, step time without and with g8n4 balancing."""
MIXRES_8 = "g4b4i256f1s0,g1b5i512f1s0,g1b5i1024f1s0,g2b1i2048f1s0"
"""paper-mixres (16:4:4:8 ranks of 4×256², 5×512², 5×1024², 1×2048²) at 8 ranks (4:1:1:2)."""


class Skip(Exception):
    """A part that cannot run here (the message says why)."""


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` warm calls (CUDA events on GPU)."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _torch_varlen():
    """torch's own varlen attention, where this torch has it (else None)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10
    except Exception:
        return None

    import inspect

    try:  # the causal flag's name differs between releases (torch 2.11: not is_causal)
        params = set(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        params = set()
    flag = next((n for n in ("is_causal", "causal") if n in params), None)

    def run(q, k, v, cu, max_len, *, causal):
        if flag is None:
            if causal:
                raise TypeError("this torch's varlen_attn names no causal flag")
            return varlen_attn(q, k, v, cu, cu, max_len, max_len)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **{flag: causal})

    return run


# -- part 1 -------------------------------------------------------------------------------------------
def part_attention(smoke: bool) -> dict:
    from knapformer.attention import BACKENDS, available_backends, get_backend
    from knapformer.testing import reference_attention

    device = torch.device("cpu") if smoke else _cuda()
    usable = {n: get_backend(n).attend for n in BACKENDS if available_backends(device)[n] is None}
    reasons = {n: r for n, r in available_backends(device).items() if r}
    tv = _torch_varlen()
    if tv is not None and device.type == "cuda":
        usable["torch_varlen"] = tv
    else:
        reasons["torch_varlen"] = "this torch has no torch.nn.attention.varlen" if tv is None else "needs CUDA"
    conformance = []
    lens = [5, 1, 17, 64]
    for dtype in (torch.float32,) if smoke else (torch.bfloat16, torch.float32):
        for causal in (False, True):
            for h, h_kv in ((8, 8), (8, 2)):
                g = torch.Generator().manual_seed(0)
                q = torch.randn(sum(lens), h, 64, generator=g).to(device, dtype)
                k = torch.randn(sum(lens), h_kv, 64, generator=g).to(device, dtype)
                v = torch.randn(sum(lens), h_kv, 64, generator=g).to(device, dtype)
                ref = reference_attention(q.double(), k.double(), v.double(), lens, causal=causal)
                for name, fn in usable.items():
                    row = {"backend": name, "dtype": str(dtype)[6:], "causal": causal, "heads": f"{h}/{h_kv}"}
                    try:
                        out = fn(q, k, v, _cu(lens, device), max(lens), causal=causal)
                        row["max_err"] = float((out.double() - ref).abs().max())
                        row["ok"] = row["max_err"] < (3e-2 if dtype == torch.bfloat16 else 1e-4)
                    except Exception as exc:  # a backend without GQA, or a dtype it refuses
                        row["error"], row["ok"] = f"{type(exc).__name__}: {exc}"[:200], False
                    conformance.append(row)
    batches = (
        {"4 x 64": [64] * 4, "1 x 256": [256]}
        if smoke
        else {
            "64 x 1024": [1024] * 64,
            "4 x 16k": [16384] * 4,
            "1 x 64k": [65536],
        }
    )
    dtype = torch.float32 if smoke else torch.bfloat16
    timing = {}
    for label, bl in batches.items():
        q = torch.randn(sum(bl), 24, 128, device=device, dtype=dtype)
        row = {}
        for name, fn in usable.items():
            if name == "sdpa_mask" and sum(bl) > 16384:
                row[name] = None  # an N×N mask of 64k tokens is 4 GB: not a contender
                continue
            try:
                row[name] = _time(
                    lambda fn=fn, q=q, bl=bl: fn(q, q, q, _cu(bl, device), max(bl), causal=False), 3, device
                )
            except Exception as exc:
                row[name] = f"{type(exc).__name__}: {exc}"[:120]
        timed = {n: t for n, t in row.items() if isinstance(t, float)}
        timing[label] = {"seconds": row, "fastest": min(timed, key=timed.get) if timed else None}
    ok = all(r["ok"] for r in conformance if r["backend"] != "torch_varlen")
    return {
        "status": "ok" if ok else "failed",
        "device": str(device),
        "skipped_backends": reasons,
        "conformance": conformance,
        "timing": timing,
    }


# -- part 2 -------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_executor(smoke: bool) -> dict:
    """Part 2: the balancer's exchanges on CUDA tensors (benchmarks/accel_executor.py): 2 and 4
    gloo ranks sharing the GPU, then one NCCL rank for plan and the timer."""
    import accel_executor as ex  # beside this file

    out = {"multi_rank": ex.part_multi_rank(smoke), "nccl_rank": ex.part_nccl_rank(smoke, _free_port())}
    states = [out["multi_rank"]["status"], out["nccl_rank"]["status"]]
    out["status"] = "failed" if "failed" in states else "ok"
    return out


# -- parts 3-5: the project's own tools --------------------------------------------------------------
def _cli(argv: list[str]) -> tuple[int, str]:
    from knapformer.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def _gpu_name() -> str:
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    for key in ("h200", "h100", "a100", "l40", "b200"):
        if key in name:
            return key
    return name.replace(" ", "-")


def part_calibrate(smoke: bool, out_dir: Path) -> dict:
    if smoke:
        model, device, profile = "mmdit-tiny", "cpu", out_dir / "cpu-mmdit-tiny.json"
        lengths, holdout, repeats = ["16", "64", "128"], ["32"], "1"
    else:
        _cuda()
        model, device, profile = "flux", "cuda", out_dir / f"{_gpu_name()}-flux.json"  # everything under --out
        lengths = ["256", "1024", "2048", "4096", "8192", "16384", "32768"]
        holdout, repeats = ["512", "12288"], "3"
    args = ["calibrate", "--model", model, "--device", device, "--lengths", *lengths, "--holdout", *holdout]
    args += ["--repeats", repeats, "--output", str(profile), "--plot", str(profile.with_suffix(".png")), "--quiet"]
    rc, text = _cli(args)
    if rc != 0:
        return {"status": "failed", "error": text[-500:]}
    prof = json.loads(profile.read_text())
    return {
        "status": "ok",
        "profile": str(profile.relative_to(ROOT) if profile.is_relative_to(ROOT) else profile),
        "gamma_equivalent": prof.get("gamma_equivalent"),
        "fit_quality": prof["meta"].get("fit_quality"),
        "table": text.strip().splitlines()[-4:],
    }


def part_cluster(smoke: bool, profile: str | None) -> dict:
    if profile is None:
        raise Skip("no measured profile (part 3 did not run)")
    model = "mmdit-tiny" if smoke else "flux"
    hw = "cpu-gloo" if smoke else _gpu_name() if _gpu_name() in ("h100", "h200", "a100") else "h100"
    rows = []
    runs = (
        [("paper-mixres", 32), ("paper-joint", 32)]
        if smoke
        else [("paper-mixres", 32), ("paper-mixres", 1024), ("paper-joint", 32), ("paper-joint", 1024)]
    )
    for mix, gpus in runs:
        for bags in ("auto", f"g2n{gpus // 2}" if smoke else f"g8n{gpus // 8}"):
            argv = [
                "cluster",
                "--mix",
                mix,
                "--gpus",
                str(gpus),
                "--model",
                model,
                "--hardware",
                hw,
                "--bags",
                bags,
                "--compute-profile",
                str(ROOT / profile if not Path(profile).is_absolute() else profile),
                "--steps",
                "2" if smoke else "4",
                "--json",
                "--quiet",
            ]
            rc, text = _cli(argv)
            if rc != 0:
                rows.append({"mix": mix, "gpus": gpus, "bags": bags, "error": text[-300:]})
                continue
            d = json.loads(text)
            none = next(r for r in d["rows"] if r["bags"] == "none")
            rows.append(
                {
                    "mix": mix,
                    "gpus": gpus,
                    "bags": bags,
                    "none_s": none["step_s"],
                    "balanced_s": d["best"]["step_s"],
                    "speedup": d["best"]["speedup"],
                    "hfu": d["best"]["hfu"],
                }
            )
    ok = all("error" not in r for r in rows)
    return {"status": "ok" if ok else "failed", "hardware": hw, "rows": rows, "paper_32_h100_g8n4": PAPER_32_H100_G8N4}


# -- driver -------------------------------------------------------------------------------------------
# -- part 6 -------------------------------------------------------------------------------------------
def _ring_by_blocks(q, k, v, do, r: int, causal: bool):
    """Output and (dq, dk, dv) of whole-sequence attention computed as r ring ranks would:
    each query block against every key/value block (merged by log-sum-exp), then the
    backward of each pair from the final log-sum-exp."""
    from knapformer.attention import blockwise as B

    L, h = q.shape[0], q.shape[1]
    cuts = [L * i // r for i in range(r + 1)]
    pos = [torch.arange(cuts[i], cuts[i + 1], device=q.device) for i in range(r)]
    dt = B.compute_dtype(q)
    outs, dq = [], torch.zeros(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=q.device)
    dv = torch.zeros(v.shape, dtype=dt, device=q.device)
    for qp in pos:
        o = torch.zeros(len(qp), h, v.shape[2], dtype=dt, device=q.device)
        lse = torch.full((h, len(qp)), float("-inf"), dtype=dt, device=q.device)
        for kp in pos:
            if causal and kp[0] > qp[-1]:
                continue  # a later block: nothing to see
            ob, lb = B.block_forward(q[qp], k[kp], v[kp], qp, kp, causal=causal)
            o, lse = B.merge(o, lse, ob, lb)
        delta = (do[qp].to(dt) * o).sum(-1).transpose(0, 1)
        for kp in pos:
            if causal and kp[0] > qp[-1]:
                continue
            a, b, c = B.block_backward(
                q[qp], k[kp], v[kp], do[qp], lse, delta, qp, kp, causal=causal, keep_precision=True
            )
            dq[qp] += a
            dk[kp] += b
            dv[kp] += c
        outs.append(o)
    return torch.cat(outs), (dq, dk, dv)


def part_ring(smoke: bool) -> dict:
    from knapformer.testing import reference_attention

    device = torch.device("cpu") if smoke else _cuda()
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    worst = {"fp64": 0.0, "bf16": 0.0}
    for dtype, L in ((torch.float64, 300 if smoke else 2048), (torch.bfloat16, 256 if smoke else 4096)):
        for r in (2, 4):
            for causal in (False, True):
                for h, hk in ((4, 4), (4, 2)):
                    q = torch.randn(L, h, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
                    k = torch.randn(L, hk, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
                    v = torch.randn(L, hk, 64, device=device, dtype=dtype, generator=g, requires_grad=True)
                    ref = reference_attention(q.double(), k.double(), v.double(), [L], causal=causal)
                    do = torch.randn(ref.shape, device=device, dtype=dtype, generator=g)
                    grads = torch.autograd.grad(ref, (q, k, v), do.double())
                    o, mine = _ring_by_blocks(q.detach(), k.detach(), v.detach(), do, r, causal)
                    scale = max(float(ref.detach().abs().max()), 1e-30)
                    err = float((o.double() - ref.detach()).abs().max()) / scale
                    for a, b in zip(mine, grads):
                        err = max(err, float((a.double() - b.double()).abs().max()) / max(float(b.abs().max()), 1e-30))
                    key = "fp64" if dtype == torch.float64 else "bf16"
                    worst[key] = max(worst[key], err)
                    rows.append({"dtype": key, "L": L, "r": r, "causal": causal, "heads": f"{h}/{hk}", "rel_err": err})
    timing = {}
    if not smoke:
        import torch.nn.functional as F

        for L in (8192, 32768):
            q, k, v = (torch.randn(L, 24, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
            do = torch.randn_like(q)
            whole = _time(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
                ),
                5,
                device,
            )
            blocks = _time(lambda q=q, k=k, v=v, do=do: _ring_by_blocks(q, k, v, do, 4, False), 3, device)
            timing[str(L)] = {"sdpa_forward_s": whole, "ring_blocks_forward_backward_s": blocks}
    ok = worst["fp64"] <= 1e-9 and worst["bf16"] <= 5e-2
    return {"status": "ok" if ok else "failed", "worst_rel_err": worst, "rows": rows, "timing": timing}


# -- part 7 -------------------------------------------------------------------------------------------
def _one_rank_blocks(kernel, q, k, v, do, r: int):
    """One ring rank's block work for a sequence of r blocks: its query block (q) against the r
    key/value blocks of k, v (forward, merged by log-sum-exp), then the backward of each pair
    against the final output and log-sum-exp."""
    from knapformer.attention import blockwise as B

    n = k.shape[0] // r
    dt = B.compute_dtype(q)
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dt, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dt, device=q.device)
    for j in range(r):
        ob, lb = kernel.forward(q, k[j * n : (j + 1) * n], v[j * n : (j + 1) * n], False)
        o, lse = B.merge(o, lse, ob, lb)
    grads = [kernel.backward(do, q, k[j * n : (j + 1) * n], v[j * n : (j + 1) * n], o, lse, False) for j in range(r)]
    dq = sum(g[0] for g in grads)
    return o, dq, torch.cat([g[1] for g in grads]), torch.cat([g[2] for g in grads])


def _peak(fn, device) -> float | None:
    """Peak GiB allocated above the start while ``fn`` runs (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**30


def part_ring_kernels(smoke: bool) -> dict:
    """Ring attention's block kernels (``knapformer.attention.lse``) on the device: which pass
    their probe, their agreement with the tiled reference, and one ring rank's block work
    (r = 4 blocks: L/4 queries against 4 key/value blocks, forward + backward, bf16, 24 heads of
    128) timed with its peak memory, next to SDPA doing the same attention in one call."""
    import torch.nn.functional as F

    from knapformer.attention import lse as K

    device = torch.device("cpu") if smoke else _cuda()
    dtype = torch.float32 if smoke else torch.bfloat16
    h, d = (4, 32) if smoke else (24, 128)
    names = list(K.KERNELS)
    report = K.kernel_report(tuple(names), device.type, dtype, d, d)
    usable = [n for n in names if report[n] is None]
    g = torch.Generator(device=device).manual_seed(0)
    rows, agreement = [], {}
    lens = (512,) if smoke else (8192, 32768, 131072)
    for L in lens:
        q = torch.randn(L // 4, h, d, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(L, h, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        do = torch.randn_like(q)
        ref = None
        for name in usable:
            if name == "tiled" and L > 32768:
                rows.append({"L": L, "kernel": name, "skipped": "tiled above 32k tokens: minutes per call"})
                continue
            kern = K.KERNELS[name]
            try:
                out = _one_rank_blocks(kern, q, k, v, do, 4)
                if name == "tiled" or ref is None:
                    ref = ref if ref is not None else (name, out)
                if ref[0] != name:
                    err = max(
                        float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)
                        for a, b in zip(out, ref[1])
                    )
                    agreement[f"{name} vs {ref[0]} L={L}"] = err
                work = functools.partial(_one_rank_blocks, kern, q, k, v, do, 4)
                secs = _time(work, 3, device)
                rows.append({"L": L, "kernel": name, "seconds": secs, "peak_gib": _peak(work, device)})
            except Exception as exc:  # e.g. out of memory at 128k on the tiled path
                rows.append({"L": L, "kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
        qs, ks, vs = (t.transpose(0, 1)[None].detach().requires_grad_() for t in (q, k, v))

        def sdpa(qs=qs, ks=ks, vs=vs, do=do):
            out = F.scaled_dot_product_attention(qs, ks, vs)
            out.backward(do.transpose(0, 1)[None])

        rows.append(
            {"L": L, "kernel": "sdpa (one call)", "seconds": _time(sdpa, 3, device), "peak_gib": _peak(sdpa, device)}
        )
    worst = max(agreement.values(), default=0.0)
    ok = worst <= (1e-4 if dtype == torch.float32 else 5e-2) and any(r.get("seconds") for r in rows)
    return {
        "status": "ok" if ok else "failed",
        "probe": report,
        "usable": usable,
        "agreement": agreement,
        "worst_rel_err": worst,
        "rows": rows,
    }


# -- part 8 -------------------------------------------------------------------------------------------
def _zigzag_member(L: int, r: int, s: int, causal: bool):
    """Member s of a ring of r on a sequence of L: its query rows (positions, zigzag half-blocks s
    and 2r − 1 − s) and the (query run, key prefix) segments the pre_attn path lays out."""
    h = L // (2 * r)
    runs = [(s * h, h), ((2 * r - 1 - s) * h, h)]
    rows = torch.cat([torch.arange(a, a + n) for a, n in runs])
    if not causal:
        return rows, [(rows.numel(), L)], [torch.arange(L)]
    return rows, [(n, a + n) for a, n in runs], [torch.arange(a + n) for a, n in runs]


def part_gather_kernel(smoke: bool) -> dict:
    """The pre_attn path's one kernel call on a ring member's block (module docstring)."""
    import torch.nn.functional as F

    from knapformer.attention import available_backends, varlen_attention_qk

    device = torch.device("cpu") if smoke else _cuda()
    dtype = torch.float32 if smoke else torch.bfloat16
    h, d, r = (4, 32, 4) if smoke else (24, 128, 4)
    backends = [n for n, why in available_backends(device).items() if why is None and n != "sdpa_mask"]
    g = torch.Generator(device=device).manual_seed(0)
    rows, errors = [], {}
    for L in (512,) if smoke else (8192, 32768, 131072):
        q, k, v = (torch.randn(L, h, d, device=device, dtype=dtype, generator=g) for _ in range(3))
        for causal in (False, True):
            member, segs, keys = _zigzag_member(L, r, r - 2, causal)
            key_rows = torch.cat(keys).to(device)
            qs, ks, vs = q[member.to(device)], k[key_rows], v[key_rows]
            cu_q = torch.tensor([0, *torch.tensor([a for a, _ in segs]).cumsum(0).tolist()], dtype=torch.int32)
            cu_k = torch.tensor([0, *torch.tensor([b for _, b in segs]).cumsum(0).tolist()], dtype=torch.int32)
            args = (cu_q.to(device), cu_k.to(device), max(a for a, _ in segs), max(b for _, b in segs))
            if L <= 32768:  # the whole sequence's attention, rows of this member
                full = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=causal)
                ref = full[0].transpose(0, 1)[member.to(device)].float()
            for name in backends:
                out = varlen_attention_qk(qs, ks, vs, *args, causal=causal, backend=name)
                if L <= 32768:
                    errors[f"{name} L={L} causal={causal}"] = float((out.float() - ref).abs().max() / ref.abs().max())
                qg, kg, vg = (t.detach().requires_grad_() for t in (qs, ks, vs))

                def work(qg=qg, kg=kg, vg=vg, name=name, causal=causal, args=args):
                    varlen_attention_qk(qg, kg, vg, *args, causal=causal, backend=name).sum().backward()

                rows.append(
                    {
                        "L": L,
                        "causal": causal,
                        "backend": name,
                        "key_rows": int(key_rows.numel()),
                        "seconds": _time(work, 3, device),
                        "peak_gib": _peak(work, device),
                    }
                )
    worst = max(errors.values(), default=0.0)
    ok = bool(errors) and worst <= (1e-4 if dtype == torch.float32 else 5e-2)
    return {"status": "ok" if ok else "failed", "backends": backends, "rel_err": errors, "worst": worst, "rows": rows}


def preflight() -> dict:
    """What is installed (a few seconds): torch, CUDA, the GPU, NCCL, flash-attn, knapformer."""
    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as exc:  # a torch built without NCCL
        info["nccl"] = f"unavailable: {exc}"
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except Exception as exc:
        info["flash_attn"] = f"not importable ({type(exc).__name__})"
    import knapformer

    info["knapformer"] = getattr(knapformer, "__version__", "?")
    info["status"] = "ok"
    return info


def _run(name: str, fn, results: dict, deadline: float | None = None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        results[name] = {"status": "skipped", "reason": "the check's time budget is spent", "seconds": 0.0}
        print(f"[skipped] {name} (budget)", flush=True)
        return
    t = time.perf_counter()
    try:
        results[name] = fn()
    except Skip as exc:
        results[name] = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:
        results[name] = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-2000:],
        }
    results[name]["seconds"] = round(time.perf_counter() - t, 2)
    print(f"[{results[name]['status']:>7}] {name} ({results[name]['seconds']} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, CUDA parts skipped (CI)")
    p.add_argument("--out", default=None, help="output folder (default runs/accelerator[/smoke])")
    p.add_argument("--parts", default="0,2,1,3,4,6,7,8", help="comma-separated part numbers, in order (0: preflight)")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip parts that would start after this many seconds")
    p.add_argument("--profile", default=None, help="a profile measured before: part 4 uses it without part 3")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    out_dir = Path(args.out) if args.out else ROOT / "runs" / "accelerator" / ("smoke" if args.smoke else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    order = [int(x) for x in args.parts.split(",")]
    results: dict = {}
    smoke = args.smoke
    runs = {
        0: ("0 preflight", preflight),
        1: ("1 attention backends", lambda: part_attention(smoke)),
        2: ("2 executor on the device (gloo ranks sharing it; one NCCL rank)", lambda: part_executor(smoke)),
        3: ("3 calibrate blocks", lambda: part_calibrate(smoke, out_dir)),
        4: (
            "4 cluster from the profile",
            lambda: part_cluster(smoke, results.get("3 calibrate blocks", {}).get("profile") or args.profile),
        ),
        6: ("6 ring block math", lambda: part_ring(smoke)),
        7: ("7 ring block kernels", lambda: part_ring_kernels(smoke)),
        8: ("8 pre_attn kernel on ring blocks", lambda: part_gather_kernel(smoke)),
    }
    for part in order:
        if part not in runs:
            raise SystemExit(f"unknown part {part}; choose from {sorted(runs)} (part 5 ran CPU ranks: dropped)")
        name, fn = runs[part]
        _run(name, fn, results, deadline)
    meta = {
        "smoke": smoke,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    report = {"meta": meta, "parts": results}
    (out_dir / "check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = [f"accelerator check  smoke={smoke}  torch {meta['torch']}  device {meta['device']}"]
    for name, r in results.items():
        why = r.get("reason") or r.get("error") or ""
        lines.append(f"  {name:34s} {r['status']:8s} {r['seconds']:7.1f} s  {why[:80]}")
    t1 = results.get("1 attention backends", {}).get("timing", {})
    for label, row in t1.items():
        secs = ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in row["seconds"].items() if isinstance(v, float))
        lines.append(f"    attention {label}: {secs} -> fastest {row['fastest']}")
    for r in results.get("4 cluster from the profile", {}).get("rows", []):
        if "error" not in r:
            lines.append(
                f"    cluster {r['mix']} {r['gpus']} GPUs {r['bags']}: {r['none_s']:.2f} s -> "
                f"{r['balanced_s']:.2f} s ({r['speedup']:.2f}x)"
            )
    pre = results.get("0 preflight", {})
    if pre:
        lines.append(
            f"    preflight: torch {pre.get('torch')}, CUDA {pre.get('cuda')}, {pre.get('gpu')}, "
            f"NCCL {pre.get('nccl')}, flash-attn {pre.get('flash_attn')}"
        )
    p2 = results.get("2 executor on the device (gloo ranks sharing it; one NCCL rank)", {})
    for world, w in p2.get("multi_rank", {}).get("worlds", {}).items():
        for name, c in w["cases"].items():
            lines.append(
                f"    {world} ranks on {w['device']} {name}: err {c['worst_err']:.1e}, syncs in layers 2+ "
                f"{c['syncs_layers_after_first']}, ranks with data {c['ranks_with_data']}, measured own work "
                f"{[None if m is None else [round(x * 1e3, 1) for x in m] for m in c['measured_s']][:1]} ms, "
                f"wall {[round(x * 1e3, 1) for x in c['median_wall_s']]} ms"
            )
    nccl = p2.get("nccl_rank", {})
    if nccl.get("syncs_per_phase"):
        lines.append(f"    NCCL rank syncs per phase (warm): {nccl['syncs_per_phase'].get('step 3')}")
        lines.append(f"    NCCL rank measured seconds (CUDA events, a step late): {nccl.get('measured_s')}")
    gk = results.get("8 pre_attn kernel on ring blocks", {})
    if "worst" in gk:
        names = ", ".join(gk["backends"])
        lines.append(f"    pre_attn on ring blocks: worst relative error {gk['worst']:.1e} ({names})")
        for r in gk["rows"]:
            peak = f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
            lines.append(
                f"    pre_attn L={r['L']} causal={r['causal']} {r['backend']}: {r['key_rows']} key rows, "
                f"{r['seconds'] * 1e3:.1f} ms{peak}"
            )
    ring = results.get("6 ring block math", {})
    if ring.get("status") in ("ok", "failed") and "worst_rel_err" in ring:
        w = ring["worst_rel_err"]
        lines.append(f"    ring blocks: worst relative error fp64 {w['fp64']:.1e}, bf16 {w['bf16']:.1e}")
        for L, t in ring.get("timing", {}).items():
            lines.append(
                f"    ring blocks L={L}: 4 blocks fwd+bwd {t['ring_blocks_forward_backward_s'] * 1e3:.1f} ms"
                f" vs SDPA forward {t['sdpa_forward_s'] * 1e3:.1f} ms"
            )
    kern = results.get("7 ring block kernels", {})
    if "rows" in kern:
        lines.append(
            f"    block kernels usable: {', '.join(kern['usable'])}; worst disagreement {kern['worst_rel_err']:.1e}"
        )
        for r in kern["rows"]:
            if "seconds" in r:
                mem = f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
                lines.append(f"    ring rank blocks L={r['L']} {r['kernel']}: {r['seconds'] * 1e3:.1f} ms{mem}")
    text = "\n".join(lines)
    (out_dir / "check.txt").write_text(text + "\n")
    print(text)
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
