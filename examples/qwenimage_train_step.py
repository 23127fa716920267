"""Balanced training steps of a stock diffusers QwenImageTransformer2DModel (tiny, random init,
an edit model: ``zero_cond_t``) on a mixed-resolution batch: rank 0 holds one large image
edited from a reference image, rank 1 three small images of different aspect ratios with
padded (masked) prompts.

torchrun --nproc-per-node 2 examples/qwenimage_train_step.py

Each sample keeps its own resolution (no aspect-ratio bucket), its own prompt length (the
encoder mask drops padding) and its own timestep; reference-image tokens condition the image
with zero-timestep modulation and have no output, as in the stock edit pipelines. The loss is
the global mean over all ranks' output values (see flux_train_step.py for why).
"""

import math

import torch
import torch.distributed as dist
from diffusers import QwenImageTransformer2DModel

from knapformer import BalancerConfig, SequenceBalancer
from knapformer.integrations.qwenimage import (
    QwenImageSample,
    packed_qwenimage_forward,
    qwenimage_seq_lens,
    qwenimage_workload,
)
from knapformer.training import global_mean_loss, sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = QwenImageTransformer2DModel(
    patch_size=2,
    in_channels=16,  # 4 latent channels x a 2x2 patch
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
    zero_cond_t=True,
)
bal = SequenceBalancer(BalancerConfig(layout="auto", cost=qwenimage_workload(model)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())


def sample(h, w, words, pad=0, ref=None):  # an h x w grid of packed latent patches; ref: (h, w)
    shapes = [(1, h, w)] + ([(1, *ref)] if ref else [])
    return QwenImageSample(
        latents=torch.randn(h * w, 16, generator=g),
        img_shapes=shapes,
        text=torch.randn(words + pad, 32, generator=g),
        text_mask=torch.tensor([True] * words + [False] * pad),
        timestep=torch.rand((), generator=g),
        ref_latents=torch.randn(math.prod(ref), 16, generator=g) if ref else None,
    )


for step in range(2):
    if dist.get_rank() == 0:
        samples = [sample(24, 32, 40, ref=(16, 16))]
    else:
        samples = [sample(8, 8, 12, pad=20), sample(6, 12, 7, pad=25), sample(16, 8, 30, pad=2)]
    bal.plan(qwenimage_seq_lens(model, samples))  # once per step: kept text + image (+ reference) tokens
    outs = packed_qwenimage_forward(model, samples, bal)  # per-sample (T_img, 16), original order
    err = sum((((o - torch.randn(o.shape, generator=g)) ** 2).sum() for o in outs), 0 * outs.flat.sum())
    loss = global_mean_loss(err, sum(o.numel() for o in outs), gradients="sum")
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
