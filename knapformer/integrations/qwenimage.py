"""Packed, variable-length (and balanced) forward of a stock diffusers ``QwenImageTransformer2DModel``.

    from knapformer.integrations.qwenimage import QwenImageSample, packed_qwenimage_forward, qwenimage_seq_lens
    bal.plan(qwenimage_seq_lens(samples))                  # once per step: text + image tokens per sample
    outs = packed_qwenimage_forward(model, samples, bal)    # list of (T_img_i, C_out) tensors

Each sample brings its own resolution, text (with its encoder mask, or unpadded), timestep and,
for edit models, reference images (after the target's tokens, as the stock pipeline joins them;
their outputs are dropped). The model's own modules and weights do all the math; nothing is
patched globally. How:

- **"batch = tokens"**: activations are ``[T, 1, D]``; each block's ``img_mod(temb)`` and
  ``txt_mod(temb)`` run once per *sample* (the block's ``temb`` holds the samples this rank has
  tokens of) and a forward hook on each expands the (samples, 6·D) result to the stream's tokens
  by index: the stock FLOPs. A forward pre-hook on the block reads which rows from its
  ``joint_attention_kwargs`` argument, so activation-checkpoint recompute sees them.
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
- :class:`PackedQwenAttnProcessor` (set on this instance) attends within each sample through
  the executor (Ulysses inside the sample's group; rings beyond the heads).

Exactness: fp64 outputs and gradients equal the stock per-sample forward to ~1e-15. The stock
RoPE rotates in fp32, so where the attention sums in another order (a ring plan) the next
layer may round that last bit either way: ~1e-9 (gradients ~5e-8). Not in the packed path: ControlNet residuals,
``attention_kwargs`` of your own, ``guidance`` (the stock branch for it cannot run).

Legend: T tokens (this rank's routed ones after routing), S samples, D hidden size.
Importing knapformer never imports diffusers; this module does (diffusers >= 0.35, < 0.43).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.integrations._diffusers import (
    PackedOutput,
    batch_samples,
    call_block,
    cat_or_empty,
    executor_or_local,
    raise_sample_problem,
    require_diffusers,
    stack_scalars,
)
from knapformer.integrations.configs_dit import QWENIMAGE_PRESETS, DiffusersQwenImageConfig
from knapformer.integrations.family import ModelFamily, StepInputs, block_runner
from knapformer.integrations.qwenimage_attention import (
    TABLE,
    PackedQwenAttnProcessor,
    QwenPacked,
    prepare_qwenimage,
    rope_rows,
)
from knapformer.models.layers import merge_streams, split_streams
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
        return torch.nonzero(torch.as_tensor(self.text_mask).reshape(-1).to(torch.bool).cpu()).flatten()


class PackedQwenImageOutput(PackedOutput):
    """Per-sample outputs (T_img_i, patch²·out_channels) in order (reference tokens' dropped),
    plus ``flat``: this rank's outputs as one tensor (see ``PackedOutput``)."""


def build_qwenimage(cfg: DiffusersQwenImageConfig):
    """Random-init ``QwenImageTransformer2DModel`` for a :class:`DiffusersQwenImageConfig`."""
    require_diffusers()
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=cfg.patch_size,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.text_dim,
        axes_dims_rope=cfg.axes_dims_rope,
        zero_cond_t=cfg.zero_cond_t,
        use_additional_t_cond=cfg.use_additional_t_cond,
        use_layer3d_rope=cfg.use_layer3d_rope,
    )


def qwenimage_workload(model, *, gamma: float = 1.0) -> WorkloadModel:
    """The planner's cost model of a ``QwenImageTransformer2DModel``: each stream's block costs
    ``24·d²`` FLOPs per token (q/k/v/o plus a 4× MLP), so the paper's form with the inner width,
    one layer per block, and the heads bounding the Ulysses degrees."""
    c = model.config
    return WorkloadModel(
        d_model=c.num_attention_heads * c.attention_head_dim,
        gamma=gamma,
        num_layers=c.num_layers,
        num_heads=c.num_attention_heads,
    )


def qwenimage_seq_lens(samples: Sequence[QwenImageSample]) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (kept text, image, reference
    images): the lengths to plan the step with. Never raises for a malformed sample: the
    forward reports it on every rank of the group."""
    out = []
    for s in samples:
        try:
            out.append(int(s.text_rows().numel()) + int(s.latents.shape[0]) + s.num_ref)
        except (AttributeError, IndexError, RuntimeError, TypeError):
            out.append(0)
    return out


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
    for i, s in enumerate(samples):
        if s.latents.dim() != 2 or s.latents.shape[1] != c.in_channels:
            return f"sample {i}: latents must be (T_img, {c.in_channels}), got {tuple(s.latents.shape)}"
        if s.text.dim() != 2 or s.text.shape[1] != c.joint_attention_dim:
            return f"sample {i}: text must be (L_txt, {c.joint_attention_dim}), got {tuple(s.text.shape)}"
        if s.text_mask is not None and tuple(torch.as_tensor(s.text_mask).shape) != (s.text.shape[0],):
            return (
                f"sample {i}: text_mask must be ({s.text.shape[0]},), got {tuple(torch.as_tensor(s.text_mask).shape)}"
            )
        shapes = s.img_shapes
        if not shapes or any(len(g) != 3 or min(int(v) for v in g) < 1 for g in shapes):
            return (
                f"sample {i}: img_shapes must be a non-empty list of positive (frames, rows, columns), got {shapes!r}"
            )
        n_img = int(s.latents.shape[0]) + s.num_ref
        if sum(math.prod(g) for g in shapes) != n_img:
            held = sum(math.prod(g) for g in shapes)
            return f"sample {i}: img_shapes {shapes} hold {held} tokens; latents + ref_latents have {n_img}"
        if torch.as_tensor(s.timestep).numel() != 1:
            return f"sample {i}: timestep must be one value, got {torch.as_tensor(s.timestep).numel()}"
        if s.ref_latents is not None and (s.ref_latents.dim() != 2 or s.ref_latents.shape[1] != c.in_channels):
            return f"sample {i}: ref_latents must be (T_ref, {c.in_channels}), got {tuple(s.ref_latents.shape)}"
        if c.use_layer3d_rope and shapes[-1][0] != 1:
            return f"sample {i}: a layered model's last (condition) image must have 1 frame, got {shapes[-1]}"
        if c.use_additional_t_cond and s.additional_t_cond is None:
            return f"sample {i}: this model has use_additional_t_cond: every sample needs additional_t_cond"
        txt, img = _positions(model, s)
        hi = max(int(img.max()), int(txt.max()) if txt.numel() else 0)
        if hi >= TABLE or int(img.min()) < -TABLE:
            return f"sample {i}: RoPE position {hi} (text after the image) exceeds the model's table ({TABLE})"
    return ""


# -- forward -------------------------------------------------------------------------------------------
def packed_qwenimage_forward(
    model, samples: Sequence[QwenImageSample], executor: TokenExecutor | None = None
) -> PackedQwenImageOutput:
    """Outputs (T_img_i, patch²·out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``qwenimage_seq_lens(samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    prepare_qwenimage(model)
    raise_sample_problem(executor, _problem(model, samples))
    c = model.config
    device, dtype = model.img_in.weight.device, model.img_in.weight.dtype
    keep = [s.text_rows() for s in samples]
    txt_lens = [int(k.numel()) for k in keep]
    img_lens = [int(s.latents.shape[0]) + s.num_ref for s in samples]
    seq_lens = [t + i for t, i in zip(txt_lens, img_lens)]
    # 1. embed at home: every embedder runs (on empty inputs too), so every parameter gets a gradient
    vis = [torch.cat([s.latents, s.ref_latents]) if s.num_ref else s.latents for s in samples]
    img_h = model.img_in(cat_or_empty(vis, (0, c.in_channels), device, dtype))
    txt = [s.text.index_select(0, k) for s, k in zip(samples, keep)]
    txt_h = model.txt_in(model.txt_norm(cat_or_empty(txt, (0, c.joint_attention_dim), device, dtype)))
    ts = stack_scalars([s.timestep for s in samples], device, dtype)
    extra = None
    if c.use_additional_t_cond:
        extra = torch.tensor([int(s.additional_t_cond) for s in samples], dtype=torch.long, device=device)
    temb = model.time_text_embed(ts, img_h, extra)  # (S, D): once per sample, as the stock batch
    zero = model.time_text_embed(ts * 0, img_h, extra) if c.zero_cond_t else temb[:, :0]
    pos = [torch.cat(_positions(model, s)) for s in samples]
    seq_l, pos_l = local_positions(seq_lens, device)
    tl = torch.tensor(txt_lens, dtype=torch.int64, device=device)
    first = torch.tensor([math.prod(s.img_shapes[0]) for s in samples], dtype=torch.int64, device=device)
    is_txt = pos_l < tl[seq_l] if seq_l.numel() else torch.zeros(0, dtype=torch.bool, device=device)
    _, i_img, inv = split_streams(is_txt)
    h_local = merge_streams(txt_h, img_h, inv)
    # 2. route (with the RoPE positions); per-sample conditioning to the group
    ex = executor_or_local(executor, seq_lens)
    h, pos_r = ex.route(h_local, cat_or_empty(pos, (0, 3), device, torch.int64), seq_lens=seq_lens)
    temb_all, zero_all, txt_all, first_all = ex.gather_sequences(temb, zero, tl, first, names=_GATHERED)
    seq_id, p = ex.routed_positions(device)
    present, slot = torch.unique(seq_id, sorted=True, return_inverse=True)  # samples with tokens here
    r_txt, r_img, r_inv = split_streams(p < txt_all.index_select(0, seq_id))
    img_rows = slot.index_select(0, r_img)
    if c.zero_cond_t:  # modulate_index: reference-image tokens take the zero-timestep rows
        q = p.index_select(0, r_img) - txt_all.index_select(0, seq_id.index_select(0, r_img))
        ref = q >= first_all.index_select(0, seq_id.index_select(0, r_img))
        img_rows = img_rows + ref.to(img_rows.dtype) * present.numel()
    temb_p = temb_all.index_select(0, present)
    block_temb = torch.cat([temb_p, zero_all.index_select(0, present)]) if c.zero_cond_t else temb_p
    joint = torch.cat([r_txt, r_img])
    packed = QwenPacked(ex, r_inv, joint, img_rows, slot.index_select(0, r_txt))
    freqs = rope_rows(model, pos_r)
    rope = (freqs.index_select(0, r_img), freqs.index_select(0, r_txt))
    txt_s, img_s = h.index_select(0, r_txt).unsqueeze(1), h.index_select(0, r_img).unsqueeze(1)  # (T, 1, D)
    # 3. stock double-stream blocks
    for block in model.transformer_blocks:
        txt_s, img_s = call_block(model, block, img_s, txt_s, None, block_temb, rope, {"packed": packed}, None)
    # 4. the stock output norm with each image token's own row, the projection, back home
    mod = model.norm_out.linear(model.norm_out.silu(temb_p).to(dtype)).index_select(0, slot.index_select(0, r_img))
    scale, shift = torch.chunk(mod, 2, dim=1)
    out_img = model.proj_out(model.norm_out.norm(img_s) * (1 + scale)[:, None, :] + shift[:, None, :])[:, 0]
    out = ex.reverse_route(merge_streams(out_img.new_zeros(r_txt.numel(), out_img.shape[1]), out_img, r_inv))
    out = out.index_select(0, i_img)  # image and reference rows, sample order
    n_out = [int(s.latents.shape[0]) for s in samples]
    parts = [r[:n] for r, n in zip(torch.split(out, img_lens), n_out)] if samples else []
    return PackedQwenImageOutput.of(parts, torch.cat(parts) if parts else out[:0])


_GATHERED = ("time embedding", "zero-timestep embedding", "text lengths", "first-image tokens")


def samples_from_batch(batch, cfg: DiffusersQwenImageConfig, *, seed: int) -> list[QwenImageSample]:
    """Qwen-Image samples from a synthetic :class:`~knapformer.data.batches.Batch`: each
    sequence's visual rows become one image on the most square exact grid (a text-only sequence
    gets a 1-token stand-in), its text rows random text states."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in batch_samples(batch):
        n = max(int(s.visual.shape[0]), 1)
        h = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
        rows = s.visual[:, : cfg.in_dim] if s.visual.shape[0] else batch.x.new_zeros(1, cfg.in_dim)
        text = torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype)
        extra = 0 if cfg.use_additional_t_cond else None
        out.append(QwenImageSample(rows, [(1, h, n // h)], text, s.timestep, additional_t_cond=extra))
    return out


class QwenImageFamily(ModelFamily):
    """Stock diffusers ``QwenImageTransformer2DModel`` for the tools (presets
    ``diffusers-qwenimage-tiny`` and ``diffusers-qwenimage-20b``, the released size)."""

    name = "diffusers-qwenimage"
    presets = QWENIMAGE_PRESETS

    def build(self):
        return build_qwenimage(self.config)

    def workload(self, gamma: float = 1.0) -> WorkloadModel:
        return self.config.workload(gamma)

    def inputs(self, batch):
        """Qwen-Image samples of a batch and the targets of their image rows (a text-only
        sequence's 1-token stand-in image gets a zero target)."""
        cfg = self.config
        samples = samples_from_batch(batch, cfg, seed=0)
        zero = batch.target.new_zeros(1, cfg.out_dim)
        parts = [s.target if s.visual.shape[0] else zero for s in batch_samples(batch)]
        target = torch.cat(parts) if parts else batch.target[:0]
        return StepInputs(seq_lens=qwenimage_seq_lens(samples), args=samples, target=target)

    def forward(self, model, inputs, executor):
        return packed_qwenimage_forward(getattr(model, "module", model), inputs.args, executor).flat

    def blocks(self, device, dtype, causal):
        """One stock block on packed tokens of the given lengths (an eighth of each sequence
        text, the rest image), through a ``LocalExecutor``."""
        if causal:
            raise ValueError("--causal applies to the transformer presets only (Qwen-Image attention is bidirectional)")
        cfg = self.config
        model = build_qwenimage(dataclasses.replace(cfg, num_layers=1)).to(device)
        if dtype != torch.float32:  # (a dtype argument, even float32, makes diffusers warn)
            model = model.to(dtype)
        prepare_qwenimage(model)
        block = model.transformer_blocks[0]

        def make(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            seq, p = local_positions(seq_lens, device)
            r_txt, r_img, r_inv = split_streams(p < torch.tensor([n // 8 for n in seq_lens], device=device)[seq])
            pos = torch.stack([torch.zeros_like(p), p // 64, p % 64], dim=1)
            freqs = rope_rows(model, pos)
            packed = QwenPacked(
                ex, r_inv, torch.cat([r_txt, r_img]), seq.index_select(0, r_img), seq.index_select(0, r_txt)
            )
            rope = (freqs.index_select(0, r_img), freqs.index_select(0, r_txt))
            x = lambda n: torch.randn(n, 1, cfg.dim, device=device, dtype=dtype, requires_grad=backward)  # noqa: E731
            img, txt = x(r_img.numel()), x(r_txt.numel())
            temb = torch.randn(len(seq_lens), cfg.dim, device=device, dtype=dtype)

            def run():
                enc, hid = block(img, txt, None, temb, rope, {"packed": packed}, None)
                return torch.cat([enc, hid])

            return block_runner(run, backward)

        return [("qwenimage", cfg.num_layers, make)]
