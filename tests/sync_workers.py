"""Workers for the host-sync budgets: every call path of a step on 2 gloo ranks, with
:class:`~knapformer.testing.syncs.SyncSites` counting the calls that would synchronise the host
with a GPU, by phase."""

from __future__ import annotations

import torch

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.attention import varlen_attention_qk
from knapformer.plan import plan_from_groups
from knapformer.testing.syncs import SyncSites

H, D, LAYERS = 4, 8, 3
MODEL = WorkloadModel(d_model=H * D, num_heads=H)


def _lens(rank: int, kind: str) -> list[int]:
    if kind.startswith("ring"):
        return [97, 5] if rank == 0 else [6]
    return [40, 7, 90] if rank == 0 else ([] if kind == "empty rank" else [5 + rank, 13])


def count_syncs(rank: int, world: int) -> dict:
    out = {}
    for kind in ("attention", "pre_attn", "ring", "ring pre_attn", "cross_attention", "empty rank", "idle pre_attn"):
        bal = SequenceBalancer(f"g{world}n1", MODEL, attn_path="pre_attn" if kind == "ring pre_attn" else "auto")
        heads = 1 if kind.startswith("ring") else H  # one head: a group of 2 is a pure ring
        with SyncSites() as syncs:
            for step in range(3):
                lens = _lens(rank, kind)
                syncs.phase(f"plan {step}")
                if kind.startswith("ring"):
                    all_lens = [_lens(r, kind) for r in range(world)]
                    bal.use_plan(plan_from_groups(all_lens, [tuple(range(world))], [0] * 3, MODEL, ring=[world]))
                elif kind == "idle pre_attn":  # every sequence on rank 0: rank 1 computes nothing
                    all_lens = [_lens(r, kind) for r in range(world)]
                    bal.use_plan(plan_from_groups(all_lens, [(0,)], [0] * sum(map(len, all_lens)), MODEL))
                else:
                    bal.plan(lens)
                syncs.phase(f"route {step}")
                x = torch.randn(sum(lens), heads, D, requires_grad=True)
                h = bal.route(x)
                ctx = None
                if kind == "cross_attention":
                    ctx = bal.route_context(torch.randn(3 * len(lens), heads * D), [3] * len(lens))
                for i in range(LAYERS):
                    syncs.phase(f"layer {min(i + 1, 2)} {step}")
                    if "pre_attn" in kind:
                        args = bal.pre_attn(h, h, h)
                        o = bal.post_attn(varlen_attention_qk(*args))
                    else:
                        o = bal.attention(h, h, h)
                    if ctx is not None:
                        kv = ctx.rows.view(-1, heads, D)
                        o = o + bal.cross_attention(h, kv, kv, ctx)
                    h = h + o
                syncs.phase(f"reverse {step}")
                y = bal.reverse_route(h)
                syncs.phase(f"backward {step}")
                y.sum().backward()
        out[kind] = (dict(syncs.counts), syncs.report())
    return out
