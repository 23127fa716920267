"""Packed, variable-length (and balanced) forward of a stock diffusers ``QwenImageTransformer2DModel``.

    from knapformer.integrations.qwenimage import QwenImageSample, packed_qwenimage_forward, qwenimage_seq_lens
    bal.plan(qwenimage_seq_lens(model, samples))           # once per step: text + image tokens per sample
    outs = packed_qwenimage_forward(model, samples, bal)    # list of (T_img_i, C_out) tensors

Each sample brings its own resolution, text (with its encoder mask, or unpadded), timestep and,
for edit models, reference images (after the target's tokens, as the stock pipeline joins them;
their outputs are dropped). Through the family seam (:mod:`knapformer.integrations.seam`),
what is Qwen-Image's own:

- **Modulation**: each block's ``img_mod(temb)`` and ``txt_mod(temb)`` run once per *sample*
  (``temb`` holds the samples this rank has tokens of; the block chunks it itself, so a block
  pre-hook notes the token rows from its ``joint_attention_kwargs``).
- **``modulate_index``** (``zero_cond_t`` edit models): the stock model embeds ``[t, 0]`` and
  modulates the first image's tokens with the first, every later (reference) image's with the
  second; here ``temb`` holds the ``t`` rows then the zero-timestep rows and the hook picks
  each image token's row (what the stock ``torch.where`` selects).
- **MSRoPE**: each token carries three integer positions, placed as the stock ``QwenEmbedRope``
  places them (image rows/columns centred, frame = image index; text token ``j`` of the padded
  text at ``m + j`` on all three axes, ``m`` the sample's largest half-side; a layered model's
  condition image at frame -1). They travel with the routed tokens and index the model's own
  ``pos_freqs``/``neg_freqs``; the stock ``apply_rotary_emb_qwen`` rotates q and k.
- **Text masks**: masked-out text tokens are dropped (the stock processor masks them as keys,
  so they never reach a kept token); kept tokens keep their positions.

Exactness: fp64 outputs and gradients equal the stock per-sample forward to ~1e-15. The stock
RoPE rotates in fp32, so where the attention sums in another order (a ring plan) the next
layer may round that last bit either way: ~1e-9 (gradients ~5e-8). Not in the packed path: ControlNet residuals,
``attention_kwargs`` of your own, ``guidance`` (the stock branch for it cannot run).

Legend: T tokens (this rank's routed ones after routing), S samples, D hidden size.
Importing knapformer never imports diffusers; this module does (diffusers >= 0.35, < 0.43).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations import seam
from knapformer.integrations.configs_dit import QWENIMAGE_PRESETS, DiffusersQwenImageConfig
from knapformer.integrations.qwenimage_attention import (
    TABLE,
    PackedQwenAttnProcessor,
    QwenPacked,
    prepare_qwenimage,
    rope_rows,
)
from knapformer.workload import WorkloadModel

__all__ = [
    "DiffusersQwenImageConfig",
    "PackedQwenAttnProcessor",
    "PackedQwenImageOutput",
    "QwenImageFamily",
    "QwenImageSample",
    "build_qwenimage",
    "packed_qwenimage_forward",
    "prepare_qwenimage",
    "qwenimage_seq_lens",
    "qwenimage_workload",
    "samples_from_batch",
]


@dataclass
class QwenImageSample:
    """One training sample for a Qwen-Image model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed latent patches of the image(s) to denoise
    img_shapes: list[tuple[int, int, int]]
    """The stock ``img_shapes`` entry of this sample: the (frames, rows, columns) token grid of
    each image, the denoised one(s) first, then every reference image; their tokens sum to
    ``T_img + T_ref``."""
    text: torch.Tensor  # (L_txt, joint_attention_dim) text encoder states (padded or not)
    timestep: torch.Tensor  # () in [0, 1] (the pipeline's t / 1000; the model scales by 1000)
    text_mask: torch.Tensor | None = None
    """(L_txt,) the encoder's mask (stock ``encoder_hidden_states_mask``): False rows are dropped."""
    ref_latents: torch.Tensor | None = None
    """(T_ref, in_channels) reference-image tokens (edit models), after ``latents``; their
    outputs are dropped, as the stock pipeline slices them off."""
    additional_t_cond: int | None = None
    """The class index of ``use_additional_t_cond`` models (Qwen-Image-Layered's ``is_rgb``)."""

    @property
    def num_ref(self) -> int:
        return 0 if self.ref_latents is None else int(self.ref_latents.shape[0])

    def text_rows(self) -> torch.Tensor:
        """Indices of the kept text rows."""
        n = int(self.text.shape[0])
        if self.text_mask is None:
            return torch.arange(n)
        mask = torch.as_tensor(self.text_mask).reshape(-1).to(torch.bool).cpu().numpy()  # (a host mask: no sync)
        return torch.from_numpy(np.flatnonzero(mask))


class PackedQwenImageOutput(seam.PackedOutput):
    """Per-sample outputs (T_img_i, patch²·out_channels) in order (reference tokens' dropped),
    plus ``flat``: this rank's outputs as one tensor (see ``PackedOutput``)."""


def build_qwenimage(cfg: DiffusersQwenImageConfig):
    """Random-init ``QwenImageTransformer2DModel`` for a :class:`DiffusersQwenImageConfig`."""
    same = ("patch_size", "in_channels", "out_channels", "num_layers", "axes_dims_rope", "zero_cond_t")
    flags = ("use_additional_t_cond", "use_layer3d_rope")
    return seam.build_diffusers("QwenImageTransformer2DModel", cfg, *same, *flags, joint_attention_dim=cfg.text_dim)


def qwenimage_workload(model, *, gamma: float = 1.0) -> WorkloadModel:
    """The planner's cost model of a ``QwenImageTransformer2DModel``: each stream's block costs
    ``24·d²`` FLOPs per token (q/k/v/o plus a 4× MLP), one layer per block
    (``seam.diffusers_workload``)."""
    return seam.diffusers_workload(model, model.config.num_layers, gamma)


def qwenimage_seq_lens(model, samples: Sequence[QwenImageSample] | None = None) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (kept text, image, reference
    images): the lengths to plan the step with. Never raises for a malformed sample: the
    forward reports it on every rank of the group. The old form ``qwenimage_seq_lens(model, samples)``
    is deprecated."""
    _, samples = seam.model_and_samples("qwenimage_seq_lens", model, samples)
    return _lengths(samples)


def _lengths(samples: Sequence[QwenImageSample]) -> list[int]:
    return seam.safe_lens(lambda s: s.text_rows().numel() + s.latents.shape[0] + s.num_ref, samples)


# -- positions ---------------------------------------------------------------------------------------
def _positions(model, s: QwenImageSample) -> tuple[torch.Tensor, torch.Tensor]:
    """(text, image) integer RoPE positions (n, 3) of a sample, as the model's rope places them."""
    pe = model.pos_embed
    layered = model.config.use_layer3d_rope
    last, m, parts = len(s.img_shapes) - 1, 0, []
    for idx, (f, h, w) in enumerate(s.img_shapes):
        fr = torch.full((f,), -1) if layered and idx == last else torch.arange(idx, idx + f)
        hr, wr = torch.arange(h), torch.arange(w)
        if pe.scale_rope:
            hr, wr = hr - (h - h // 2), wr - (w - w // 2)
        parts.append(torch.stack(torch.meshgrid(fr, hr, wr, indexing="ij"), -1).reshape(-1, 3))
        m = max(m, h // 2, w // 2) if pe.scale_rope else max(m, h, w)
    if layered:
        m = max(m, last)
    txt = (s.text_rows() + m)[:, None].expand(-1, 3)
    return txt, torch.cat(parts)


def _problem(model, samples: Sequence[QwenImageSample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    c = model.config

    def of(i: int, s: QwenImageSample):
        yield seam.rows_problem(i, "latents", s.latents, c.in_channels, rows="T_img")
        yield seam.rows_problem(i, "text", s.text, c.joint_attention_dim, rows="L_txt")
        yield seam.mask_problem(i, "text_mask", s.text_mask, s.text.shape[0])
        shapes = s.img_shapes
        if not shapes or any(len(g) != 3 or min(int(v) for v in g) < 1 for g in shapes):
            yield f"sample {i}: img_shapes must be a non-empty list of positive (frames, rows, columns), got {shapes!r}"
        n_img, held = int(s.latents.shape[0]) + s.num_ref, sum(math.prod(g) for g in shapes)
        if held != n_img:
            yield f"sample {i}: img_shapes {shapes} hold {held} tokens; latents + ref_latents have {n_img}"
        yield seam.scalar_problem(i, "timestep", s.timestep)
        yield seam.rows_problem(i, "ref_latents", s.ref_latents, c.in_channels, optional=True, rows="T_ref")
        if c.use_layer3d_rope and shapes[-1][0] != 1:
            yield f"sample {i}: a layered model's last (condition) image must have 1 frame, got {shapes[-1]}"
        if c.use_additional_t_cond and s.additional_t_cond is None:
            yield f"sample {i}: this model has use_additional_t_cond: every sample needs additional_t_cond"
        txt, img = _positions(model, s)
        hi = max(int(img.numpy().max()), int(txt.numpy().max()) if txt.numel() else 0)  # (host positions)
        if hi >= TABLE or int(img.numpy().min()) < -TABLE:
            yield f"sample {i}: RoPE position {hi} (text after the image) exceeds the model's table ({TABLE})"

    return seam.first(p for i, s in enumerate(samples) for p in of(i, s))


# -- forward -------------------------------------------------------------------------------------------
def packed_qwenimage_forward(
    model, samples: Sequence[QwenImageSample], executor: TokenExecutor | None = None
) -> PackedQwenImageOutput:
    """Outputs (T_img_i, patch²·out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``qwenimage_seq_lens(model, samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    return seam.through_root(model, lambda: _packed_qwenimage(model, samples, executor))


def _packed_qwenimage(
    model, samples: Sequence[QwenImageSample], executor: TokenExecutor | None = None
) -> PackedQwenImageOutput:
    """:func:`packed_qwenimage_forward`'s work, run as the model's own call (``seam.through_root``)."""
    c, device, dtype = seam.begin(model, samples, executor, prepare_qwenimage, _problem, model.img_in.weight)
    keep = [s.text_rows() for s in samples]
    img_lens = [int(s.latents.shape[0]) + s.num_ref for s in samples]
    pk = seam.Packing([(k.numel(), n) for k, n in zip(keep, img_lens)], _STREAMS, device)
    # 1. embed at home: every embedder runs (on empty inputs too), so every parameter gets a gradient
    vis = [torch.cat([s.latents, s.ref_latents]) if s.num_ref else s.latents for s in samples]
    img_h = model.img_in(seam.cat_or_empty(vis, (0, c.in_channels), device, dtype))
    txt = [s.text.index_select(0, k) for s, k in zip(samples, keep)]
    txt_h = model.txt_in(model.txt_norm(seam.cat_or_empty(txt, (0, c.joint_attention_dim), device, dtype)))
    ts = seam.stack_scalars([s.timestep for s in samples], device, dtype)
    extra = None
    if c.use_additional_t_cond:
        extra = torch.tensor([int(s.additional_t_cond) for s in samples], dtype=torch.long, device=device)
    temb = model.time_text_embed(ts, img_h, extra)  # (S, D): once per sample, as the stock batch
    zero = model.time_text_embed(ts * 0, img_h, extra) if c.zero_cond_t else temb[:, :0]
    pos = seam.cat_or_empty([torch.cat(_positions(model, s)) for s in samples], (0, 3), device, torch.int64)
    first_img = torch.tensor([math.prod(s.img_shapes[0]) for s in samples], dtype=torch.int64)
    first_img = first_img.to(device, non_blocking=True)
    # 2. route (with the RoPE positions); per-sample conditioning to the group
    r = pk.route(executor, pk.merge(txt_h, img_h), pos, per_sample=(temb, zero, first_img), names=_GATHERED)
    temb_all, zero_all, first_all = r.per_sample
    img_rows = r.slot_of("img")
    if c.zero_cond_t:  # modulate_index: reference-image tokens take the zero-timestep rows
        ref = r.offset("img") >= first_all.index_select(0, r.sample_of("img"))
        img_rows = img_rows + ref.to(img_rows.dtype) * r.present.numel()
    temb_p = r.present_rows(temb_all)
    block_temb = torch.cat([temb_p, r.present_rows(zero_all)]) if c.zero_cond_t else temb_p
    packed = QwenPacked(r, img_rows, r.slot_of("txt"))
    freqs = rope_rows(model, r.side[0])
    rope = (r.take(freqs, "img"), r.take(freqs, "txt"))
    txt_s, img_s = r.take(r.h, "txt").unsqueeze(1), r.take(r.h, "img").unsqueeze(1)  # (T, 1, D)
    # 3. stock double-stream blocks
    for block in model.transformer_blocks:
        txt_s, img_s = seam.call_block(model, block, img_s, txt_s, None, block_temb, rope, {"packed": packed}, None)
    # 4. the stock output norm with each image token's own row, the projection, back home
    mod = model.norm_out.linear(model.norm_out.silu(temb_p).to(dtype)).index_select(0, r.slot_of("img"))
    scale, shift = torch.chunk(mod, 2, dim=1)
    out_img = model.proj_out(model.norm_out.norm(img_s) * (1 + scale)[:, None, :] + shift[:, None, :])[:, 0]
    rows = r.home(r.merge(out_img.new_zeros(r.count("txt"), out_img.shape[1]), out_img), 1)
    parts = [v[: s.latents.shape[0]] for v, s in zip(pk.split(rows, 1), samples)]  # reference outputs dropped
    return PackedQwenImageOutput.of(parts, torch.cat(parts) if parts else rows)


_STREAMS = {"txt": (0,), "img": (1,)}
_GATHERED = ("time embedding", "zero-timestep embedding", "first-image tokens")


def samples_from_batch(batch, cfg: DiffusersQwenImageConfig, *, seed: int) -> list[QwenImageSample]:
    """Qwen-Image samples from a synthetic :class:`~knapformer.data.batches.Batch`: each
    sequence's visual rows become one image on the most square exact grid (a text-only sequence
    gets a 1-token stand-in), its text rows random text states."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in seam.batch_samples(batch):
        rows, h, w = seam.square_image(s, cfg.in_dim)
        text = torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype)
        extra = 0 if cfg.use_additional_t_cond else None
        out.append(QwenImageSample(rows, [(1, h, w)], text, s.timestep, additional_t_cond=extra))
    return out


class QwenImageFamily(seam.PackedFamily):
    """Stock diffusers ``QwenImageTransformer2DModel`` for the tools (presets
    ``diffusers-qwenimage-tiny`` and ``diffusers-qwenimage-20b``, the released size)."""

    name = "diffusers-qwenimage"
    presets = QWENIMAGE_PRESETS
    build_model, packed_forward = staticmethod(build_qwenimage), staticmethod(packed_qwenimage_forward)
    synthetic, lengths = staticmethod(samples_from_batch), staticmethod(_lengths)

    def blocks(self, device, dtype, causal):
        """One stock block on packed tokens of the given lengths (an eighth of each sequence
        text, the rest image), through a ``LocalExecutor``."""
        cfg = self.config
        model = self.block_model(device, dtype, causal, num_layers=1)
        prepare_qwenimage(model)
        block = model.transformer_blocks[0]

        def make(seq_lens, backward):
            r = seam.timing_tokens(seq_lens, _STREAMS, device)
            packed = QwenPacked(r, r.sample_of("img"), r.sample_of("txt"))
            freqs = rope_rows(model, r.side[0])
            rope = (r.take(freqs, "img"), r.take(freqs, "txt"))
            x = lambda n: torch.randn(n, 1, cfg.dim, device=device, dtype=dtype, requires_grad=backward)  # noqa: E731
            img, txt = x(r.count("img")), x(r.count("txt"))
            temb = torch.randn(len(seq_lens), cfg.dim, device=device, dtype=dtype)

            def run():
                enc, hid = block(img, txt, None, temb, rope, {"packed": packed}, None)
                return torch.cat([enc, hid])

            return seam.block_runner(run, backward)

        return [("qwenimage", cfg.num_layers, make)]
