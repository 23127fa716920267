"""Part 2 of the accelerator check: the balancer's exchanges on CUDA tensors, what CI cannot run.

One GPU cannot host two NCCL ranks, but several gloo ranks can share ``cuda:0``: gloo moves CUDA
tensors (through host staging), so route, Ulysses, ring rounds, the K/V gather of ``pre_attn``,
``route_context`` + cross-attention, an empty rank and ``measure=True`` all run on CUDA tensors
with the attention backend ``auto`` picks there (flash-attn when importable, else SDPA). Each
case is compared with one-process math of the same values, the host reads of knapformer's own
code are counted per phase (``knapformer.testing.SyncSites``: layers after the first must make
none), and the bytes each rank routed are recorded (the CPU smoke run asserts that at least two
ranks exchanged data). One NCCL rank (a 1-rank group) then runs plan, route, layers and the
CUDA-event timer, with CUDA's own sync debug mode counting synchronisations per phase.

    PYTHONPATH=. python benchmarks/accelerator_check.py --parts 2   # on the GPU machine
"""

from __future__ import annotations

import datetime
import time
import warnings

import torch
import torch.distributed as dist

H, D, LAYERS = 12, 64, 3  # 12 heads: Ulysses groups of 2, 3 and 4 ranks


def _device(smoke: bool) -> torch.device:
    return torch.device("cpu") if smoke or not torch.cuda.is_available() else torch.device("cuda", 0)


def _cases(world: int, smoke: bool = False):
    """(name, plan maker or None for ``plan``, heads, path, cross): every form the executor runs."""
    from knapformer import WorkloadModel
    from knapformer.plan import plan_from_groups

    model = WorkloadModel(d_model=H * D, num_heads=H)
    long = 240 if smoke else 4096
    lens = [[long, 64, 9]] + [[77, 300]] * (world - 2) + [[]]  # the last rank holds nothing

    def plan(groups, seq_group, ring=None, heads=H):
        m = WorkloadModel(d_model=heads * D, num_heads=heads)
        return plan_from_groups(lens, groups, seq_group, m, ring=ring)

    n = sum(map(len, lens))
    everyone = tuple(range(world))
    group = everyone if world == 2 else everyone[:-1]  # 4 ranks: the last one idle (routes nothing)
    ulysses = lambda: plan([group, (0,)], [0] + [1] * (n - 1))  # noqa: E731
    ring = lambda: plan([everyone, (0,)], [0] + [1] * (n - 1), ring=[world, 1], heads=1)  # noqa: E731
    return (
        model,
        lens,
        [
            ("ulysses attention", ulysses, H, "attention", False),
            ("ulysses pre_attn", ulysses, H, "pre_attn", False),
            ("ring attention", ring, 1, "attention", False),
            ("ring pre_attn (K/V gather)", ring, 1, "pre_attn", False),
            ("auto + cross-attention", None, H, "attention", True),
        ],
    )


def run_rank(rank: int, world: int, smoke: bool) -> dict:
    """One gloo rank of part 2 (every rank's tensors on ``cuda:0`` unless ``smoke``)."""
    from knapformer import SequenceBalancer
    from knapformer.attention import varlen_attention_qk
    from knapformer.testing import reference_attention
    from knapformer.testing.syncs import SyncSites

    device = _device(smoke)
    dt = torch.float32 if smoke or device.type == "cpu" else torch.bfloat16
    model, lens, cases = _cases(world, smoke)
    out = {"rank": rank, "device": str(device), "dtype": str(dt), "cases": {}}
    for name, make_plan, heads, path, cross in cases:
        bal = SequenceBalancer("auto", model, measure=True, attn_path="pre_attn" if path == "pre_attn" else "auto")
        row = {"routed_bytes": 0, "max_err": 0.0}
        with SyncSites() as syncs:
            walls = []
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                total = sum(map(sum, lens))
                q_all, k_all, v_all = (torch.randn(total, heads, D, generator=g, dtype=torch.float64) for _ in "qkv")
                start = sum(sum(x) for x in lens[:rank])
                mine = slice(start, start + sum(lens[rank]))
                t0 = time.perf_counter()
                syncs.phase(f"plan {step}")
                if make_plan is None:
                    bal.plan(lens[rank])
                else:
                    bal.use_plan(make_plan())
                syncs.phase(f"route {step}")
                q, k, v = (t[mine].to(device, dt).requires_grad_() for t in (q_all, k_all, v_all))
                rq, rk, rv = bal.route(q, k, v)
                row["routed_bytes"] = int(rq.numel() * rq.element_size() * 3)
                ctx_rows = None
                if cross:
                    ctx_lens = [3] * len(lens[rank])
                    ctx = torch.randn(sum(ctx_lens), heads * D, device=device, dtype=dt)
                    ctx_rows = bal.route_context(ctx, ctx_lens)
                o = None
                for layer in range(LAYERS):
                    syncs.phase(f"layer {min(layer + 1, 2)} {step}")
                    if path == "pre_attn":
                        args = bal.pre_attn(rq, rk, rv, causal=False)
                        o = bal.post_attn(varlen_attention_qk(*args, causal=False))
                    else:
                        o = bal.attention(rq, rk, rv)
                    if ctx_rows is not None:
                        kv = ctx_rows.rows.view(-1, heads, D)
                        o = o + 0 * bal.cross_attention(rq, kv, kv, ctx_rows)
                syncs.phase(f"reverse {step}")
                y = bal.reverse_route(o)
                syncs.phase(f"backward {step}")
                y.float().square().sum().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            ref = reference_attention(q_all, k_all, v_all, [n for r in lens for n in r])[mine]
            if y.numel():
                err = (y.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1.0)
                row["max_err"] = float(err)
        telemetry = bal.flush()
        row["measured_s"] = telemetry.measured_s if telemetry is not None else None
        row["wall_s"] = walls
        row["sync_sites"] = dict(syncs.counts)
        row["layers_after_first_syncs"] = sum(v for k, v in syncs.counts.items() if k.startswith("layer 2"))
        out["cases"][name] = row
    return out


def part_multi_rank(smoke: bool) -> dict:
    """Part 2a: 2 and 4 gloo ranks sharing the device (CPU tensors in ``smoke``)."""
    from knapformer.testing import run_distributed

    worlds = (2,) if smoke else (2, 4)
    out: dict = {"worlds": {}}
    ok = True
    for world in worlds:
        res = run_distributed(run_rank, world, smoke, timeout=240)
        cases = {}
        for name in res[0]["cases"]:
            rows = [r["cases"][name] for r in res]
            tol = 1e-4 if res[0]["dtype"] == "torch.float32" else 3e-2  # relative to the largest output
            worst = max(r["max_err"] for r in rows)
            syncs = max(r["layers_after_first_syncs"] for r in rows)
            exchanged = sum(r["routed_bytes"] > 0 for r in rows)
            good = worst <= tol and syncs == 0 and exchanged >= 2
            ok &= good
            cases[name] = {
                "ok": good,
                "worst_err": worst,
                "syncs_layers_after_first": syncs,
                "ranks_with_data": exchanged,
                "measured_s": [r["measured_s"] for r in rows],
                "median_wall_s": [sorted(r["wall_s"])[1] for r in rows],
                "sync_sites_rank0": rows[0]["sync_sites"],
            }
        out["worlds"][world] = {"device": res[0]["device"], "dtype": res[0]["dtype"], "cases": cases}
    out["status"] = "ok" if ok else "failed"
    return out


def part_nccl_rank(smoke: bool, port: int) -> dict:
    """Part 2b: one NCCL rank: plan, route, layers and the CUDA-event timer (a step late), with
    CUDA's sync debug mode counting synchronisations per phase."""
    from knapformer import SequenceBalancer, WorkloadModel

    if smoke or not torch.cuda.is_available():
        return {"status": "skipped", "reason": "needs CUDA (NCCL)"}
    import os

    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # a machine with loopback only
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the gloo twin of the NCCL group
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        bal = SequenceBalancer("g1n1", WorkloadModel(d_model=H * D, num_heads=H), measure=True)
        lens = [4096, 1024, 77]
        syncs: dict = {}
        for step in range(4):
            phases = {}
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    bal.plan(lens)
                    phases["plan"] = len(caught)
                    x = torch.randn(sum(lens), H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                    n0 = len(caught)
                    y = bal.route(x)
                    phases["route"] = len(caught) - n0
                    for layer in range(LAYERS):
                        n0 = len(caught)
                        y = bal.attention(y, y, y)
                        phases[f"layer {layer + 1}"] = len(caught) - n0
                    n0 = len(caught)
                    z = bal.reverse_route(y)
                    phases["reverse_route"] = len(caught) - n0
                    n0 = len(caught)
                    z.float().sum().backward()
                    phases["backward"] = len(caught) - n0
            finally:
                torch.cuda.set_sync_debug_mode(0)
            syncs[f"step {step}"] = phases
        telemetry = bal.flush()
        measured = telemetry.measured_s if telemetry is not None else None
        warm = syncs["step 3"]
        ok = warm["plan"] <= 1 and all(warm[f"layer {i}"] == 0 for i in range(2, LAYERS + 1))
        ok &= measured is not None and all(m == m and m > 0 for m in measured)
        return {"status": "ok" if ok else "failed", "syncs_per_phase": syncs, "measured_s": measured}
    finally:
        dist.destroy_process_group()
