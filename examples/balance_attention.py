"""Balance one attention layer across ranks with knapformer.

    torchrun --nproc-per-node 2 examples/balance_attention.py            # CPU (gloo)
    torchrun --nproc-per-node 8 examples/balance_attention.py --cuda     # GPUs (NCCL)

Each rank holds sequences of very different lengths; the balancer plans, routes tokens to
their groups, runs Ulysses attention inside multi-rank groups and routes the result back. Any
number of ranks (``--nproc-per-node 3`` too). The
script checks the balanced output against plain per-rank attention and prints the plan.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from knapformer import SequenceBalancer, WorkloadModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="NCCL on CUDA tensors")
    ap.add_argument("--bags", default="auto", help="layout (default auto: each sequence's group chosen per step)")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    heads, head_dim = 8, 64
    bags = args.bags
    bal = SequenceBalancer(bags, WorkloadModel(d_model=heads * head_dim, num_heads=heads))

    # rank 0 drew one long sequence, the others many short ones
    torch.manual_seed(rank)
    local_lens = [4096] if rank == 0 else [256] * 4
    plan = bal.plan(local_lens)
    q, k, v = (torch.randn(sum(local_lens), heads, head_dim, device=device) for _ in range(3))

    rq, rk, rv = bal.route(q, k, v, seq_lens=local_lens)  # tokens -> their groups' ranks, checked against the plan
    o = bal.reverse_route(bal.attention(rq, rk, rv))  # Ulysses attention, then back home

    # plain attention of this rank's own sequences, for comparison
    ref, start = [], 0
    for n in local_lens:
        s = slice(start, start + n)
        ref.append(F.scaled_dot_product_attention(*(t[s].transpose(0, 1) for t in (q, k, v))).transpose(0, 1))
        start += n
    err = (o - torch.cat(ref)).abs().max().item()
    if rank == 0:
        st = plan.stats()
        print(
            f"layout {bags}: predicted imbalance {st['imbalance_before']:.3f} -> {st['imbalance_after']:.3f}, "
            f"tokens moved {plan.tokens_moved}, planning {st['plan_ms']:.2f} ms"
        )
    print(f"rank {rank}: {sum(local_lens)} local tokens, {rq.shape[0]} routed, max error vs local attention {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
