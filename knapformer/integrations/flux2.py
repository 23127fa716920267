"""Packed, variable-length (and balanced) forward of a stock diffusers ``Flux2Transformer2DModel``.

    from knapformer.integrations.flux2 import Flux2Sample, flux2_seq_lens, packed_flux2_forward
    bal.plan(flux2_seq_lens(samples))                        # once per step, like any model
    outs = packed_flux2_forward(model, samples, bal)          # list of (T_img_i, C) tensors

Each sample brings its own resolution, text length, timestep, guidance, RoPE ids and optional
reference-image tokens (Flux.2's multi-reference editing: they join the image stream with
their own ids, and their outputs are dropped, as the stock pipeline slices them off). The
model's own modules and weights do all the math; nothing is patched globally:

- **"batch = tokens"**: activations are ``[T, 1, D]``, so Flux.2's modulation — computed once
  per step from the time embedding and handed to every block (``temb_mod_img``,
  ``temb_mod_txt``, ``temb_mod``) — becomes per-token modulation when given one row per token.
  Each sample's modulation is computed once, by the stock modules, on the rank that holds the
  sample, gathered to the group (``gather_sequences``) and expanded to the routed tokens by
  index: no (tokens, D) matmul, the stock FLOPs. The per-token shift/scale tensors cost
  15·D values per token once per forward, and the blocks keep (T, D) products for backward
  where the stock batch keeps (1, D) ones.
- Two attention processors, set on this model instance only, compute q/k/v with the stock
  projections, norms and RoPE function and attend within each sample through the executor
  (Ulysses inside the sample's group, any degree): :class:`PackedFlux2AttnProcessor` for the
  double-stream blocks, :class:`PackedFlux2ParallelProcessor` for the single-stream ("parallel")
  blocks. Without the ``packed`` argument both delegate to the stock processors.
- The packed metadata travels as ``joint_attention_kwargs`` (an argument of every block call,
  so activation-checkpoint recompute sees it); blocks run as their own ``forward`` (FSDP2 per
  block works).

Importing knapformer never imports diffusers; this module does (diffusers >= 0.35, < 0.43,
with ``Flux2Transformer2DModel``: diffusers 0.42).
"""

from __future__ import annotations

import dataclasses
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
    visual_targets,
)
from knapformer.integrations.configs import FLUX2_PRESETS, DiffusersFlux2Config
from knapformer.integrations.family import ModelFamily, StepInputs, block_runner
from knapformer.models.layers import merge_streams, split_streams

__all__ = [
    "DiffusersFlux2Config",
    "Flux2Family",
    "Flux2Sample",
    "PackedFlux2AttnProcessor",
    "PackedFlux2Output",
    "PackedFlux2ParallelProcessor",
    "build_flux2",
    "flux2_seq_lens",
    "packed_flux2_forward",
    "prepare_flux2",
    "samples_from_batch",
]


@dataclass
class Flux2Sample:
    """One training sample for a Flux.2 model (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed latent patches
    text: torch.Tensor  # (T_txt, joint_attention_dim) text encoder states
    timestep: torch.Tensor  # () in [0, 1] (the model multiplies by 1000)
    img_ids: torch.Tensor  # (T_img, len(axes_dims_rope))
    txt_ids: torch.Tensor  # (T_txt, len(axes_dims_rope))
    guidance: torch.Tensor | None = None  # () for guidance-distilled models
    ref_latents: torch.Tensor | None = None
    """(T_ref, in_channels) reference-image tokens (multi-reference editing), or None."""
    ref_ids: torch.Tensor | None = None
    """(T_ref, len(axes_dims_rope)) their ids (Flux.2 offsets the first axis per reference)."""

    @property
    def num_ref(self) -> int:
        return 0 if self.ref_latents is None else int(self.ref_latents.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0]) + self.num_ref


class PackedFlux2Output(PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order (reference tokens' outputs dropped), plus
    ``flat``: this rank's image outputs as one tensor (see ``PackedOutput``)."""


@dataclass
class _Packed:
    """Metadata of the tokens this rank holds (joint order = all text rows, then all visual rows)."""

    executor: TokenExecutor
    to_routed: torch.Tensor  # joint order -> routed order
    from_routed: torch.Tensor  # routed order -> joint order


def _attend(packed: _Packed, q, k, v) -> torch.Tensor:
    """q, k, v (T, H, Dh) in joint order -> attention within each sample -> (T, 1, H·Dh)."""
    q, k, v = (t.index_select(0, packed.to_routed) for t in (q, k, v))
    o = packed.executor.attention(q, k, v).index_select(0, packed.from_routed)
    return o.flatten(1, 2).unsqueeze(1).to(q.dtype)


def _heads(attn, *tensors):
    """(T, 1, H·Dh) projections -> (T, 1, H, Dh)."""
    return (t.unflatten(-1, (-1, attn.head_dim)) for t in tensors)


def _rope(q, k, rope):
    """The stock rotary embedding on (T, H, Dh) with the token dimension as the sequence."""
    from diffusers.models.embeddings import apply_rotary_emb

    if rope is None or not q.shape[0]:
        return q, k
    return (apply_rotary_emb(t.unsqueeze(0), rope, sequence_dim=1)[0] for t in (q, k))


class PackedFlux2AttnProcessor:
    """Flux.2 double-stream attention over packed ``[T, 1, D]`` tokens; stock when not packed."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

        self._stock = Flux2AttnProcessor()

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, packed=None
    ):
        if packed is None:
            return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v, eq, ek, ev = _heads(attn, q, k, v, eq, ek, ev)
        q, k = attn.norm_q(q), attn.norm_k(k)
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        q, k, v = (torch.cat([e, t]).squeeze(1) for e, t in ((eq, q), (ek, k), (ev, v)))
        q, k = _rope(q, k, image_rotary_emb)
        o = _attend(packed, q, k, v)
        n_txt = encoder_hidden_states.shape[0]
        enc, img = o[:n_txt], o[n_txt:]
        return attn.to_out[1](attn.to_out[0](img)), attn.to_add_out(enc)


class PackedFlux2ParallelProcessor:
    """Flux.2 single-stream ("parallel") attention + MLP over packed tokens; stock when not packed."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttnProcessor

        self._stock = Flux2ParallelSelfAttnProcessor()

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None, packed=None):
        if packed is None:
            return self._stock(attn, hidden_states, attention_mask, image_rotary_emb)
        h = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = h.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)  # the stock split (TP-agnostic)
        qkv, mlp = torch.split(h, [local_qkv, h.shape[-1] - local_qkv], dim=-1)
        q, k, v = _heads(attn, *qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
        q, k = _rope(q, k, image_rotary_emb)
        o = _attend(packed, q, k, v)
        return attn.to_out(torch.cat([o, attn.mlp_act_fn(mlp)], dim=-1))


def build_flux2(cfg: DiffusersFlux2Config):
    """Random-init ``Flux2Transformer2DModel`` for a :class:`DiffusersFlux2Config` (no download)."""
    require_diffusers()
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=cfg.in_dim,
        num_layers=cfg.num_double,
        num_single_layers=cfg.num_single,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads,
        joint_attention_dim=cfg.text_dim,
        timestep_guidance_channels=32,
        axes_dims_rope=cfg.axes_dims_rope,
        guidance_embeds=cfg.guidance,
    )


def prepare_flux2(model) -> None:
    """Install the packed processors on this model instance only (checked every call: a module
    whose processor was replaced since, e.g. by ``set_attn_processor``, gets its own again)."""
    require_diffusers()
    for blocks, cls in (
        (model.transformer_blocks, PackedFlux2AttnProcessor),
        (model.single_transformer_blocks, PackedFlux2ParallelProcessor),
    ):
        proc = None
        for block in blocks:
            if not isinstance(block.attn.processor, cls):
                proc = proc or cls()
                block.attn.set_processor(proc)


def flux2_seq_lens(samples: Sequence[Flux2Sample]) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, its image, its
    reference tokens): the lengths to plan the step with."""
    return [s.num_tokens for s in samples]


def _problem(model, samples: Sequence[Flux2Sample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    c = model.config
    axes = len(c.axes_dims_rope)
    for i, s in enumerate(samples):
        if s.latents.dim() != 2 or s.latents.shape[1] != c.in_channels:
            return f"sample {i}: latents must be (T_img, {c.in_channels}), got {tuple(s.latents.shape)}"
        if s.text.dim() != 2 or s.text.shape[1] != c.joint_attention_dim:
            return f"sample {i}: text must be (T_txt, {c.joint_attention_dim}), got {tuple(s.text.shape)}"
        for name, ids, n in (("img_ids", s.img_ids, s.latents.shape[0]), ("txt_ids", s.txt_ids, s.text.shape[0])):
            if tuple(ids.shape) != (n, axes):
                return f"sample {i}: {name} must be ({n}, {axes}), got {tuple(ids.shape)}"
        if (s.ref_latents is None) != (s.ref_ids is None):
            return f"sample {i}: give ref_latents and ref_ids together"
        if s.ref_latents is not None and (
            s.ref_latents.dim() != 2
            or s.ref_latents.shape[1] != c.in_channels
            or tuple(s.ref_ids.shape) != (s.ref_latents.shape[0], axes)
        ):
            return f"sample {i}: ref_latents (T_ref, {c.in_channels}) and ref_ids (T_ref, {axes}) do not match"
        if c.guidance_embeds and s.guidance is None:
            return f"sample {i}: this model is guidance-distilled: every Flux2Sample needs a guidance value"
    return ""


def packed_flux2_forward(
    model, samples: Sequence[Flux2Sample], executor: TokenExecutor | None = None
) -> PackedFlux2Output:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``flux2_seq_lens(samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process)."""
    prepare_flux2(model)
    raise_sample_problem(executor, _problem(model, samples))
    c = model.config
    device, dtype = model.x_embedder.weight.device, model.x_embedder.weight.dtype
    txt_lens = [int(s.text.shape[0]) for s in samples]
    img_lens = [int(s.latents.shape[0]) for s in samples]
    vis_lens = [i + s.num_ref for i, s in zip(img_lens, samples)]
    seq_lens = [t + v for t, v in zip(txt_lens, vis_lens)]
    axes = len(c.axes_dims_rope)
    # 1. embed locally (image and reference tokens are one visual stream, as in the stock batch)
    vis = [torch.cat([s.latents, s.ref_latents]) if s.num_ref else s.latents for s in samples]
    vis_h = model.x_embedder(cat_or_empty(vis, (0, c.in_channels), device, dtype))
    txt_h = model.context_embedder(cat_or_empty([s.text for s in samples], (0, c.joint_attention_dim), device, dtype))
    ts = stack_scalars([s.timestep for s in samples], device, dtype) * 1000
    guidance = stack_scalars([s.guidance for s in samples], device, dtype) * 1000 if c.guidance_embeds else None
    temb = model.time_guidance_embed(ts, guidance)  # (S, D): once per sample, as the stock batch
    mods = (
        model.double_stream_modulation_img(temb),
        model.double_stream_modulation_txt(temb),
        model.single_stream_modulation(temb),
        model.norm_out.linear(model.norm_out.silu(temb).to(dtype)),  # the output norm's (S, 2D)
    )
    seq_l, pos_l = local_positions(seq_lens, device)
    tl = torch.tensor(txt_lens, dtype=torch.int64, device=device)
    il = torch.tensor(img_lens, dtype=torch.int64, device=device)
    is_txt = pos_l < tl[seq_l] if seq_l.numel() else torch.zeros(0, dtype=torch.bool, device=device)
    i_txt, i_vis, inv = split_streams(is_txt)
    h_local = merge_streams(txt_h, vis_h, inv)
    ids = [torch.cat([s.txt_ids, s.img_ids, *([s.ref_ids] if s.num_ref else [])]) for s in samples]
    ids = cat_or_empty(ids, (0, axes), device, torch.float64)
    # 2. route; per-sample conditioning to every rank of the group
    ex = executor_or_local(executor, seq_lens)
    h, ids_r = ex.route(h_local, ids, seq_lens=seq_lens)
    *mods_all, txt_all, img_all = ex.gather_sequences(*mods, tl, il)
    seq_id, pos = ex.routed_positions(device)
    r_txt, r_vis, r_inv = split_streams(pos < txt_all.index_select(0, seq_id))
    joint = torch.cat([r_txt, r_vis])  # joint row j is routed row joint[j]; routed row i is joint row r_inv[i]
    packed = _Packed(executor=ex, to_routed=r_inv, from_routed=joint)
    rope = model.pos_embed(ids_r.index_select(0, joint)) if joint.numel() else None
    s_txt, s_vis = seq_id.index_select(0, r_txt), seq_id.index_select(0, r_vis)
    mod_img, mod_txt, mod_single, mod_out = mods_all
    mod_img, mod_txt, mod_out = mod_img.index_select(0, s_vis), mod_txt.index_select(0, s_txt), mod_out[s_vis]
    mod_single = mod_single.index_select(0, torch.cat([s_txt, s_vis]))
    txt_s, vis_s = h.index_select(0, r_txt).unsqueeze(1), h.index_select(0, r_vis).unsqueeze(1)  # (T, 1, D)
    kw = {"packed": packed}
    # 3. double blocks (stock forwards), then single blocks over all tokens in joint order
    for block in model.transformer_blocks:
        txt_s, vis_s = call_block(model, block, vis_s, txt_s, mod_img, mod_txt, rope, kw)
    allt = torch.cat([txt_s, vis_s])
    for block in model.single_transformer_blocks:
        allt = call_block(model, block, allt, None, mod_single, rope, kw)
    vis_s = allt[r_txt.numel() :]
    # 4. the stock output norm with each visual token's own row, the projection, back home
    scale, shift = torch.chunk(mod_out, 2, dim=1)
    out_vis = model.proj_out(model.norm_out.norm(vis_s) * (1 + scale)[:, None, :] + shift[:, None, :])[:, 0]
    out = ex.reverse_route(merge_streams(out_vis.new_zeros(r_txt.numel(), out_vis.shape[1]), out_vis, r_inv))
    no_rows = torch.zeros(0, dtype=torch.bool, device=device)
    is_img = (pos_l >= tl[seq_l]) & (pos_l < (tl + il)[seq_l]) if seq_l.numel() else no_rows
    img_rows = out.index_select(0, torch.nonzero(is_img).flatten())
    return PackedFlux2Output.of(torch.split(img_rows, img_lens) if img_lens else [], img_rows)


def samples_from_batch(batch, cfg: DiffusersFlux2Config, *, seed: int) -> list[Flux2Sample]:
    """Flux.2 samples from a synthetic :class:`~knapformer.data.batches.Batch` (text rows as
    random text states, visual rows as latents on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    axes = len(cfg.axes_dims_rope)
    out = []
    for s in batch_samples(batch):
        n, t = s.visual.shape[0], s.text.shape[0]
        w = max(1, int(n**0.5))
        ids = torch.zeros(n, axes, dtype=torch.float64)
        ids[:, 1], ids[:, 2] = torch.arange(n) // w, torch.arange(n) % w
        out.append(
            Flux2Sample(
                latents=s.visual[:, : cfg.in_dim],
                text=torch.randn(t, cfg.text_dim, generator=g).to(batch.x.dtype),
                timestep=s.timestep,
                img_ids=ids,
                txt_ids=torch.zeros(t, axes, dtype=torch.float64),
                guidance=torch.tensor(3.5) if cfg.guidance else None,
            )
        )
    return out


class Flux2Family(ModelFamily):
    """Stock diffusers ``Flux2Transformer2DModel`` for the tools (preset ``diffusers-flux2-tiny``)."""

    name = "diffusers-flux2"
    presets = FLUX2_PRESETS

    def build(self):
        return build_flux2(self.config)

    def inputs(self, batch):
        """Flux.2 samples of a batch and the targets of their image rows."""
        samples = samples_from_batch(batch, self.config, seed=0)
        target = visual_targets(batch, [s.latents.shape[0] for s in samples])
        return StepInputs(seq_lens=flux2_seq_lens(samples), args=samples, target=target)

    def forward(self, model, inputs, executor):
        return packed_flux2_forward(getattr(model, "module", model), inputs.args, executor).flat

    def blocks(self, device, dtype, causal):
        """One stock double-stream and one single-stream block on packed tokens of the given
        lengths (an eighth of each sequence text, the rest image), through a ``LocalExecutor``."""
        if causal:
            raise ValueError("--causal applies to the transformer presets only (Flux.2 attention is bidirectional)")
        cfg = self.config
        model = build_flux2(dataclasses.replace(cfg, num_double=1, num_single=1)).to(device)
        if dtype != torch.float32:  # (a dtype argument, even float32, makes diffusers warn)
            model = model.to(dtype)
        prepare_flux2(model)
        D, axes = cfg.dim, len(cfg.axes_dims_rope)

        def inputs(seq_lens, backward):
            ex = LocalExecutor(seq_lens)
            seq, pos = local_positions(seq_lens, device)
            txt = pos < torch.tensor([n // 8 for n in seq_lens], device=device)[seq]
            r_txt, r_vis, r_inv = split_streams(txt)
            joint = torch.cat([r_txt, r_vis])
            ids = torch.zeros(len(pos), axes, device=device)
            ids[:, 1], ids[:, 2] = pos // 64, pos % 64
            packed = _Packed(executor=ex, to_routed=r_inv, from_routed=joint)
            rope = model.pos_embed(ids.index_select(0, joint))
            x = lambda n: torch.randn(n, 1, D, device=device, dtype=dtype, requires_grad=backward)  # noqa: E731
            mod = lambda n, k: torch.randn(n, k * D, device=device, dtype=dtype)  # noqa: E731
            return packed, rope, r_txt.numel(), r_vis.numel(), x, mod

        def make_double(seq_lens, backward):
            packed, rope, nt, nv, x, mod = inputs(seq_lens, backward)
            vis, txt, m_img, m_txt = x(nv), x(nt), mod(nv, 6), mod(nt, 6)
            block = model.transformer_blocks[0]

            def run():
                enc, hid = block(vis, txt, m_img, m_txt, rope, {"packed": packed})
                return torch.cat([enc, hid])

            return block_runner(run, backward)

        def make_single(seq_lens, backward):
            packed, rope, nt, nv, x, mod = inputs(seq_lens, backward)
            allt, m = x(nt + nv), mod(nt + nv, 3)
            block = model.single_transformer_blocks[0]
            return block_runner(lambda: block(allt, None, m, rope, {"packed": packed}), backward)

        return [("double", cfg.num_double, make_double), ("single", cfg.num_single, make_single)]
