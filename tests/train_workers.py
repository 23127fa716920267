"""Workers for the training-loop tests: FSDP2 with the global-mean loss, autocast, divergent
calls, resumable state, device meshes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from knapformer import BalancerConfig, SequenceBalancer, WorkloadModel
from knapformer.data.batches import batch_from_lens
from knapformer.executor import LocalExecutor
from knapformer.models import Transformer, TransformerConfig
from knapformer.parallelize import apply_checkpointing
from knapformer.training import global_mean_loss

CFG = TransformerConfig(in_dim=8, dim=32, num_heads=4, num_layers=2, out_dim=8)
MODEL = WorkloadModel(d_model=32, num_heads=4)


def _lens(rank: int, micro: int) -> list[int]:
    """Long-tailed per-rank lengths; rank 1 brings nothing in micro-batch 1."""
    if rank == 1 and micro == 1:
        return []
    return [[90, 7, 3], [12, 40], [150], [5, 5, 5, 60]][rank % 4] if micro == 0 else [33 + rank, 2]


def _batch(rank: int, micro: int):
    lens = _lens(rank, micro)
    return batch_from_lens(lens, [0] * len(lens), seed=3, rank=rank, step=micro, in_dim=8, vec_dim=1, out_dim=8)


def fsdp_global_mean(rank: int, world: int, mixed: bool, checkpointing: bool) -> float:
    """Two micro-batches per step through the balancer, FSDP2 (optionally fp32 compute of an
    fp64 model, activation checkpointing), global-mean loss: the gradients equal the
    single-process gradients of the mean over every token of both micro-batches."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    ref = Transformer(CFG).double()
    model = copy.deepcopy(ref)
    # reference: every rank's tokens of both micro-batches in one process
    batches = [[_batch(r, m) for m in range(2)] for r in range(world)]
    total = sum(b.x.shape[0] for r in batches for b in r)
    loss = 0.0
    for r in batches:
        for b in r:
            out = ref(b.x.double(), b.seq_lens, executor=LocalExecutor(b.seq_lens))
            loss = loss + ((out - b.target.double()) ** 2).sum(-1).sum()
    (loss / total).backward()
    if checkpointing:
        apply_checkpointing(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64) if mixed else None
    kw = {"mp_policy": policy} if policy is not None else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    bal = SequenceBalancer("auto", MODEL, link="free")  # free: groups split
    mine = batches[rank]
    count = sum(b.x.shape[0] for b in mine)  # this rank's tokens of the whole step
    for m, b in enumerate(mine):
        model.set_requires_gradient_sync(m == len(mine) - 1)
        bal.plan(b.seq_lens)
        x = b.x.double() if not mixed else b.x.double()
        out = model(x, b.seq_lens, executor=bal)
        local = ((out.double() - b.target.double()) ** 2).sum(-1).sum()
        global_mean_loss(local, count).backward()
    ref_p = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_p[name.replace("_checkpoint_wrapped_module.", "").replace("block.", "")].grad
        worst = max(worst, ((g.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return worst


def autocast_equals_local(rank: int, world: int) -> float:
    """bal.attention under torch.autocast with mixed q/k/v dtypes equals LocalExecutor's
    attention of the same sequences under the same autocast."""
    bal = SequenceBalancer("auto", MODEL, link="free")  # free: groups split
    lens_all = [[40, 3], [70, 1]]
    bal.plan(lens_all[rank])
    g = torch.Generator().manual_seed(5)
    n = [sum(x) for x in lens_all]
    qkv = [torch.randn(sum(n), 4, 8, generator=g) for _ in range(3)]
    start = sum(n[:rank])
    mine = slice(start, start + n[rank])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = bal.route(qkv[0][mine], qkv[1][mine].bfloat16(), qkv[2][mine])
        out = bal.reverse_route(bal.attention(q, k, v))
        local = LocalExecutor([x for r in lens_all for x in r]).attention(qkv[0], qkv[1].bfloat16(), qkv[2])
    assert out.dtype == local.dtype == torch.bfloat16, (out.dtype, local.dtype)
    return (out.float() - local[mine].float()).abs().max().item()


def divergent_calls(rank: int, world: int) -> dict:
    """Rank 0 runs one more attention layer than the others (a layer drop); then ranks make
    different numbers of plan() calls. Both raise on every rank, naming each rank's call."""
    out = {}
    bal = SequenceBalancer(f"g{world}n1", MODEL)
    bal.plan([20, 4] if rank == 0 else [9])
    y = bal.route(torch.zeros(24 if rank == 0 else 9, 1))
    q = torch.randn(y.shape[0], 4, 8)
    try:
        for _ in range(3 if rank == 0 else 2):
            bal.attention(q, q, q)
        bal.reverse_route(y)
        out["layer drop"] = ("ok", "")
    except Exception as exc:
        out["layer drop"] = (type(exc).__name__, str(exc))
    try:
        bal.plan([3])
        if rank == 0:
            bal.plan([3])
        bal.route(torch.zeros(3, 1))
        out["extra plan"] = ("ok", "")
    except Exception as exc:
        out["extra plan"] = (type(exc).__name__, str(exc))
    return out


def _fake_timer(rank: int):
    """A StepTimer whose seconds depend only on what the rank computed (deterministic): rank 1
    is twice as slow."""
    from knapformer.distributed.timing import StepTimer

    class FakeTimer(StepTimer):
        def seconds(self):
            if not self.running:
                return float("nan")
            self.running = False
            f = self.features
            return (2.0 if rank == 1 else 1.0) * (1e-6 * float(f.tokens[rank]) + 1e-8 * float(f.attn[rank]) + 1e-4)

    return FakeTimer


STEP_LENS = [[[60, 9], [5, 5]], [[10], [120, 4]], [[33, 33], [2]], [[40, 40], [40, 40]], [[4], [70]], [[50, 1], [30]]]
"""Step 4 (the first after the resume) plans differently when rank 1 is known to be slow."""


def _run_steps(bal, rank: int, steps, fake) -> list[str]:
    """Plan, route and reverse a tiny step per entry of ``steps``; the fake timer reads the
    step's plan features. Returns each plan's digest."""
    digests = []
    for lens in steps:
        plan = bal.plan(lens[rank])
        bal._loop.timer.features = plan.features()
        x = torch.zeros(sum(lens[rank]), 1, requires_grad=True)
        (bal.reverse_route(bal.route(x)) * 1.0).sum().backward()
        digests.append(plan.digest())
    return digests


def resume_identical(rank: int, world: int) -> dict:
    """6 recalibrating steps in one go vs 3 steps, state_dict, a new balancer, load_state_dict,
    the last 3: the last 3 plans are identical."""
    import knapformer.distributed.closed_loop as loop

    fake = _fake_timer(rank)
    real, loop.StepTimer = loop.StepTimer, fake
    try:
        cfg = BalancerConfig(
            layout="g1n2", cost=MODEL, recalibrate=True, estimate_speed=True, recalibrate_warmup=0, link="free"
        )  # unpriced: every plan moves work, so the restored speeds decide it
        a = SequenceBalancer(cfg)
        whole = _run_steps(a, rank, STEP_LENS, fake)
        b = SequenceBalancer(cfg)
        _run_steps(b, rank, STEP_LENS[:3], fake)
        state = b.state_dict()
        c = SequenceBalancer(cfg)
        c.load_state_dict(state)
        resumed = _run_steps(c, rank, STEP_LENS[3:], fake)
        naive = SequenceBalancer(cfg)  # no state: the first plan of step 4 uses the prior
        fresh = _run_steps(naive, rank, STEP_LENS[3:4], fake)
    finally:
        loop.StepTimer = real
    return {
        "whole": whole[3:],
        "fresh": fresh,
        "resumed": resumed,
        "num_plans": c.num_plans,
        "speeds": c.planning_config.rank_speed,
        "first_after_resume": [len(g) for g in c.current_plan.groups],
        "model_changed": c.online_model() != MODEL,
    }


def device_mesh_groups(rank: int, world: int) -> dict:
    """A 1-D mesh, and a named dimension of a 2-D mesh, name the balancing group."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    bal = SequenceBalancer("auto", MODEL, device_mesh=mesh)
    bal.plan([10 + rank])
    out["1-D"] = dist.get_process_group_ranks(bal.group)
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "balance"))
    bal2 = SequenceBalancer("auto", MODEL, device_mesh=(mesh2, "balance"))
    bal2.plan([5])
    x = torch.arange(5.0)[:, None]
    assert torch.equal(bal2.reverse_route(bal2.route(x)), x)
    out["2-D balance"] = dist.get_process_group_ranks(bal2.group)
    return out


def telemetry_files(rank: int, world: int, folder: str) -> None:
    """jsonl_writer registered on every rank: one shared file with one record per step, and
    one file per rank with ``{rank}``."""
    from knapformer.telemetry import jsonl_writer

    bal = SequenceBalancer(f"g1n{world}", MODEL)
    bal.on_step(jsonl_writer(f"{folder}/shared.jsonl"))
    bal.on_step(jsonl_writer(f"{folder}/rank_{{rank}}.jsonl"))
    for step in range(3):
        bal.plan([5 + step + rank])
