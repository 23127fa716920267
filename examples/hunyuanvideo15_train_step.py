"""Balanced training steps of a stock diffusers HunyuanVideo15Transformer3DModel (tiny, random
init) on a joint image + video batch: rank 0 holds one 13-frame I2V clip, rank 1 four images
(1-frame videos) of different aspect ratios, two of them with glyph (byT5) text.

torchrun --nproc-per-node 2 examples/hunyuanvideo15_train_step.py

Every sample brings its own MLLM text (refined per sample by the model's token refiner), and
optionally byT5 glyph text and SigLIP image tokens; none is padded. The loss is the global
mean over all ranks' output values (see flux_train_step.py for why).
"""

import torch
import torch.distributed as dist
from diffusers import HunyuanVideo15Transformer3DModel

from knapformer import BalancerConfig, SequenceBalancer
from knapformer.integrations.hunyuanvideo15 import (
    HunyuanVideo15Sample,
    hunyuanvideo15_seq_lens,
    hunyuanvideo15_workload,
    packed_hunyuanvideo15_forward,
)
from knapformer.training import global_mean_loss, sum_gradients

dist.init_process_group("gloo")
torch.manual_seed(0)  # the same initial weights on every rank
model = HunyuanVideo15Transformer3DModel(
    in_channels=9,  # 4 noisy latent + 4 condition latent + 1 mask channels
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=32,
    text_embed_2_dim=16,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)
bal = SequenceBalancer(BalancerConfig(layout="auto", cost=hunyuanvideo15_workload(model)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(dist.get_rank())


def sample(frames, h, w, words, glyphs=0, image=0):  # latents (C, F, H, W); an image: F = 1
    return HunyuanVideo15Sample(
        latents=torch.randn(9, frames, h, w, generator=g),
        text=torch.randn(words, 32, generator=g),
        timestep=torch.rand((), generator=g) * 1000,
        text_2=torch.randn(glyphs, 16, generator=g) if glyphs else None,
        image_embeds=torch.randn(image, 12, generator=g) if image else None,  # None: text-to-video
    )


for step in range(2):
    if dist.get_rank() == 0:
        samples = [sample(13, 12, 16, 40, image=16)]
    else:
        samples = [
            sample(1, 16, 16, 20, glyphs=6),
            sample(1, 8, 24, 9),
            sample(1, 24, 12, 31, glyphs=3),
            sample(1, 4, 4, 5),
        ]
    bal.plan(hunyuanvideo15_seq_lens(model, samples))  # once per step: video + context tokens per sample
    outs = packed_hunyuanvideo15_forward(model, samples, bal)  # per-sample (C_out, F, H, W), original order
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
