"""Balanced training steps of a stock diffusers WanTransformer3DModel (tiny, random init) on a
joint image + video batch: rank 0 holds four images (1-frame videos), rank 1 one 9-frame video.

torchrun --nproc-per-node 2 examples/wan_train_step.py

Text is per sample and unpadded; each sample's text reaches the ranks holding its video tokens
once per step. The loss is the global mean over all ranks' output values (see
flux_train_step.py for why).
"""

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from knapformer import BalancerConfig, SequenceBalancer
from knapformer.integrations.wan import WanSample, packed_wan_forward, wan_seq_lens, wan_workload
from knapformer.training import global_mean_loss, sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = WanTransformer3DModel(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=128,
    num_layers=2,
)
bal = SequenceBalancer(BalancerConfig(layout="auto", cost=wan_workload(model, context_len=24)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())


def sample(frames, h, w, txt):  # latents (C, F, H, W) of a VAE-encoded clip; an image: F = 1
    return WanSample(
        latents=torch.randn(4, frames, h, w, generator=g),
        text=torch.randn(txt, 32, generator=g),
        timestep=torch.rand((), generator=g) * 1000,
    )


for step in range(2):
    if dist.get_rank() == 0:
        samples = [sample(1, 16, 16, 12), sample(1, 8, 24, 30), sample(1, 16, 8, 5), sample(1, 12, 12, 17)]
    else:
        samples = [sample(9, 24, 32, 20)]
    bal.plan(wan_seq_lens(model, samples))  # once per step: video tokens per sample
    outs = packed_wan_forward(model, samples, bal)  # per-sample (C, F, H, W), original order
    err = sum((((o - torch.randn(o.shape, generator=g)) ** 2).sum() for o in outs), 0 * outs.flat.sum())
    loss = global_mean_loss(err, sum(o.numel() for o in outs), gradients="sum")  # the mean over all ranks' values
    loss.backward()
    sum_gradients(model)  # plain data parallel (or FSDP2 per block, with gradients="mean")
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        degrees = sorted(set(map(len, bal.current_plan.groups)))
        print(f"step {step}: global mean loss {total.item():.4f}, group sizes this step {degrees}")
dist.destroy_process_group()
