"""Packed, variable-length (and balanced) forward of torchtitan's ``FluxModel``.

    from knapformer.integrations.torchtitan_flux import TitanFluxSample, titan_flux_seq_lens, packed_titan_flux_forward
    bal.plan(titan_flux_seq_lens(samples))                 # once per step, like any model
    outs = packed_titan_flux_forward(model, samples, bal)   # list of (T_img_i, C) tensors

torchtitan (``torchtitan.models.flux``) trains Flux on padded, fixed-shape batches: every image
of a batch has one resolution and every prompt is padded to one T5 length. Here each sample
brings its own resolution, text length, timestep, pooled (CLIP) vector and RoPE ids, and the
model's own modules and weights do all the math. Nothing is patched globally; on this model
instance only:

- **Blocks run their stock ``forward``** (so torchtitan's FSDP2 per block and its activation
  checkpointing wrappers keep working) on one packed batch row: image tokens
  ``[1, T_img, D]``, text tokens ``[1, T_txt, D]`` (this rank's routed tokens of every sample),
  RoPE of every token from the stock ``EmbedND``.
- **Per-sample modulation at stock cost**: the ``vec`` argument is a :class:`PackedVec`
  (per-sample conditioning plus the sample of every token). A forward pre-hook on each
  ``Modulation`` (and on the final layer's ``adaLN_modulation``) hands it the per-sample rows,
  so ``linear(silu(vec))`` runs once per *sample*, and a forward hook expands the result to
  the stream's tokens by index: no (tokens, D) matmul. Given a plain tensor, the hooks do
  nothing.
- **Attention within each sample**: each block's ``inner_attention`` is replaced by
  :class:`PackedTitanAttention`, which holds the stock module and calls it unless the block
  was called with a :class:`PackedVec`; then it attends through the executor
  (``SequenceBalancer.attention``: Ulysses inside the sample's group, rings beyond a node) or
  within each sample on this process. The module has no parameters: the state dict and
  torchtitan's checkpoints are unchanged.
- The executor is planned by the caller, once per step, with :func:`titan_flux_seq_lens` (text
  + image tokens of each sample): a ``SequenceBalancer`` routes tokens right after the
  embedders, shares the per-sample ``vec`` with ``gather_sequences``, carries RoPE ids with the
  tokens and routes the image outputs back before they are split per sample; without one (or
  with a ``LocalExecutor``) attention runs within each sample on this process.

torchtitan's ``FluxModel`` has no guidance embedding (it trains FLUX.1-dev-sized models from
scratch), so samples carry none. ``pip install 'knapformer[torchtitan]'`` installs the tested
versions (torchtitan 0.3.0 with triton and transformers, which its package imports). Importing
knapformer never imports torchtitan; this module does, when a model is prepared.

Legend: T tokens (this rank's routed ones after routing), S samples, D hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from knapformer.executor import TokenExecutor, local_positions
from knapformer.integrations._diffusers import (
    PackedOutput,
    batch_samples,
    cat_or_empty,
    executor_or_local,
    grid_ids,
    raise_sample_problem,
    stack_scalars,
    visual_targets,
)
from knapformer.integrations._torchtitan import TitanFluxConfig, build_titan_flux, require_torchtitan
from knapformer.integrations.configs import TITAN_FLUX_PRESETS
from knapformer.integrations.family import ModelFamily, StepInputs
from knapformer.models.layers import merge_streams, split_streams

__all__ = [
    "PackedTitanAttention",
    "PackedTitanFluxOutput",
    "PackedVec",
    "TitanFluxConfig",
    "TitanFluxFamily",
    "TitanFluxSample",
    "build_titan_flux",
    "flow_matching_sample",
    "packed_titan_flux_forward",
    "prepare_titan_flux",
    "require_torchtitan",
    "titan_flux_seq_lens",
    "titan_flux_workload",
]


@dataclass
class TitanFluxSample:
    """One training sample for torchtitan's ``FluxModel`` (no batch dimension anywhere)."""

    latents: torch.Tensor  # (T_img, in_channels) packed 2x2 latent patches (torchtitan's pack_latents)
    text: torch.Tensor  # (T_txt, context_in_dim) T5 encodings, unpadded
    pooled: torch.Tensor  # (vec_in_dim,) CLIP pooled vector
    timestep: torch.Tensor  # () in [0, 1]
    img_ids: torch.Tensor  # (T_img, 3)
    txt_ids: torch.Tensor  # (T_txt, 3)

    @property
    def num_tokens(self) -> int:
        return int(self.text.shape[0] + self.latents.shape[0])


class PackedTitanFluxOutput(PackedOutput):
    """Per-sample image outputs (T_img_i, C) in order, plus ``flat``: all of this rank's image
    outputs as one (T_img, C) tensor (see :class:`~knapformer.integrations._diffusers.PackedOutput`)."""


@dataclass
class _Attend:
    """How this rank's packed tokens attend: joint order (all text rows, then all image rows,
    as the stock blocks concatenate them) <-> the executor's routed order."""

    executor: TokenExecutor
    to_routed: torch.Tensor  # joint rows in routed order
    from_routed: torch.Tensor  # routed rows in joint order
    pad: int = 0
    """Trailing stand-in rows (a rank with no routed token runs the blocks on one zero token:
    the stock RoPE cannot reshape zero tokens); they attend to nothing and output zeros."""


@dataclass
class PackedVec:
    """The ``vec`` a packed forward hands the stock blocks: per-sample conditioning (S, D) and,
    per stream (``txt``, ``img``, ``all`` = text rows then image rows), the sample of each
    token. The modulation hooks compute per sample and expand to the tokens."""

    per_sample: torch.Tensor
    rows: dict[str, torch.Tensor]
    attend: _Attend


class PackedTitanAttention(nn.Module):
    """A block's ``inner_attention`` for packed calls: the stock module (``stock``) unless the
    block was called with a :class:`PackedVec`, then attention within each sample through the
    executor. q/k/v arrive as ``(1, T, H, Dh)`` in joint order, as the stock block builds them."""

    def __init__(self, stock: nn.Module) -> None:
        super().__init__()
        self.stock = stock
        self._attend: _Attend | None = None

    def forward(self, q, k, v, *args, is_causal: bool = True, **kwargs):
        attend, self._attend = self._attend, None
        if attend is None:
            return self.stock(q, k, v, *args, is_causal=is_causal, **kwargs)
        q, k, v = (t[0].index_select(0, attend.to_routed) for t in (q, k, v))
        o = attend.executor.attention(q, k, v, causal=is_causal).index_select(0, attend.from_routed)
        if attend.pad:
            o = torch.cat([o, o.new_zeros(attend.pad, *o.shape[1:])])
        return o.unsqueeze(0).to(q.dtype)


def _vec_arg(args, kwargs, position: int):
    return kwargs["vec"] if "vec" in kwargs else (args[position] if len(args) > position else None)


def _block_hook(position: int):
    """Pre-hook of a block: a packed call (``vec`` is a :class:`PackedVec`) arms its attention."""

    def hook(block, args, kwargs):
        vec = _vec_arg(args, kwargs, position)
        block.inner_attention._attend = vec.attend if isinstance(vec, PackedVec) else None

    return hook


def _mod_pre(stream: str):
    """Pre-hook of a modulation module: per-sample rows in, the stream's token->sample rows
    noted for :func:`_mod_post`; cast as FSDP2's mixed precision casts a tensor ``vec``."""

    def hook(module, args):
        if not args or not isinstance(args[0], PackedVec):
            module._knapformer_rows = None
            return None
        vec = args[0]
        module._knapformer_rows = vec.rows[stream]
        weight = next(module.parameters())
        return (vec.per_sample.to(weight.dtype), *args[1:])

    return hook


def _mod_post(module, inputs, output):
    """(S, ...) modulation -> one row per token: a block's ``ModulationOut`` pair becomes
    ``(1, T, D)`` fields (the packed batch row); the final layer's ``(S, 2D)`` becomes (T, 2D)."""
    rows, module._knapformer_rows = getattr(module, "_knapformer_rows", None), None
    if rows is None:
        return None
    if isinstance(output, torch.Tensor):
        return output.index_select(0, rows)

    def expand(mod):
        if mod is None:
            return None
        fields = {f.name: getattr(mod, f.name)[:, 0].index_select(0, rows)[None] for f in dataclasses.fields(mod)}
        return type(mod)(**fields)

    return tuple(expand(m) for m in output)


def _inner(block: nn.Module) -> nn.Module:
    """The block under torchtitan's activation-checkpoint wrapper, if any."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def prepare_titan_flux(model) -> None:
    """Install the packed attention and the modulation hooks on this model instance only (the
    stock forward keeps its behaviour: every hook passes a plain tensor through). Idempotent;
    works before or after torchtitan's ``parallelize_flux`` (FSDP2, activation checkpointing)."""
    require_torchtitan()
    hooks = []
    for block in model.double_blocks:
        b = _inner(block)
        hooks += [(b, 2, {b.img_mod: "img", b.txt_mod: "txt"})]
    for block in model.single_blocks:
        b = _inner(block)
        hooks += [(b, 1, {b.modulation: "all"})]
    for b, position, mods in hooks:
        if not isinstance(b.inner_attention, PackedTitanAttention):
            b.inner_attention = PackedTitanAttention(b.inner_attention)
        if not getattr(b, "_knapformer_hooked", False):
            b.register_forward_pre_hook(_block_hook(position), with_kwargs=True)
            b._knapformer_hooked = True
        for mod, stream in mods.items():
            _hook_modulation(mod, stream)
    _hook_modulation(model.final_layer.adaLN_modulation, "img")


def _hook_modulation(mod: nn.Module, stream: str) -> None:
    if not getattr(mod, "_knapformer_hooked", False):
        mod.register_forward_pre_hook(_mod_pre(stream))
        mod.register_forward_hook(_mod_post)
        mod._knapformer_hooked = True


# -- sizes, cost, samples ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Dims:
    in_channels: int
    context: int
    vec: int
    axes: int
    hidden: int
    heads: int


def _dims(model) -> _Dims:
    return _Dims(
        in_channels=model.img_in.in_features,
        context=model.txt_in.in_features,
        vec=model.vector_in.in_layer.in_features,
        axes=len(model.pe_embedder.axes_dim),
        hidden=model.hidden_size,
        heads=model.num_heads,
    )


def titan_flux_workload(model, *, gamma: float = 1.0):
    """The planner's cost model of a ``FluxModel``: d_model its hidden size (the blocks cost
    ``24·d²`` FLOPs per token in either stream with the stock 4× MLP), every double and single
    block a layer, and its heads bound the Ulysses degrees ``auto`` may choose."""
    from knapformer.workload import WorkloadModel

    return WorkloadModel(
        d_model=model.hidden_size,
        gamma=gamma,
        num_layers=len(model.double_blocks) + len(model.single_blocks),
        num_heads=model.num_heads,
    )


def titan_flux_seq_lens(samples: Sequence[TitanFluxSample]) -> list[int]:
    """Tokens of each sample as the packed forward lays them out (its text, then its image):
    the lengths to plan the step with."""
    return [int(s.text.shape[0]) + int(s.latents.shape[0]) for s in samples]


def _problem(d: _Dims, samples: Sequence[TitanFluxSample]) -> str:
    """Why these samples cannot run on this model ("" if they can)."""
    for i, s in enumerate(samples):
        if not isinstance(s, TitanFluxSample):
            return f"sample {i} is a {type(s).__name__}, expected a TitanFluxSample"
        if s.latents.dim() != 2 or s.latents.shape[1] != d.in_channels:
            return f"sample {i}: latents must be (T_img, {d.in_channels}), got {tuple(s.latents.shape)}"
        if s.text.dim() != 2 or s.text.shape[1] != d.context:
            return f"sample {i}: text must be (T_txt, {d.context}), got {tuple(s.text.shape)}"
        for name, ids, n in (("img_ids", s.img_ids, s.latents.shape[0]), ("txt_ids", s.txt_ids, s.text.shape[0])):
            if tuple(ids.shape) != (n, d.axes):
                return f"sample {i}: {name} must be ({n}, {d.axes}), got {tuple(ids.shape)}"
        if tuple(s.pooled.shape) != (d.vec,):
            return f"sample {i}: pooled must be ({d.vec},), got {tuple(s.pooled.shape)}"
        if torch.as_tensor(s.timestep).numel() != 1:
            return f"sample {i}: timestep must be one value, got shape {tuple(torch.as_tensor(s.timestep).shape)}"
    return ""


def packed_titan_flux_forward(
    model, samples: Sequence[TitanFluxSample], executor: TokenExecutor | None = None
) -> PackedTitanFluxOutput:
    """Outputs (T_img_i, out_channels) for each sample, in order; differentiable.

    ``executor`` is a ``SequenceBalancer`` already planned for this step with
    ``titan_flux_seq_lens(samples)`` (every rank of the group calls this function), a
    ``LocalExecutor``, or None (attention within each sample on this process). A malformed
    sample raises on every rank of the balancer's group."""
    from torchtitan.models.flux.model.layers import timestep_embedding

    prepare_titan_flux(model)
    d = _dims(model)
    raise_sample_problem(executor, _problem(d, samples))
    weight = model.img_in.weight
    device, dtype = weight.device, weight.dtype
    txt_lens = [int(s.text.shape[0]) for s in samples]
    img_lens = [int(s.latents.shape[0]) for s in samples]
    seq_lens = [t + i for t, i in zip(txt_lens, img_lens)]
    # 1. embed locally (every embedder runs, possibly on empty inputs: all params get grads)
    img_h = model.img_in(cat_or_empty([s.latents for s in samples], (0, d.in_channels), device, dtype))
    txt_h = model.txt_in(cat_or_empty([s.text for s in samples], (0, d.context), device, dtype))
    ts = stack_scalars([s.timestep for s in samples], device, dtype)
    pooled = cat_or_empty([s.pooled[None] for s in samples], (0, d.vec), device, dtype)
    vec = model.time_in(timestep_embedding(ts, 256)) + model.vector_in(pooled)  # (S, D), as the stock forward
    seq_l, pos_l = local_positions(seq_lens, device)
    tl = torch.tensor(txt_lens, dtype=torch.int64, device=device)
    is_txt_l = pos_l < tl[seq_l] if seq_l.numel() else torch.zeros(0, dtype=torch.bool, device=device)
    _, i_img, inv = split_streams(is_txt_l)
    h_local = merge_streams(txt_h, img_h, inv)  # (T, D): per sample, text then image
    ids_dtype = samples[0].img_ids.dtype if samples else torch.float32
    ids = cat_or_empty([torch.cat([s.txt_ids, s.img_ids]) for s in samples], (0, d.axes), device, torch.float64)
    # 2. route (a local executor keeps everything in place); ids travel losslessly in float64
    ex = executor_or_local(executor, seq_lens)
    h, ids_r = ex.route(h_local, ids, seq_lens=seq_lens)
    vec_all, txt_all = ex.gather_sequences(vec, tl)
    seq_id, pos = ex.routed_positions(device)
    r_txt, r_img, r_inv = split_streams(pos < txt_all.index_select(0, seq_id))
    joint = torch.cat([r_txt, r_img])  # joint row j is routed row joint[j]
    # a rank with no routed token still runs every block (each attention is collective): on one
    # zero image token with a zero vec (the stock RoPE cannot reshape zero tokens)
    pad = int(joint.numel() == 0)
    per_sample = torch.cat([vec_all, vec_all.new_zeros(pad, vec_all.shape[1])])
    stand_in = torch.full((pad,), vec_all.shape[0], dtype=seq_id.dtype, device=device)
    sample_txt = seq_id.index_select(0, r_txt)
    sample_img = torch.cat([seq_id.index_select(0, r_img), stand_in])
    packed = PackedVec(
        per_sample=per_sample,
        rows={"txt": sample_txt, "img": sample_img, "all": torch.cat([sample_txt, sample_img])},
        attend=_Attend(executor=ex, to_routed=r_inv, from_routed=joint, pad=pad),
    )
    ids_j = torch.cat([ids_r.index_select(0, joint), ids_r.new_zeros(pad, d.axes)])
    pe = model.pe_embedder(ids_j.to(ids_dtype)[None])  # (1, T, 1, Dh/2, 2, 2)
    txt_s = h.index_select(0, r_txt)[None]  # (1, T_txt, D)
    img_s = torch.cat([h.index_select(0, r_img), h.new_zeros(pad, h.shape[1])])[None]
    # 3. double blocks, then single blocks over text + image (stock forwards)
    for block in model.double_blocks:
        img_s, txt_s = block(img=img_s, txt=txt_s, vec=packed, pe=pe)
    num_txt = txt_s.shape[1]
    x = torch.cat([txt_s, img_s], dim=1)
    for block in model.single_blocks:
        x = block(x, vec=packed, pe=pe)
    # 4. output head per image token ("batch = tokens": its modulation is (T, 2D)), back home
    out_img = model.final_layer(x[0, num_txt:].unsqueeze(1), packed)[: x.shape[1] - num_txt - pad, 0]  # (R_img, C)
    out = merge_streams(out_img.new_zeros(num_txt, out_img.shape[1]), out_img, r_inv)
    img_rows = ex.reverse_route(out).index_select(0, i_img)
    return PackedTitanFluxOutput.of(torch.split(img_rows, img_lens) if img_lens else [], img_rows)


def flow_matching_sample(
    latent: torch.Tensor, t5: torch.Tensor, clip: torch.Tensor, *, timestep: torch.Tensor, noise: torch.Tensor
) -> tuple[TitanFluxSample, torch.Tensor]:
    """What torchtitan's ``FluxTrainer.forward_backward_step`` makes of a batch, for one image of
    any size: the noised latent ``(1 − t)·x + t·noise`` cut into 2×2 patches with torchtitan's
    ``pack_latents``, their ids from ``create_position_encoding_for_latents``, zero text ids; and
    the flow-matching target ``noise − x`` packed the same way.

    ``latent``: (C, H, W) from the autoencoder (H, W even); ``t5``: (T_txt, context) the prompt's
    T5 encodings *without* padding; ``clip``: (vec,) its pooled CLIP vector; ``timestep``: () in
    [0, 1]; ``noise``: like ``latent``. Returns (sample, target (T_img, 4·C))."""
    from torchtitan.models.flux.utils import create_position_encoding_for_latents, pack_latents

    if latent.dim() != 3 or latent.shape[1] % 2 or latent.shape[2] % 2:
        raise ValueError(f"latent must be (C, H, W) with H and W even, got {tuple(latent.shape)}")
    if noise.shape != latent.shape:
        raise ValueError(f"noise must have the latent's shape {tuple(latent.shape)}, got {tuple(noise.shape)}")
    if t5.dim() != 2 or clip.dim() != 1:
        raise ValueError(f"t5 must be (T_txt, width) and clip (width,), got {tuple(t5.shape)} and {tuple(clip.shape)}")
    t = torch.as_tensor(timestep, dtype=latent.dtype, device=latent.device).reshape(())
    x, n = latent[None], noise[None]
    sample = TitanFluxSample(
        latents=pack_latents((1 - t) * x + t * n)[0],
        text=t5,
        pooled=clip,
        timestep=t,
        img_ids=create_position_encoding_for_latents(1, latent.shape[1], latent.shape[2], 3)[0].to(latent.device),
        txt_ids=torch.zeros(t5.shape[0], 3, device=latent.device),
    )
    return sample, pack_latents(n - x)[0]


# -- synthetic samples for the tools ------------------------------------------------------------
def samples_from_batch(batch, cfg: TitanFluxConfig, *, seed: int) -> list[TitanFluxSample]:
    """Samples from a synthetic :class:`~knapformer.data.batches.Batch` (text rows first in
    each sequence; image ids on a near-square grid)."""
    g = torch.Generator().manual_seed(seed)
    return [
        TitanFluxSample(
            latents=s.visual[:, : cfg.in_dim],
            text=torch.randn(s.text.shape[0], cfg.text_dim, generator=g).to(batch.x.dtype),
            pooled=s.vec[: cfg.vec_dim],
            timestep=s.timestep,
            img_ids=grid_ids(s.visual.shape[0], dtype=torch.float32),
            txt_ids=torch.zeros(s.text.shape[0], 3),
        )
        for s in batch_samples(batch)
    ]


class TitanFluxFamily(ModelFamily):
    """torchtitan's ``FluxModel`` for the tools (preset ``torchtitan-flux-tiny``)."""

    name = "torchtitan-flux"
    presets = TITAN_FLUX_PRESETS

    def build(self):
        return build_titan_flux(self.config)

    def inputs(self, batch):
        """Flux samples of a batch and the targets of their image rows (the loss is on images)."""
        samples = samples_from_batch(batch, self.config, seed=0)
        target = visual_targets(batch, [s.latents.shape[0] for s in samples])
        return StepInputs(seq_lens=titan_flux_seq_lens(samples), args=samples, target=target)

    def forward(self, model, inputs, executor):
        return packed_titan_flux_forward(getattr(model, "module", model), inputs.args, executor).flat
