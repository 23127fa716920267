"""Qwen-Image's packed attention and per-sample modulation: the processor of each block's joint
attention over packed ``[T, 1, D]`` tokens, the hooks that expand a block's per-sample
``img_mod``/``txt_mod`` output to its tokens, and the MSRoPE rows of routed tokens.

Used by :mod:`knapformer.integrations.qwenimage`; stock behaviour when a call is not packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapformer.executor import TokenExecutor
from knapformer.integrations._diffusers import require_diffusers

__all__ = ["PackedQwenAttnProcessor", "QwenPacked", "expand_rows", "note_rows", "prepare_qwenimage", "rope_rows"]

TABLE = 4096
"""Rows of ``QwenEmbedRope``'s positive (and of its negative) frequency table."""


@dataclass(eq=False)
class QwenPacked:
    """Metadata of the tokens this rank holds (joint order = all text rows, then all image rows)."""

    executor: TokenExecutor
    to_routed: torch.Tensor  # joint rows in routed order
    from_routed: torch.Tensor  # routed rows in joint order
    img_rows: torch.Tensor  # per image token: its row of the block's temb
    txt_rows: torch.Tensor  # per text token: its row of the block's temb


class PackedQwenAttnProcessor:
    """Qwen-Image joint attention over packed ``[T, 1, D]`` tokens; stock when not packed."""

    def __init__(self) -> None:
        from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

        self._stock = QwenDoubleStreamAttnProcessor2_0()

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
        packed: QwenPacked | None = None,
    ):
        if packed is None:
            return self._stock(
                attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
            )
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        head_dim = attn.inner_dim // attn.heads
        img = [attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)]
        txt = [attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states)]
        txt.append(attn.add_v_proj(encoder_hidden_states))
        (q, k, v), (tq, tk, tv) = ([t.unflatten(-1, (-1, head_dim)).squeeze(1) for t in s] for s in (img, txt))
        q = attn.norm_q(q) if attn.norm_q is not None else q
        k = attn.norm_k(k) if attn.norm_k is not None else k
        tq = attn.norm_added_q(tq) if attn.norm_added_q is not None else tq
        tk = attn.norm_added_k(tk) if attn.norm_added_k is not None else tk
        img_freqs, txt_freqs = image_rotary_emb
        if q.shape[0]:  # the stock rotation cannot reshape zero tokens
            q, k = (apply_rotary_emb_qwen(t[None], img_freqs, use_real=False)[0] for t in (q, k))
        if tq.shape[0]:
            tq, tk = (apply_rotary_emb_qwen(t[None], txt_freqs, use_real=False)[0] for t in (tq, tk))
        q, k, v = (torch.cat([a, b]).index_select(0, packed.to_routed) for a, b in ((tq, q), (tk, k), (tv, v)))
        o = packed.executor.attention(q, k, v).index_select(0, packed.from_routed)
        o = o.flatten(1, 2).unsqueeze(1).to(q.dtype)
        n_txt = encoder_hidden_states.shape[0]
        img_o = attn.to_out[0](o[n_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_o = attn.to_out[1](img_o)
        return img_o, attn.to_add_out(o[:n_txt].contiguous())


def note_rows(block, args, kwargs):
    """Forward pre-hook of a block: a packed call's token -> temb rows, noted on its two
    modulation modules for :func:`expand_rows` (cleared for a stock call)."""
    jak = kwargs["joint_attention_kwargs"] if "joint_attention_kwargs" in kwargs else (args[5:6] or [None])[0]
    packed = jak.get("packed") if isinstance(jak, dict) else None
    block.img_mod._knapformer_rows = None if packed is None else packed.img_rows
    block.txt_mod._knapformer_rows = None if packed is None else packed.txt_rows


def expand_rows(module, inputs, output):
    """Forward hook of ``img_mod``/``txt_mod``: (samples, 6·D) modulation -> one row per token."""
    rows = getattr(module, "_knapformer_rows", None)
    if rows is None:
        return None
    module._knapformer_rows = None
    return output.index_select(0, rows)


def rope_rows(model, pos: torch.Tensor) -> torch.Tensor:
    """Complex RoPE rows (n, Dh/2) of tokens at integer positions (n, 3), from the model's tables."""
    pe = model.pos_embed
    tables = torch.cat([pe.neg_freqs, pe.pos_freqs]).to(pos.device)  # row p + 4096 = position p
    axes = tables.split([a // 2 for a in pe.axes_dim], dim=1)
    return torch.cat([t.index_select(0, pos[:, i] + TABLE) for i, t in enumerate(axes)], dim=1)


def prepare_qwenimage(model) -> None:
    """Install the packed processor and the modulation hooks on this model instance only
    (checked every call: a module whose processor was replaced since gets it again)."""
    require_diffusers()
    proc = None
    for block in model.transformer_blocks:
        if not isinstance(block.attn.processor, PackedQwenAttnProcessor):
            proc = proc or PackedQwenAttnProcessor()
            block.attn.set_processor(proc)
        if not getattr(block, "_knapformer_hooked", False):
            block.register_forward_pre_hook(note_rows, with_kwargs=True)
            block.img_mod.register_forward_hook(expand_rows)
            block.txt_mod.register_forward_hook(expand_rows)
            block._knapformer_hooked = True
