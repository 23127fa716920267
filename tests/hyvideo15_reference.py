"""A faithful tiny reimplementation of the *official* HunyuanVideo 1.5 transformer, for tests only.

The authors' ``HunyuanVideo_1_5_DiffusionTransformer`` (``hyvideo/models/transformers/
hunyuanvideo_1_5_transformer.py`` in github.com/Tencent-Hunyuan/HunyuanVideo-1.5, the module
their ``train.py`` builds) is not installable from the package index, so the tests of
:mod:`knapformer.integrations.hunyuanvideo15_official` run against this one, written from the
public source: the same module tree and parameter names (``img_in.proj``, ``txt_in`` token
refiner, ``byt5_in``, ``vision_in``, ``time_in``, ``double_blocks[i].img_mod`` ... ``txt_mlp``,
``final_layer``), the same forward (per-sample text refinement with the MLLM mask, byT5 and
vision tokens reordered valid-first, condition-type embeddings, RoPE over the video grid from
1-D axis tables, double-stream blocks that call the module-level ``parallel_attention`` and
``apply_rotary_emb``, the final AdaLN layer, unpatchify), and the attention semantics of its
default ``flash`` mode (padded tokens are dropped as queries and keys; their outputs are zero).

Differences, all outside what the adapter touches: no sequence parallelism, no sparse or
flex attention modes, no single-stream blocks (the released 8.3B has none), no LoRA/PEFT
mixins, the byT5 mapper's widths (1472 → 2048 → 2048 in the official class) are arguments, and
attention runs through SDPA on the valid tokens of each batch row instead of flash-attn.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- functions the blocks call by module-level name -------------------------------------------
def modulate(x, shift=None, scale=None):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def apply_gate(x, gate=None):
    return x * gate.unsqueeze(1)


def _rotate_half(x):
    real, imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-imag, real], dim=-1).flatten(3)


def apply_rotary_emb(xq, xk, freqs_cis, head_first=False):
    """Real-form RoPE on [B, S, H, D] with (cos, sin) of shape [S, D], computed in fp32."""
    assert not head_first and freqs_cis[0].shape == (xq.shape[1], xq.shape[-1])
    cos, sin = (f.view(1, xq.shape[1], 1, xq.shape[-1]).to(xq.device) for f in freqs_cis)
    xq_out = (xq.float() * cos + _rotate_half(xq.float()) * sin).type_as(xq)
    xk_out = (xk.float() * cos + _rotate_half(xk.float()) * sin).type_as(xk)
    return xq_out, xk_out


@cache
def get_nd_rotary_pos_embed(rope_dim_list, sizes, theta=10000.0):
    """(cos, sin) [prod(sizes), sum(dims)] of every grid position, axis tables concatenated."""
    grids = torch.meshgrid(*(torch.linspace(0, n, n + 1, dtype=torch.float32)[:n] for n in sizes), indexing="ij")
    cos, sin = [], []
    for dim, g in zip(rope_dim_list, grids):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        freqs = torch.outer(g.reshape(-1), freqs)
        cos.append(freqs.cos().repeat_interleave(2, dim=1))
        sin.append(freqs.sin().repeat_interleave(2, dim=1))
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


def _masked_attention(q, k, v, mask):
    """[B, L, H, D] attention over each row's valid tokens (``mask`` [B, L] bool); padded
    positions output zero (the official ``flash`` mode's unpad/pad)."""
    out = torch.zeros(*q.shape[:2], q.shape[2] * q.shape[3], dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        idx = torch.nonzero(mask[b]).flatten()
        qb, kb, vb = (t[b].index_select(0, idx).transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb).transpose(0, 1).reshape(idx.numel(), -1)
        out[b, idx] = o
    return out


def parallel_attention(q, k, v, img_q_len, img_kv_len, attn_mode=None, text_mask=None, attn_param=None, block_idx=None):
    """Joint attention of (image, text) query/key/value pairs; text rows masked by ``text_mask``."""
    q, k, v = (torch.cat(pair, dim=1) for pair in (q, k, v))
    mask = F.pad(text_mask.bool(), (img_q_len, 0), value=True)
    return _masked_attention(q, k, v, mask)


# -- modules -----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight


class ModulateDiT(nn.Module):
    def __init__(self, hidden, factor):
        super().__init__()
        self.act, self.linear = nn.SiLU(), nn.Linear(hidden, factor * hidden)

    def forward(self, x):
        return self.linear(self.act(x))


class MLP(nn.Module):
    def __init__(self, dim, hidden, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), act, nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq=256):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).type(self.mlp[0].weight.dtype)
        return self.mlp(emb)


class PatchEmbed(nn.Module):
    def __init__(self, patch, in_chans, hidden):
        super().__init__()
        self.proj = nn.Conv3d(in_chans * 2 + 1, hidden, kernel_size=patch, stride=patch)  # concat_condition

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TextProjection(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.linear_1, self.act_1, self.linear_2 = nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.linear_2(self.act_1(self.linear_1(x)))


class IndividualTokenRefinerBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads_num = heads
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attn_qkv = nn.Linear(hidden, 3 * hidden)
        self.self_attn_q_norm, self.self_attn_k_norm = nn.Identity(), nn.Identity()
        self.self_attn_proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = MLP(hidden, 4 * hidden, nn.SiLU())
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c, attn_mask):
        gate_msa, gate_mlp = self.adaLN_modulation(c).chunk(2, dim=1)
        q, k, v = self.self_attn_qkv(self.norm1(x)).unflatten(-1, (3, self.heads_num, -1)).unbind(2)
        q, k = self.self_attn_q_norm(q).to(v), self.self_attn_k_norm(k).to(v)
        x = x + apply_gate(self.self_attn_proj(_masked_attention(q, k, v, attn_mask)), gate_msa)
        return x + apply_gate(self.mlp(self.norm2(x)), gate_mlp)


class IndividualTokenRefiner(nn.Module):
    def __init__(self, hidden, heads, depth):
        super().__init__()
        self.blocks = nn.ModuleList(IndividualTokenRefinerBlock(hidden, heads) for _ in range(depth))

    def forward(self, x, c, mask):
        mask = mask.clone().bool()
        mask[:, 0] = True  # (the official guard against a row of no keys)
        for block in self.blocks:
            x = block(x, c, mask)
        return x


class SingleTokenRefiner(nn.Module):
    def __init__(self, dim, hidden, heads, depth=2):
        super().__init__()
        self.input_embedder = nn.Linear(dim, hidden)
        self.t_embedder = TimestepEmbedder(hidden)
        self.c_embedder = TextProjection(dim, hidden)
        self.individual_token_refiner = IndividualTokenRefiner(hidden, heads, depth)

    def forward(self, x, t, mask):
        m = mask.float().unsqueeze(-1)
        c = self.t_embedder(t) + self.c_embedder((x * m).sum(dim=1) / m.sum(dim=1))
        return self.individual_token_refiner(self.input_embedder(x), c, mask)


class ByT5Mapper(nn.Module):
    def __init__(self, in_dim, out_dim, hidden_dim, out_dim1):
        super().__init__()
        self.layernorm = nn.LayerNorm(in_dim)
        self.fc1, self.fc2, self.fc3 = (
            nn.Linear(in_dim, hidden_dim),
            nn.Linear(hidden_dim, out_dim),
            nn.Linear(out_dim, out_dim1),
        )
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.fc3(self.act_fn(self.fc2(self.act_fn(self.fc1(self.layernorm(x))))))


class VisionProjection(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, hidden), nn.LayerNorm(hidden)
        )

    def forward(self, x):
        return self.proj(x)


class MMDoubleStreamBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.heads_num, mlp, hd = heads, int(hidden * mlp_ratio), hidden // heads
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", ModulateDiT(hidden, 6))
            setattr(self, f"{s}_norm1", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            for n in "qkv":
                setattr(self, f"{s}_attn_{n}", nn.Linear(hidden, hidden))
            setattr(self, f"{s}_attn_q_norm", RMSNorm(hd))
            setattr(self, f"{s}_attn_k_norm", RMSNorm(hd))
            setattr(self, f"{s}_attn_proj", nn.Linear(hidden, hidden))
            setattr(self, f"{s}_norm2", nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6))
            setattr(self, f"{s}_mlp", MLP(hidden, mlp, nn.GELU(approximate="tanh")))

    def _qkv(self, s, x):
        q, k, v = (getattr(self, f"{s}_attn_{n}")(x).unflatten(-1, (self.heads_num, -1)) for n in "qkv")
        return getattr(self, f"{s}_attn_q_norm")(q).to(v), getattr(self, f"{s}_attn_k_norm")(k).to(v), v

    def forward(self, img, txt, vec, freqs_cis=None, text_mask=None, attn_param=None, is_flash=False, block_idx=None):
        i1s, i1c, i1g, i2s, i2c, i2g = self.img_mod(vec).chunk(6, dim=-1)
        t1s, t1c, t1g, t2s, t2c, t2g = self.txt_mod(vec).chunk(6, dim=-1)
        img_q, img_k, img_v = self._qkv("img", modulate(self.img_norm1(img), shift=i1s, scale=i1c))
        if freqs_cis is not None:
            img_q, img_k = apply_rotary_emb(img_q, img_k, freqs_cis, head_first=False)
        txt_q, txt_k, txt_v = self._qkv("txt", modulate(self.txt_norm1(txt), shift=t1s, scale=t1c))
        attn = parallel_attention((img_q, txt_q), (img_k, txt_k), (img_v, txt_v), img_q_len=img_q.shape[1],
                                  img_kv_len=img_k.shape[1], text_mask=text_mask, attn_param=attn_param)  # fmt: skip
        img_attn, txt_attn = attn[:, : img_q.shape[1]].contiguous(), attn[:, img_q.shape[1] :].contiguous()
        img = img + apply_gate(self.img_attn_proj(img_attn), gate=i1g)
        img = img + apply_gate(self.img_mlp(modulate(self.img_norm2(img), shift=i2s, scale=i2c)), gate=i2g)
        txt = txt + apply_gate(self.txt_attn_proj(txt_attn), gate=t1g)
        txt = txt + apply_gate(self.txt_mlp(modulate(self.txt_norm2(txt), shift=t2s, scale=t2c)), gate=t2g)
        return img, txt


class FinalLayer(nn.Module):
    def __init__(self, hidden, patch, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, math.prod(patch) * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift=shift, scale=scale))


class HunyuanVideo_1_5_DiffusionTransformer(nn.Module):  # noqa: N801 (the official class name)
    def __init__(self, *, patch_size=(1, 1, 1), in_channels=4, out_channels=None, hidden_size=32, heads_num=4,
                 mm_double_blocks_depth=2, rope_dim_list=(2, 2, 4), text_states_dim=12, guidance_embed=False,
                 use_meanflow=False, rope_theta=256, glyph_byT5_v2=True, byt5_dims=(10, 16, 16),
                 vision_projection="linear", vision_states_dim=14, use_cond_type_embedding=True):  # fmt: skip
        super().__init__()
        self.patch_size, self.in_channels = list(patch_size), in_channels
        self.out_channels = self.unpatchify_channels = out_channels or in_channels
        self.hidden_size, self.heads_num = hidden_size, heads_num
        self.rope_dim_list, self.rope_theta = list(rope_dim_list), rope_theta
        self.guidance_embed, self.glyph_byT5_v2 = guidance_embed, glyph_byT5_v2
        self.text_projection, self.use_attention_mask, self.attn_mode = "single_refiner", True, "flash"
        self.attn_param = {}
        self.img_in = PatchEmbed(self.patch_size, in_channels, hidden_size)
        if glyph_byT5_v2:  # as upstream: without glyphs the attribute is never created
            self.byt5_in = ByT5Mapper(*byt5_dims, hidden_size)
        self.vision_in = VisionProjection(vision_states_dim, hidden_size) if vision_projection == "linear" else None
        self.txt_in = SingleTokenRefiner(text_states_dim, hidden_size, heads_num)
        self.time_in = TimestepEmbedder(hidden_size)
        self.vector_in = None  # text_pool_type None, as released
        self.guidance_in = TimestepEmbedder(hidden_size) if guidance_embed else None
        self.time_r_in = TimestepEmbedder(hidden_size) if use_meanflow else None
        self.double_blocks = nn.ModuleList(
            MMDoubleStreamBlock(hidden_size, heads_num) for _ in range(mm_double_blocks_depth)
        )
        self.single_blocks = nn.ModuleList()
        self.final_layer = FinalLayer(hidden_size, self.patch_size, self.out_channels)
        self.cond_type_embedding = nn.Embedding(3, hidden_size) if use_cond_type_embedding else None

    def get_rotary_pos_embed(self, rope_sizes):
        return get_nd_rotary_pos_embed(tuple(self.rope_dim_list), tuple(rope_sizes), theta=self.rope_theta)

    @staticmethod
    def reorder_txt_token(byt5_txt, txt, byt5_mask, text_mask, zero_feat=False):
        out, masks = [], []
        for i in range(text_mask.shape[0]):
            bm, tm = byt5_mask[i].bool(), text_mask[i].bool()
            b, t = byt5_txt[i], txt[i]
            pads = [torch.zeros_like(b[~bm]), torch.zeros_like(t[~tm])] if zero_feat else [b[~bm], t[~tm]]
            out.append(torch.cat([b[bm], t[tm], *pads]))
            masks.append(torch.cat([bm[bm], tm[tm], bm[~bm], tm[~tm]]))
        return torch.stack(out), torch.stack(masks).to(torch.int64)

    def _cond(self, x, kind):
        if self.cond_type_embedding is None:
            return x
        return x + self.cond_type_embedding(torch.full_like(x[:, :, 0], kind, dtype=torch.long))

    def forward(self, hidden_states, timestep, text_states, text_states_2, encoder_attention_mask, timestep_r=None,
                vision_states=None, guidance=None, mask_type="t2v", extra_kwargs=None, return_dict=False):  # fmt: skip
        x, t, text_mask = hidden_states, timestep, encoder_attention_mask
        bs, _, ot, oh, ow = x.shape
        tt, th, tw = ot // self.patch_size[0], oh // self.patch_size[1], ow // self.patch_size[2]
        freqs_cos, freqs_sin = self.get_rotary_pos_embed((tt, th, tw))
        img = self.img_in(x)
        vec = self.time_in(t)
        if self.guidance_embed:
            vec = vec + self.guidance_in(guidance if guidance is not None else torch.tensor([6016.0], device=x.device))
        if timestep_r is not None:
            vec = vec + self.time_r_in(timestep_r)
        txt = self._cond(self.txt_in(text_states, t, text_mask), 0)
        if self.glyph_byT5_v2:
            byt5 = self._cond(self.byt5_in(extra_kwargs["byt5_text_states"]), 1)
            txt, text_mask = self.reorder_txt_token(byt5, txt, extra_kwargs["byt5_text_mask"], text_mask, True)
        if self.vision_in is not None and vision_states is not None:
            extra = self.vision_in(vision_states)
            if mask_type == "t2v" and torch.all(vision_states == 0):
                extra_mask = torch.zeros(bs, extra.shape[1], dtype=text_mask.dtype, device=x.device)
                extra = extra * 0.0
            else:
                extra_mask = torch.ones(bs, extra.shape[1], dtype=text_mask.dtype, device=x.device)
            txt, text_mask = self.reorder_txt_token(self._cond(extra, 2), txt, extra_mask, text_mask)
        for index, block in enumerate(self.double_blocks):
            img, txt = block(img=img, txt=txt, vec=vec, freqs_cis=(freqs_cos, freqs_sin), text_mask=text_mask,
                             attn_param=self.attn_param, block_idx=index)  # fmt: skip
        img_seq_len = img.shape[1]
        x = torch.cat((img, txt), 1)  # as upstream: joined after the last block, the image sliced back
        img = x[:, :img_seq_len, ...]  # (the last block's text path gets exact-zero gradients)
        img = self.final_layer(img, vec)
        return (self.unpatchify(img, tt, th, tw), None)

    def unpatchify(self, x, t, h, w):
        c, (pt, ph, pw) = self.unpatchify_channels, self.patch_size
        x = x.reshape(x.shape[0], t, h, w, c, pt, ph, pw)
        return torch.einsum("nthwcopq->nctohpwq", x).reshape(x.shape[0], c, t * pt, h * ph, w * pw)
