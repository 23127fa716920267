"""HunyuanVideo 1.5's packed attention and per-sample modulation.

- :class:`PackedHunyuanAttnProcessor`, set on this model instance's attention modules: for the
  dual-stream blocks it computes q/k/v of the video and of the context tokens with the stock
  projections and norms, rotates the video's q/k with the stock ``apply_rotary_emb``, and
  attends within each sample through the executor (Ulysses inside the sample's group, rings
  beyond the heads); for the text refiner's blocks it attends within each sample's text on the
  rank that loaded it. The packed metadata (:class:`HunyuanPacked`) arrives as the blocks'
  ``attention_mask`` argument, so activation-checkpoint recompute sees it; any other call
  goes to the stock processor.
- Per-sample modulation: the blocks' ``temb`` argument is a :class:`PerSample` (the samples'
  conditioning rows and, per stream, each token's row). A forward pre-hook on every AdaLN
  module (``norm1``, ``norm1_context``, the refiner's ``norm_out``) hands it the per-sample
  rows, so ``linear(silu(temb))`` runs once per *sample*, and a forward hook on that
  ``linear`` expands the result to the stream's tokens by index: the stock FLOPs. A plain
  tensor passes through untouched.

- :func:`refine_text`: the stock token refiner over each sample's MLLM text, packed.

Used by :mod:`knapformer.integrations.hunyuanvideo15`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.executor import LocalExecutor, TokenExecutor, local_positions
from knapformer.integrations._diffusers import call_block, cat_or_empty, require_diffusers

__all__ = [
    "HunyuanPacked",
    "PackedHunyuanAttnProcessor",
    "PerSample",
    "prepare_hunyuanvideo15",
    "refine_text",
    "rope_rows",
]


@dataclass(eq=False)
class HunyuanPacked:
    """How this rank's packed tokens attend. Dual-stream blocks: joint order (all video rows,
    then all context rows, as the stock processor concatenates them) <-> the executor's routed
    order. Refiner blocks: the text rows are already in the executor's order (both None)."""

    executor: TokenExecutor
    to_routed: torch.Tensor | None = None  # joint rows in routed order
    from_routed: torch.Tensor | None = None  # routed rows in joint order


@dataclass(eq=False)
class PerSample:
    """Per-sample conditioning (S, D) and, per stream name, the row of each of its tokens."""

    rows_of: torch.Tensor
    rows: dict[str, torch.Tensor]


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(T, 1, H·Dh) -> (T, H, Dh)."""
    return t.unflatten(-1, (heads, -1)).squeeze(1)


def _rotate(x: torch.Tensor, rope) -> torch.Tensor:
    """The stock rotary embedding on (T, H, Dh) with the token dimension as the sequence."""
    from diffusers.models.embeddings import apply_rotary_emb

    if rope is None or not x.shape[0]:  # (it cannot reshape zero tokens)
        return x
    return apply_rotary_emb(x[None], rope, sequence_dim=1)[0]


class PackedHunyuanAttnProcessor:
    """HunyuanVideo 1.5 attention over packed ``[T, 1, D]`` tokens; ``stock`` when not packed."""

    def __init__(self, stock) -> None:
        self.stock = stock

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if not isinstance(attention_mask, HunyuanPacked):
            if image_rotary_emb is None:  # the refiner's processor (AttnProcessor2_0) takes no RoPE
                return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask)
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        packed = attention_mask
        q, k, v = (_heads(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        q = attn.norm_q(q) if attn.norm_q is not None else q
        k = attn.norm_k(k) if attn.norm_k is not None else k
        if encoder_hidden_states is None:  # the text refiner: self-attention within each sample's text
            o = packed.executor.attention(q, k, v).flatten(1, 2).unsqueeze(1).to(q.dtype)
            o = attn.to_out[1](attn.to_out[0](o))
            if attn.residual_connection:
                o = o + hidden_states
            return o / attn.rescale_output_factor
        q, k = _rotate(q, image_rotary_emb), _rotate(k, image_rotary_emb)
        e = encoder_hidden_states
        eq, ek, ev = (_heads(f(e), attn.heads) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        eq = attn.norm_added_q(eq) if attn.norm_added_q is not None else eq
        ek = attn.norm_added_k(ek) if attn.norm_added_k is not None else ek
        q, k, v = (torch.cat([a, b]).index_select(0, packed.to_routed) for a, b in ((q, eq), (k, ek), (v, ev)))
        o = packed.executor.attention(q, k, v).index_select(0, packed.from_routed)
        o = o.flatten(1, 2).unsqueeze(1).to(q.dtype)
        n_vid = hidden_states.shape[0]
        return attn.to_out[1](attn.to_out[0](o[:n_vid])), attn.to_add_out(o[n_vid:])


def _pick(stream: str):
    """Forward pre-hook of an AdaLN module: a :class:`PerSample` ``temb`` (keyword ``emb`` or
    first positional) becomes its per-sample rows, and the stream's token rows are noted on the
    module's ``linear`` for :func:`_expand`."""

    def hook(module, args, kwargs):
        if isinstance(kwargs.get("emb"), PerSample):
            emb = kwargs["emb"]
            kwargs = {**kwargs, "emb": emb.rows_of}
        elif args and isinstance(args[0], PerSample):
            emb = args[0]
            args = (emb.rows_of, *args[1:])
        else:
            return None
        module.linear._knapformer_rows = emb.rows[stream]
        return args, kwargs

    return hook


def _expand(linear, inputs, output):
    """Forward hook of an AdaLN module's ``linear``: (samples, k·D) -> one row per token."""
    rows = getattr(linear, "_knapformer_rows", None)
    if rows is None:
        return None
    linear._knapformer_rows = None
    return output.index_select(0, rows)


def prepare_hunyuanvideo15(model) -> None:
    """Install the packed processor (wrapping whatever processor each module had) and the
    modulation hooks on this model instance only; checked every call, so a module whose
    processor was replaced since (``set_attn_processor``) gets a packed one again."""
    require_diffusers()
    refiner = model.context_embedder.token_refiner.refiner_blocks
    for block in [*model.transformer_blocks, *refiner]:
        if not isinstance(block.attn.processor, PackedHunyuanAttnProcessor):
            block.attn.set_processor(PackedHunyuanAttnProcessor(block.attn.processor))
    norms = [(b.norm1, "vid") for b in model.transformer_blocks]
    norms += [(b.norm1_context, "ctx") for b in model.transformer_blocks]
    norms += [(b.norm_out, "txt") for b in refiner]
    for norm, stream in norms:
        if not getattr(norm, "_knapformer_hooked", False):
            norm.register_forward_pre_hook(_pick(stream), with_kwargs=True)
            norm.linear.register_forward_hook(_expand)
            norm._knapformer_hooked = True


def rope_rows(model, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin), each (T, Dh), of video tokens at integer (frame, row, column) positions
    ``pos`` (T, 3): the stock ``get_1d_rotary_pos_embed`` on each axis's float32 positions,
    what the stock ``HunyuanVideo15RotaryPosEmbed`` computes for the whole grid."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    r = model.rope
    axes = [
        get_1d_rotary_pos_embed(d, pos[:, i].to(torch.float32), r.theta, use_real=True)
        for i, d in enumerate(r.rope_dim)
    ]
    return torch.cat([a[0] for a in axes], dim=1), torch.cat([a[1] for a in axes], dim=1)


def refine_text(model, rows: list[torch.Tensor], ts: torch.Tensor, device, dtype) -> torch.Tensor:
    """The stock token refiner (``context_embedder``) over each sample's kept MLLM rows
    (``rows[i]``: (L_i, text_embed_dim)) with its timestep ``ts[i]``, packed on this rank: the
    pooled mean of the sample's rows, its time + text embedding, self-attention within the
    sample. -> (sum L_i, D). A sample with no rows gets a zero mean (the stock 0/0 is NaN) that
    no token uses."""
    ce = model.context_embedder
    lens = [int(r.shape[0]) for r in rows]
    x = cat_or_empty(rows, (0, ce.proj_in.in_features), device, dtype)
    seg, _ = local_positions(lens, device)
    counts = torch.tensor(lens, device=device, dtype=dtype).clamp(min=1)
    pooled = x.new_zeros(len(rows), x.shape[1]).index_add(0, seg, x) / counts[:, None]
    h = ce.proj_in(x).unsqueeze(1)  # (T_txt, 1, D)
    temb = PerSample(ce.time_text_embed(ts, pooled), {"txt": seg})
    attend = HunyuanPacked(LocalExecutor(lens))
    for block in ce.token_refiner.refiner_blocks:
        h = call_block(model, block, h, temb, attend)
    return h[:, 0]
