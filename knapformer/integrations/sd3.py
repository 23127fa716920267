"""Packed, variable-length (and balanced) forward of a stock diffusers ``SD3Transformer2DModel``.

    from knapformer.integrations.sd3 import SD3Sample, packed_sd3_forward, sd3_seq_lens
    bal.plan(sd3_seq_lens(model, samples))            # once per step: image + text tokens
    outs = packed_sd3_forward(model, samples, bal)     # list of (C, H, W) tensors

Through the family seam (:mod:`knapformer.integrations.seam`), what is SD3's own: each
sample's latent is patch-embedded at home with its own crop of the stock positional table
(``pos_embed``: no position travels); every ``JointTransformerBlock`` attends image then text
(the stock joint order) and modulates per sample (``norm1``, ``norm1_context``, ``norm_out``);
the last block's text output is dropped, as the stock one's. Not supported: SD3.5 Medium's
dual-attention layers (refused), ControlNet residuals, IP-Adapter, ``skip_layers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations.configs_dit import SD3_PRESETS, DiffusersSD3Config

__all__ = [
    "DiffusersSD3Config",
    "PackedSD3AttnProcessor",
    "SD3Family",
    "SD3Sample",
    "build_sd3",
    "packed_sd3_forward",
    "prepare_sd3",
    "samples_from_batch",
    "sd3_seq_lens",
    "sd3_workload",
]


@dataclass
class SD3Sample:
    """One training sample for an SD3 model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (C, H, W) VAE latents, H and W multiples of the patch size
    text: torch.Tensor  # (T_txt, joint_attention_dim) T5 + CLIP states, unpadded
    pooled: torch.Tensor  # (pooled_projection_dim,)
    timestep: torch.Tensor  # () in stock units (0..1000)


class PackedSD3AttnProcessor(seam.PackedProcessor):
    """SD3 joint attention over packed ``[T, 1, D]`` tokens (image, then text); stock when not packed."""

    stock = "diffusers.models.attention_processor:JointAttnProcessor2_0"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, packed=None):
        if packed is None:
            return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask)
        q, k, v = (seam.heads(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        e = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        eq, ek, ev = (seam.heads(f(encoder_hidden_states), attn.heads) for f in e)
        q, k = (q, k) if attn.norm_q is None else (attn.norm_q(q), attn.norm_k(k))
        eq, ek = (eq, ek) if attn.norm_added_q is None else (attn.norm_added_q(eq), attn.norm_added_k(ek))
        o = packed.attention(torch.cat([q, eq]), torch.cat([k, ek]), torch.cat([v, ev]))
        img, txt = o[: packed.count("img")], o[packed.count("img") :]
        return attn.to_out[1](attn.to_out[0](img)), txt if attn.context_pre_only else attn.to_add_out(txt)


def build_sd3(cfg: DiffusersSD3Config):
    """Random-init ``SD3Transformer2DModel`` for a :class:`DiffusersSD3Config` (no download)."""
    same = ("in_channels", "patch_size", "num_layers", "qk_norm", "pos_embed_max_size")
    sizes = dict(joint_attention_dim=cfg.text_dim, pooled_projection_dim=cfg.pooled_dim, out_channels=cfg.in_channels)
    return seam.build_diffusers("SD3Transformer2DModel", cfg, *same, caption_projection_dim=cfg.dim, **sizes)


def prepare_sd3(model) -> None:
    """Install the packed processor and the per-sample modulation hooks on this model instance
    only (stock calls keep their behaviour); checked every call."""
    seam.require_diffusers()
    seam.install([b.attn for b in model.transformer_blocks], PackedSD3AttnProcessor)
    for b in model.transformer_blocks:
        seam.hook_norm(b.norm1, "img")
        seam.hook_norm(b.norm1_context, "txt")
    seam.hook_norm(model.norm_out, "img")


def sd3_workload(model, *, gamma: float = 1.0):
    """The planner's cost model: every joint block a layer of ``24·d²`` FLOPs per token."""
    return seam.diffusers_workload(model, model.config.num_layers, gamma)


def _tokens(s: SD3Sample, p: int) -> int:
    return (s.latents.shape[1] // p) * (s.latents.shape[2] // p)


def sd3_seq_lens(model, samples: Sequence[SD3Sample] | None = None, patch_size: int | None = None) -> list[int]:
    """Tokens of each sample (its image patches at the model's patch size, then its text): the
    lengths to plan with (0 for a malformed sample: the forward names it). The old form
    ``sd3_seq_lens(samples, patch_size=2)`` is deprecated: with a forgotten patch size a patch-1
    model was planned for a quarter of its tokens."""
    if not isinstance(model, torch.nn.Module):  # the old form: (samples[, patch_size])
        patch = int(samples) if samples is not None else 2 if patch_size is None else int(patch_size)
        _, samples = seam.model_and_samples("sd3_seq_lens", model, None)
        return _lengths(samples, patch)
    if patch_size is not None and int(patch_size) != model.config.patch_size:
        raise ValueError(f"patch_size={patch_size} differs from the model's ({model.config.patch_size}): leave it out")
    return _lengths(samples, model.config.patch_size)


def _lengths(samples: Sequence[SD3Sample], patch_size: int) -> list[int]:
    return seam.safe_lens(lambda s: _tokens(s, patch_size) + s.text.shape[0], samples)


def _problem(model, samples: Sequence[SD3Sample]) -> str:
    c = model.config
    if any(b.attn2 is not None for b in model.transformer_blocks):
        return "SD3.5 Medium's dual-attention layers (dual_attention_layers) are not supported"

    def of(i: int, s: SD3Sample):
        p, most = c.patch_size, c.pos_embed_max_size * c.patch_size
        yield seam.grid_problem(i, "latents", s.latents, c.in_channels, (p, p), "H, W", most)
        yield seam.rows_problem(i, "text", s.text, c.joint_attention_dim, rows="T_txt")
        yield seam.shape_problem(i, "pooled", s.pooled, (c.pooled_projection_dim,))
        yield seam.scalar_problem(i, "timestep", s.timestep)

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


def packed_sd3_forward(model, samples: Sequence[SD3Sample], executor: TokenExecutor | None = None) -> seam.PackedOutput:
    """Outputs (C, H, W) for each sample, in order; differentiable. ``executor``: a balancer
    planned with ``sd3_seq_lens(model, samples)`` on every rank, a ``LocalExecutor``, or None."""
    return seam.through_root(model, lambda: _packed_sd3(model, samples, executor))


def _packed_sd3(model, samples: Sequence[SD3Sample], executor: TokenExecutor | None = None) -> seam.PackedOutput:
    """:func:`packed_sd3_forward`'s work, run as the model's own call (``seam.through_root``)."""
    c, device, dtype = seam.begin(model, samples, executor, prepare_sd3, _problem, model.context_embedder.weight)
    pk = seam.Packing(
        [(_tokens(s, c.patch_size), s.text.shape[0]) for s in samples], {"img": (0,), "txt": (1,)}, device
    )
    # 1. embed at home: each latent with its own positional crop (every embedder runs: all get grads)
    img = seam.embed_latents(model.pos_embed, model.pos_embed.proj, [s.latents for s in samples], device, dtype)
    txt = model.context_embedder(
        seam.cat_or_empty([s.text for s in samples], (0, c.joint_attention_dim), device, dtype)
    )
    pooled = seam.cat_or_empty([s.pooled[None] for s in samples], (0, c.pooled_projection_dim), device, dtype)
    temb = model.time_text_embed(seam.stack_scalars([s.timestep for s in samples], device), pooled)
    # 2. route; the per-sample temb to the group
    r = pk.route(executor, pk.merge(img, txt), per_sample=(temb,), names=("temb",))
    # modulation per sample present here only (its FLOPs do not grow with the group)
    st = seam.PerSample(r.present_rows(r.per_sample[0]), {"img": r.slot_of("img"), "txt": r.slot_of("txt")})
    img_s, txt_s = r.take(r.h, "img").unsqueeze(1), r.take(r.h, "txt").unsqueeze(1)  # (T, 1, D)
    # 3. the stock joint blocks (the last one returns no text)
    for block in model.transformer_blocks:
        txt_s, img_s = seam.call_block(model, block, img_s, txt_s, st, {"packed": r})
    # 4. the output head on image tokens, back home, unpatchified per sample
    out = model.proj_out(model.norm_out(img_s, st))[:, 0]
    rows = r.home(r.merge(out, out.new_zeros(r.count("txt"), out.shape[1])), 0)
    p = c.patch_size
    grids = [(s.latents.shape[1] // p, s.latents.shape[2] // p) for s in samples]
    return seam.PackedOutput.of(seam.unpatchify(rows, grids, (p, p)), rows)


def samples_from_batch(batch, cfg: DiffusersSD3Config, *, seed: int) -> list[SD3Sample]:
    """SD3 samples from a synthetic :class:`~knapformer.data.batches.Batch`: each sequence's
    visual rows one image on the most square exact grid, its text rows random text states."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in seam.batch_samples(batch):
        rows, h, w = seam.square_image(s, cfg.in_dim)
        lat = seam.unpatchify(rows, [(h, w)], (cfg.patch_size,) * 2)[0]
        text = torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype)
        out.append(SD3Sample(latents=lat, text=text, pooled=s.vec[: cfg.vec_dim], timestep=s.timestep * 1000))
    return out


class SD3Family(seam.PackedFamily):
    """Stock diffusers ``SD3Transformer2DModel`` for the tools (presets ``diffusers-sd3-tiny``,
    ``-3-medium`` and ``-3.5-large``)."""

    name = "diffusers-sd3"
    presets = SD3_PRESETS
    build_model, packed_forward = staticmethod(build_sd3), staticmethod(packed_sd3_forward)
    synthetic = staticmethod(samples_from_batch)

    def seq_lens(self, samples):
        return _lengths(samples, self.config.patch_size)

    def target_rows(self, samples):
        return [_tokens(s, self.config.patch_size) for s in samples]
