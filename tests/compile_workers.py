"""Workers for the torch.compile tests: blocks that call the balancer compile with
``fullgraph=True, dynamic=True``, equal eager (outputs and gradients), and are not recompiled
for steps of other lengths; a whole model compiles with graph breaks at route and reverse only.

The tests use the ``aot_eager`` backend (Dynamo + AOTAutograd, the custom operators' fake and
autograd kernels exercised, no code generation: seconds instead of minutes on this CPU);
``benchmarks/compile_speed.py`` times the inductor backend."""

from __future__ import annotations

import copy

import torch
import torch._dynamo.testing as dynamo_testing

from knapformer import SequenceBalancer, WorkloadModel
from knapformer.models import Transformer, TransformerConfig

CFG = TransformerConfig(in_dim=8, dim=32, num_heads=4, num_layers=2, out_dim=8)
STEPS = [[[40, 3], [70, 1]], [[9, 9, 9], [120]], [[5], [33, 2, 60]]]
"""Per step, per rank: lengths (the layout auto splits the long ones over both ranks)."""


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def compiled_block(rank: int, world: int, heads: int = 4) -> dict:
    """A Transformer block (QK-norm, RoPE, attention through the balancer) compiled fullgraph
    and dynamic equals the eager block on every step; no compile after the first step.
    ``heads=1``: the long sequences run as a ring of 2 (no head to split)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(in_dim=8, dim=32, num_heads=heads, num_layers=2, out_dim=8)
    eager = Transformer(cfg).blocks[0].double()
    block = copy.deepcopy(eager)
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    bal = SequenceBalancer("auto", WorkloadModel(d_model=32, num_heads=heads), link="free")  # free: rings pay
    out = {"out_err": 0.0, "grad_err": 0.0, "frames": [], "rings": set()}
    for step, lens in enumerate(STEPS):
        plan = bal.plan(lens[rank])
        out["rings"] |= {int(plan.rings[b]) for b in set(plan.seq_group.tolist())}
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = bal.route(torch.randn(sum(lens[rank]), 32, generator=g, dtype=torch.float64))
        _, pos = bal.routed_positions(x)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = compiled(xa, pos, bal), eager(xb, pos, bal)
        w = torch.randn(ya.shape, generator=g, dtype=torch.float64)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        out["out_err"] = max(out["out_err"], (ya - yb).abs().max().item() if ya.numel() else 0.0)
        out["grad_err"] = max(out["grad_err"], _max_diff(_grads(block), _grads(eager)))
        out["grad_err"] = max(out["grad_err"], (xa.grad - xb.grad).abs().max().item() if xa.numel() else 0.0)
        block.zero_grad()
        eager.zero_grad()
        out["frames"].append(counter.frame_count)
    return out


class CrossBlock(torch.nn.Module):
    """Self-attention then cross-attention to each sequence's own context (Wan's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.q, self.kv = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), torch.nn.Linear(16, 64)

    def forward(self, x, ctx_rows, context, ex):
        q, k, v = self.qkv(x).unflatten(1, (3, 4, 8)).unbind(1)
        h = x + ex.attention(q, k, v).flatten(1)
        k2, v2 = self.kv(ctx_rows).unflatten(1, (2, 4, 8)).unbind(1)
        return h + ex.cross_attention(self.q(h).unflatten(1, (4, 8)), k2, v2, context).flatten(1)


def compiled_cross_block(rank: int, world: int) -> dict:
    """route_context once per step, cross_attention inside a compiled block (fullgraph,
    dynamic): equal to eager, not recompiled for other lengths and context lengths."""
    torch.manual_seed(1)
    eager = CrossBlock().double()
    block = copy.deepcopy(eager)
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    bal = SequenceBalancer("auto", WorkloadModel(d_model=32, num_heads=4), link="free")  # free: groups pay
    out = {"out_err": 0.0, "grad_err": 0.0, "frames": []}
    for step, lens in enumerate(STEPS):
        g = torch.Generator().manual_seed(step * 10 + rank)
        bal.plan(lens[rank])
        ctx_lens = [3 + (i + step) % 4 for i in range(len(lens[rank]))]
        ctx = bal.route_context(torch.randn(sum(ctx_lens), 16, generator=g, dtype=torch.float64), ctx_lens)
        x = bal.route(torch.randn(sum(lens[rank]), 32, generator=g, dtype=torch.float64))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = compiled(xa, ctx.rows, ctx, bal), eager(xb, ctx.rows, ctx, bal)
        w = torch.randn(ya.shape, generator=g, dtype=torch.float64)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        out["out_err"] = max(out["out_err"], (ya - yb).abs().max().item() if ya.numel() else 0.0)
        out["grad_err"] = max(out["grad_err"], _max_diff(_grads(block), _grads(eager)))
        block.zero_grad()
        eager.zero_grad()
        out["frames"].append(counter.frame_count)
    return out


def compiled_model(rank: int, world: int) -> dict:
    """The whole reference Transformer compiled (dynamic): its graph breaks are route and
    reverse_route only, and it equals eager."""
    torch.manual_seed(0)
    eager = Transformer(CFG).double()
    model = copy.deepcopy(eager)
    bal = SequenceBalancer("auto", WorkloadModel(d_model=32, num_heads=4), link="free")  # free: groups pay
    lens = STEPS[0][rank]
    bal.plan(lens)
    x = torch.randn(sum(lens), 8, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    explained = torch._dynamo.explain(model)(x, lens, executor=bal)
    reasons = [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True, backend="aot_eager")
    bal.plan(lens)
    ya = compiled(x, lens, executor=bal)
    yb = eager(x, lens, executor=bal)
    (ya.sum() + yb.sum()).backward()
    return {
        "breaks": explained.graph_break_count,
        "reasons": reasons,
        "out_err": (ya - yb).abs().max().item(),
        "grad_err": _max_diff(_grads(model), _grads(eager)),
    }
