"""Packed, variable-length (and balanced) forward of a stock diffusers ``FluxTransformer2DModel``.

    from knapformer.integrations.flux import FluxSample, flux_seq_lens, packed_flux_forward
    bal.plan(flux_seq_lens(samples))                        # once per step, like any model
    outs = packed_flux_forward(model, samples, bal)          # list of (T_img_i, C) tensors

Each sample brings its own resolution, text length, timestep, guidance and RoPE ids; the
model's own modules and weights do all the math. How it works with *stock* block forwards:

- **Layout "batch = tokens"**: activations are ``[T, 1, D]`` — every token is its own batch
  row, so the blocks' AdaLN modulation (``[B, D]`` broadcast over the sequence) becomes
  per-token modulation when ``temb`` is given per token. Double blocks get text tokens as
  ``encoder_hidden_states`` and image tokens as ``hidden_states``; single blocks get all
  tokens as ``hidden_states`` and an empty ``[T, 0, D]`` text tensor.
- Modulation at stock cost: every AdaLN norm computes ``linear(silu(temb))`` once per *sample*
  (a forward pre-hook on each block's ``norm1``/``norm1_context``/``norm`` and on ``norm_out``,
  per instance, hands it the per-sample ``temb`` of a :class:`_StreamTemb`), and a forward hook
  on that norm's ``linear`` expands the (samples, k·D) result to the stream's tokens with one
  ``index_select`` — exact, and no (tokens, D) matmul. For a plain tensor the hooks do
  nothing, so the stock API keeps working unchanged.
- The attention processor (:class:`PackedFluxAttnProcessor`, set per instance) computes
  q/k/v with the stock projections and norms, applies RoPE with the stock function, and runs
  attention within each sample — through ``SequenceBalancer.attention`` (Ulysses inside
  bags) or local varlen attention. Without the ``packed`` argument it delegates to the stock
  processor.
- Packed metadata travels as ``joint_attention_kwargs`` (an argument of every block call, so
  activation-checkpoint recompute sees it); blocks always run as their own ``forward`` (FSDP2
  per block works).
- The executor is planned by the caller, once per step, with :func:`flux_seq_lens` (text +
  image tokens of each sample): a ``SequenceBalancer`` routes tokens right after the
  embedders, shares the per-sample ``temb`` with ``gather_sequences``, carries RoPE ids with
  the tokens and routes the image outputs back before they are split per sample; without one
  (or with a ``LocalExecutor``) attention runs within each sample on this process.

Importing knapformer never imports diffusers; this module does, and needs
``pip install 'knapformer[diffusers]'`` (diffusers >= 0.35, < 0.43).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor, local_positions
from knapformer.integrations._diffusers import (
    PackedOutput,
    batch_samples,
    call_block,
    cat_or_empty,
    executor_or_local,
    grid_ids,
    raise_sample_problem,
    require_diffusers,
    stack_scalars,
    visual_targets,
)
from knapformer.integrations.configs import FLUX_PRESETS, DiffusersFluxConfig
from knapformer.integrations.family import ModelFamily, StepInputs
from knapformer.models.layers import merge_streams, split_streams

__all__ = [
    "DiffusersFluxConfig",
    "FluxFamily",
    "FluxSample",
    "PackedFluxAttnProcessor",
    "PackedFluxOutput",
    "build_flux",
    "flux_seq_lens",
    "flux_workload",
    "packed_flux_forward",
    "prepare_flux",
    "require_diffusers",
    "samples_from_batch",
]


@dataclass
class FluxSample:
    """One training sample for a Flux model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed latent patches
    text: torch.Tensor  # (T_txt, joint_attention_dim) text encoder states
    pooled: torch.Tensor  # (pooled_projection_dim,)
    timestep: torch.Tensor  # () in [0, 1]
    img_ids: torch.Tensor  # (T_img, 3)
    txt_ids: torch.Tensor  # (T_txt, 3)
    guidance: torch.Tensor | None = None  # () for guidance-distilled models

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0])


class PackedFluxOutput(PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order, plus ``flat``: all of this rank's image
    outputs as one (T_img, C) tensor (see :class:`~knapformer.integrations._diffusers.PackedOutput`)."""


class _StreamTemb:
    """Per-sample conditioning (S, D) and, per stream, the sample of each of its tokens; the
    norm hooks modulate per sample and expand to the stream's tokens."""

    def __init__(self, per_sample: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        self.per_sample, self.rows = per_sample, rows


def _pick(stream: str):
    """Pre-hook of an AdaLN norm: per-sample ``emb`` in, the stream's token->sample rows noted
    on the norm's ``linear`` for :func:`_expand`."""

    def hook(module, args, kwargs):
        if isinstance(kwargs.get("emb"), _StreamTemb):
            emb = kwargs["emb"]
            kwargs = {**kwargs, "emb": emb.per_sample}
        elif len(args) > 1 and isinstance(args[1], _StreamTemb):  # AdaLayerNormContinuous(x, emb)
            emb = args[1]
            args = (args[0], emb.per_sample, *args[2:])
        else:
            return None
        module.linear._knapformer_rows = emb.rows[stream]
        return args, kwargs

    return hook


def _expand(linear, inputs, output):
    """Forward hook of a norm's ``linear``: (samples, k·D) modulation -> one row per token."""
    rows = getattr(linear, "_knapformer_rows", None)
    if rows is None:
        return None
    linear._knapformer_rows = None
    return output.index_select(0, rows)


@dataclass
class _Packed:
    """Metadata of the tokens this rank holds (joint order = all text rows, then all image rows)."""

    executor: TokenExecutor
    to_routed: torch.Tensor  # joint order -> routed order
    from_routed: torch.Tensor  # routed order -> joint order
    num_txt: int


class PackedFluxAttnProcessor:
    """Flux attention over packed ``[T, 1, D]`` tokens; stock behaviour when not packed."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

        self._stock = FluxAttnProcessor()

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        image_rotary_emb=None,
        packed: _Packed | None = None,
    ):
        if packed is None:
            return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        heads = (t.unflatten(-1, (-1, attn.head_dim)).squeeze(1) for t in (q, k, v))  # (T, H, Dh)
        q, k, v = heads
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)).squeeze(1) for t in (eq, ek, ev))
            eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
            q, k, v = torch.cat([eq, q]), torch.cat([ek, k]), torch.cat([ev, v])
        if image_rotary_emb is not None and q.shape[0]:  # stock function, sequence = token dim
            q = apply_rotary_emb(q.unsqueeze(0), image_rotary_emb, sequence_dim=1)[0]
            k = apply_rotary_emb(k.unsqueeze(0), image_rotary_emb, sequence_dim=1)[0]
        q, k, v = (t.index_select(0, packed.to_routed) for t in (q, k, v))
        o = packed.executor.attention(q, k, v).index_select(0, packed.from_routed)
        o = o.flatten(1, 2).unsqueeze(1).to(q.dtype)  # (T, 1, H*Dh)
        if encoder_hidden_states is None:
            return o
        enc, img = o[: packed.num_txt], o[packed.num_txt :]
        img = attn.to_out[1](attn.to_out[0](img.contiguous()))
        enc = attn.to_add_out(enc.contiguous())
        return img, enc


def build_flux(cfg):
    """Random-init ``FluxTransformer2DModel`` for a :class:`DiffusersFluxConfig` (no download)."""
    require_diffusers()
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=cfg.in_dim,
        num_layers=cfg.num_double,
        num_single_layers=cfg.num_single,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.text_dim,
        pooled_projection_dim=cfg.vec_dim,
        guidance_embeds=False,
        axes_dims_rope=cfg.axes_dims_rope,
    )


def samples_from_batch(batch, cfg, *, seed: int) -> list[FluxSample]:
    """Flux samples from a synthetic :class:`~knapformer.data.batches.Batch` (text tokens first
    in each sequence; image ids on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    return [
        FluxSample(
            latents=s.visual[:, : cfg.in_dim],
            text=torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype),
            pooled=s.vec[: cfg.vec_dim],
            timestep=s.timestep,
            img_ids=grid_ids(s.visual.shape[0]),
            txt_ids=torch.zeros(s.text.shape[0], 3, dtype=torch.float64),
        )
        for s in batch_samples(batch)
    ]


def prepare_flux(model) -> None:
    """Install the packed attention processor and the per-stream modulation hooks on this model
    instance only (the stock forward keeps its behaviour). Checks every call: an attention
    module whose processor was replaced since (``set_attn_processor``) gets the packed one
    again, and each norm is hooked once."""
    require_diffusers()
    proc = None
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        if not isinstance(block.attn.processor, PackedFluxAttnProcessor):
            proc = proc or PackedFluxAttnProcessor()
            block.attn.set_processor(proc)
    norms = [(b.norm1, "img") for b in model.transformer_blocks]
    norms += [(b.norm1_context, "txt") for b in model.transformer_blocks]
    norms += [(b.norm, "all") for b in model.single_transformer_blocks]
    norms += [(model.norm_out, "img")]
    for norm, stream in norms:
        if not getattr(norm, "_knapformer_hooked", False):
            norm.register_forward_pre_hook(_pick(stream), with_kwargs=True)
            norm.linear.register_forward_hook(_expand)
            norm._knapformer_hooked = True


def flux_workload(model, *, gamma: float = 1.0):
    """The planner's cost model of a ``FluxTransformer2DModel`` from its config: d_model is the
    inner width (heads × head dim; the stock blocks cost ``24·d²`` FLOPs per token in either
    stream: q/k/v/o plus a 4× MLP, or the single blocks' fused equivalent), every double and
    single block is a layer, and the heads bound the Ulysses degrees ``auto`` may choose."""
    from knapformer.workload import WorkloadModel

    c = model.config
    return WorkloadModel(
        d_model=c.num_attention_heads * c.attention_head_dim,
        gamma=gamma,
        num_layers=c.num_layers + c.num_single_layers,
        num_heads=c.num_attention_heads,
    )


def flux_seq_lens(samples: Sequence[FluxSample]) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, then its image):
    the lengths to plan the step with."""
    return [int(s.text.shape[0]) + int(s.latents.shape[0]) for s in samples]


def packed_flux_forward(
    model, samples: Sequence[FluxSample], executor: TokenExecutor | None = None
) -> PackedFluxOutput:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``flux_seq_lens(samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    prepare_flux(model)
    device = model.x_embedder.weight.device
    dtype = model.x_embedder.weight.dtype
    txt_lens = [int(s.text.shape[0]) for s in samples]
    img_lens = [int(s.latents.shape[0]) for s in samples]
    seq_lens = [t + i for t, i in zip(txt_lens, img_lens)]
    D = model.inner_dim
    # 1. embed locally (every embedder runs, possibly on empty inputs: all params get grads)
    lat = cat_or_empty([s.latents for s in samples], (0, model.config.in_channels), device, dtype)
    txt = cat_or_empty([s.text for s in samples], (0, model.config.joint_attention_dim), device, dtype)
    img_h = model.x_embedder(lat)
    txt_h = model.context_embedder(txt)
    ts = stack_scalars([s.timestep for s in samples], device, dtype) * 1000
    pooled = cat_or_empty([s.pooled[None] for s in samples], (0, model.config.pooled_projection_dim), device, dtype)
    if model.config.guidance_embeds:
        if any(s.guidance is None for s in samples):
            raise_sample_problem(executor, "this model is guidance-distilled: every FluxSample needs a guidance value")
        guidance = stack_scalars([s.guidance for s in samples], device, dtype) * 1000
        temb = model.time_text_embed(ts, guidance, pooled)
    else:
        temb = model.time_text_embed(ts, pooled)
    # local token order: per sample, text then image
    seq_l, pos_l = local_positions(seq_lens, device)
    tl = torch.tensor(txt_lens, dtype=torch.int64, device=device)
    is_txt_l = pos_l < tl[seq_l] if seq_l.numel() else torch.zeros(0, dtype=torch.bool, device=device)
    i_txt, i_img, inv = split_streams(is_txt_l)
    h_local = merge_streams(txt_h, img_h, inv)  # (T, D) in local order
    ids = cat_or_empty([torch.cat([s.txt_ids, s.img_ids]) for s in samples], (0, 3), device, None)
    # 2. route (a local executor keeps everything in place)
    ex = executor_or_local(executor, seq_lens)
    h, ids_r = ex.route(h_local, ids.to(torch.float64), seq_lens=seq_lens)
    temb_all, txt_all = ex.gather_sequences(temb, tl)
    seq_id, pos = ex.routed_positions(device)
    is_txt = pos < txt_all.index_select(0, seq_id)
    r_txt, r_img, r_inv = split_streams(is_txt)
    joint = torch.cat([r_txt, r_img])  # joint order -> routed rows
    # joint row j is routed row joint[j]; routed row i is joint row r_inv[i]
    packed = _Packed(executor=ex, to_routed=r_inv, from_routed=joint, num_txt=int(r_txt.numel()))
    rope = model.pos_embed(ids_r.index_select(0, joint)) if joint.numel() else None
    # per-sample conditioning, expanded to the tokens only after each norm's linear
    sample_txt, sample_img = seq_id.index_select(0, r_txt), seq_id.index_select(0, r_img)
    st = _StreamTemb(temb_all, {"txt": sample_txt, "img": sample_img, "all": torch.cat([sample_txt, sample_img])})
    txt_s = h.index_select(0, r_txt).unsqueeze(1)  # (T_txt, 1, D)
    img_s = h.index_select(0, r_img).unsqueeze(1)
    kw = {"packed": packed}
    # 3. double blocks (stock forwards), then single blocks over all tokens
    for block in model.transformer_blocks:
        txt_s, img_s = call_block(model, block, img_s, txt_s, st, rope, kw)
    allt = torch.cat([txt_s, img_s])  # joint order
    empty = allt.new_zeros(allt.shape[0], 0, D)
    for block in model.single_transformer_blocks:
        _, allt = call_block(model, block, allt, empty, st, rope, kw)
    img_s = allt[packed.num_txt :]
    # 4. output head on image tokens (per-token norm_out modulation), back to routed order
    out_img = model.proj_out(model.norm_out(img_s, st))[:, 0]  # (R_img, C)
    out = merge_streams(out_img.new_zeros(packed.num_txt, out_img.shape[1]), out_img, r_inv)
    out_local = ex.reverse_route(out)  # (T, C) local order
    img_rows = out_local.index_select(0, i_img)
    return PackedFluxOutput.of(torch.split(img_rows, img_lens) if img_lens else [], img_rows)


class FluxFamily(ModelFamily):
    """Stock diffusers ``FluxTransformer2DModel`` for the tools (preset ``diffusers-flux-tiny``)."""

    name = "diffusers-flux"
    presets = FLUX_PRESETS

    def build(self):
        return build_flux(self.config)

    def inputs(self, batch):
        """Flux samples of a batch and the targets of their image rows (the loss is on images)."""
        samples = samples_from_batch(batch, self.config, seed=0)
        target = visual_targets(batch, [s.latents.shape[0] for s in samples])
        return StepInputs(seq_lens=flux_seq_lens(samples), args=samples, target=target)

    def forward(self, model, inputs, executor):
        return packed_flux_forward(getattr(model, "module", model), inputs.args, executor).flat
