"""Workers for ranks with no samples whose inputs have no autograd history (``torch.zeros(0,
d)``): every backward exchange still runs on every rank (no wait, no false "peer gone"), and
the gradients equal one process's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from knapformer import BalancerInputError, SequenceBalancer, WorkloadModel
from knapformer.attention import varlen_attention_qk
from knapformer.testing import reference_attention

H, D, F = 2, 4, 8
LENS = [[9, 14], []]  # rank 1 holds no sample


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(F, 3 * H * D, dtype=torch.float64)
        self.ctx = torch.nn.Linear(3, 2 * H * D, dtype=torch.float64)
        self.cond = torch.nn.Linear(2, F, dtype=torch.float64)

    def forward(self, x, executor, path: str, context=None, ctx_lens=None, per_seq=None):
        if per_seq is not None:  # per-sample conditioning gathered to every rank
            (cond,) = executor.gather_sequences(self.cond(per_seq))
            seq_id, _ = executor.routed_positions()
        h = executor.route(x)
        if per_seq is not None:
            h = h + cond[seq_id]
        q, k, v = self.qkv(h).view(-1, 3, H, D).unbind(1)
        if path == "attention":
            o = executor.attention(q, k, v)
        else:
            o = executor.post_attn(varlen_attention_qk(*executor.pre_attn(q, k, v, causal=False)))
        if context is not None:
            routed = executor.route_context(context, ctx_lens)
            ck, cv = self.ctx(routed.rows).view(-1, 2, H, D).unbind(1)
            o = o + executor.cross_attention(q, ck, cv, routed)
        return executor.reverse_route(o.reshape(-1, H * D))


def run(rank: int, world: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(1)
    total = sum(map(sum, LENS))
    xs = torch.randn(total, F, generator=g, dtype=torch.float64)
    mine = slice(0, sum(LENS[0])) if rank == 0 else slice(total, total)
    for path in ("attention", "pre_attn"):
        for extra in ("", "context", "gather"):
            net = Net()
            bal = SequenceBalancer("g2n1", WorkloadModel(d_model=H * D, num_heads=H))  # every layer exchanges
            bal.plan(LENS[rank])
            # rank 0's tokens have history (an embedding upstream); rank 1 has none at all
            x = xs[mine].clone().requires_grad_() if rank == 0 else torch.zeros(0, F, dtype=torch.float64)
            kwargs = {}
            if extra == "context":
                kwargs = {"context": torch.ones(sum([2, 3][: len(LENS[rank])]), 3, dtype=torch.float64)}
                kwargs["ctx_lens"] = [2, 3][: len(LENS[rank])]
            if extra == "gather":
                kwargs = {"per_seq": torch.ones(len(LENS[rank]), 2, dtype=torch.float64)}
            y = net(x, bal, path, **kwargs)
            y.square().sum().backward()  # an empty rank: a zero loss, but the same backward exchanges
            grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
            for gr in grads:
                dist.all_reduce(gr)
            out[f"{path} {extra}"] = {
                "grads": [gr.tolist() for gr in grads],
                "y": y.detach().tolist(),
            }
    # the reference: one process, every sample
    net = Net()
    q, k, v = net.qkv(xs).view(-1, 3, H, D).unbind(1)
    ref = reference_attention(q, k, v, [n for r in LENS for n in r]).reshape(-1, H * D)
    ref.square().sum().backward()
    out["reference y"] = ref.detach()[mine].tolist()
    out["reference qkv grads"] = [net.qkv.weight.grad.tolist(), net.qkv.bias.grad.tolist()]
    # a rank under no_grad while the other needs a backward: the same clear error on both
    bal = SequenceBalancer("g2n1", WorkloadModel(d_model=H * D, num_heads=H))
    bal.plan(LENS[rank])
    try:
        if rank == 1:
            with torch.no_grad():
                bal.route(torch.zeros(0, F, dtype=torch.float64))
        else:
            bal.route(xs[mine].clone().requires_grad_())
        out["no_grad"] = "ok"
    except BalancerInputError as exc:
        out["no_grad"] = str(exc)
    return out
