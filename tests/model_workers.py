"""Workers for the multi-rank model tests: balanced training math equals one process.

Every rank rebuilds every rank's batch (deterministic data), runs the reference model over
all sequences in one process with ``LocalExecutor``, then the balanced model on its own
share; outputs and all parameter gradients (summed over ranks) must match.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.data.batches import batch_from_lens
from knapformer.integrations.reference import ReferenceFamily
from knapformer.models import LocalExecutor, MMDiT, MMDiTConfig, Transformer, TransformerConfig
from knapformer.parallelize import apply_checkpointing, apply_fsdp

MM = MMDiTConfig(in_dim=8, vec_dim=8, dim=32, num_heads=4, num_double=1, num_single=1, out_dim=8)
TR = TransformerConfig(in_dim=8, dim=32, num_heads=4, num_layers=2, out_dim=8)
CONFIGS = {
    "mmdit": MM,
    "transformer": TR,
    "transformer-gqa": TransformerConfig(in_dim=8, dim=32, num_heads=4, num_kv_heads=2, num_layers=2, out_dim=8),
    "transformer-mqa": TransformerConfig(in_dim=8, dim=32, num_heads=4, num_kv_heads=1, num_layers=2, out_dim=8),
}


def _run(model, cfg, b, ex):
    family = ReferenceFamily(cfg)
    return family.forward(model, family.inputs(b), ex)


def _cat(batches):
    first = batches[0]
    return type(first)(
        seq_lens=[n for b in batches for n in b.seq_lens],
        txt_lens=torch.cat([b.txt_lens for b in batches]),
        x=torch.cat([b.x for b in batches]),
        t=torch.cat([b.t for b in batches]),
        vec=torch.cat([b.vec for b in batches]),
        target=torch.cat([b.target for b in batches]),
    )


def check_model(rank: int, world: int, kind: str, layout: str, lens, txts, wrapper: str) -> dict:
    cfg = CONFIGS[kind]
    batches = [
        batch_from_lens(lens[r], txts[r], seed=7, rank=r, step=0, in_dim=cfg.in_dim, vec_dim=8, out_dim=cfg.out_dim)
        for r in range(world)
    ]
    torch.manual_seed(0)
    ref = MMDiT(cfg) if kind == "mmdit" else Transformer(cfg)
    assert kind != "transformer-gqa" or ref.blocks[0].qkv.out_features == 32 + 2 * 2 * 8  # fewer kv heads
    model = copy.deepcopy(ref)
    # reference: all sequences of all ranks in one process
    allb = _cat(batches)
    out_ref = _run(ref, cfg, allb, LocalExecutor(allb.seq_lens))
    ((out_ref - allb.target) ** 2).sum().backward()
    # balanced, on this rank's share
    if wrapper in ("ckpt", "ckpt+fsdp"):
        apply_checkpointing(model)
    if wrapper == "ckpt+fsdp":
        apply_fsdp(model)
    bal = SequenceBalancer(layout, WorkloadModel(d_model=cfg.dim), link="free")  # free: groups split
    b = batches[rank]
    plan = bal.plan(b.seq_lens)
    out = _run(model, cfg, b, bal)
    start = sum(sum(x) for x in lens[:rank])
    mine = slice(start, start + b.num_tokens)
    err = (out - out_ref.detach()[mine]).abs().max().item() if out.numel() else 0.0
    assert err < 1e-5, f"{kind}/{layout}/{wrapper}: output differs by {err:.2e}"
    ((out - b.target) ** 2).sum().backward()
    ref_params = dict(ref.named_parameters())
    worst, missing = 0.0, []
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        key = name.replace("block.", "").replace("_checkpoint_wrapped_module.", "")
        g = p.grad
        if wrapper == "ckpt+fsdp":
            g = g.full_tensor() * world  # FSDP averages over ranks
        else:
            dist.all_reduce(g)
        r = ref_params[key].grad
        worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item())
    assert not missing, f"parameters without gradient on rank {rank}: {missing[:5]}"
    assert worst < 1e-5, f"{kind}/{layout}/{wrapper}: gradient relative error {worst:.2e}"
    # which streams did this rank see after routing?
    seq_id, pos = bal.routed_positions()
    txt_all = torch.tensor([t for r in txts for t in r], dtype=torch.int64)
    is_text = pos < txt_all[seq_id] if seq_id.numel() else torch.zeros(0, dtype=torch.bool)
    return {
        "text": int(is_text.sum()),
        "image": int((~is_text).sum()),
        "moved": plan.tokens_moved,
        "err": err,
        "grad_err": worst,
    }


def check_many(rank: int, world: int, cases) -> list[dict]:
    return [check_model(rank, world, *case) for case in cases]
