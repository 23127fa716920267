"""The defaults a new family inherits from ``PackedFamily`` (docs/extending.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from knapformer.integrations.family import PackedFamily


def test_target_rows_reads_token_rows_and_refuses_video_latents():
    """``(rows, channels)`` latents give their rows; a video's ``(C, F, H, W)`` latents used to
    give C (the channel count) silently — now a clear error naming the override (issue 59, item 13)."""
    family = SimpleNamespace(name="ltx-like")
    images = [SimpleNamespace(latents=torch.zeros(256, 64)), SimpleNamespace(latents=torch.zeros(1024, 64))]
    assert PackedFamily.target_rows(family, images) == [256, 1024]
    video = [SimpleNamespace(latents=torch.zeros(16, 5, 8, 8))]
    with pytest.raises(TypeError, match=r"ltx-like.*\(16, 5, 8, 8\).*override target_rows"):
        PackedFamily.target_rows(family, video)


def test_packed_titan_attention_runs_the_mask_it_was_priced_for():
    """torchtitan's Flux attention module defaulted to ``is_causal=True``: a packed call that
    omitted the flag ran causal attention that ``titan_flux_workload`` prices as non-causal
    (issue 59, item 8). Now omitted means bidirectional, and asking for causal raises; stock
    calls keep the stock module's own default."""
    from knapformer.integrations.torchtitan_flux import PackedTitanAttention, _Attend

    stock_calls: list[dict] = []

    class Stock(torch.nn.Module):
        def forward(self, q, k, v, **kwargs):
            stock_calls.append(kwargs)
            return q

    class Executor:
        causal: list[bool] = []

        def attention(self, q, k, v, causal=False):
            Executor.causal.append(causal)
            return q

    T, H, D = 5, 2, 3
    order = torch.arange(T)
    routed = SimpleNamespace(inv=order, joint=order, executor=Executor())
    attn = PackedTitanAttention(Stock())
    q = torch.randn(1, T, H, D)
    attn._attend = _Attend(routed)
    attn(q, q, q)  # the flag left out
    attn._attend = _Attend(routed)
    attn(q, q, q, is_causal=False)
    assert Executor.causal == [False, False]
    attn._attend = _Attend(routed)
    with pytest.raises(ValueError, match="bidirectionally"):
        attn(q, q, q, is_causal=True)
    attn(q, q, q)  # a stock call: the stock default, untouched
    attn(q, q, q, is_causal=True)
    assert stock_calls == [{}, {"is_causal": True}]


@pytest.mark.parametrize("channels_first", [False, True])
def test_patchify_is_unpatchifys_inverse(channels_first):
    """``seam.patchify`` beside ``unpatchify`` (issue 59, item 12): images and videos of
    several grids round-trip exactly, and the row layout is the stock one."""
    from knapformer.integrations import seam

    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, 4, 6, generator=g), torch.randn(3, 2, 2, generator=g)]
    rows, grids = seam.patchify(images, (2, 2), channels_first=channels_first)
    assert grids == [(2, 3), (1, 1)] and rows.shape == (7, 12)
    back = seam.unpatchify(rows, grids, (2, 2), channels_first=channels_first)
    assert all(torch.equal(a, b) for a, b in zip(back, images))
    videos = [torch.randn(5, 3, 4, 4, generator=g)]
    rows, grids = seam.patchify(videos, (1, 2, 2), channels_first=channels_first)
    assert grids == [(3, 2, 2)] and torch.equal(
        seam.unpatchify(rows, grids, (1, 2, 2), channels_first=channels_first)[0], videos[0]
    )
    x = torch.arange(8.0).reshape(2, 2, 2)  # C = 2, one 2 × 2 patch
    row = seam.patchify([x], (2, 2), channels_first=channels_first)[0][0]
    want = x.flatten() if channels_first else x.permute(1, 2, 0).flatten()  # (C, p0, p1) or (p0, p1, C)
    assert torch.equal(row, want)
    with pytest.raises(ValueError, match="divisible"):
        seam.patchify([torch.zeros(3, 5, 4)], (2, 2))


def test_per_token_timesteps_take_their_own_rows():
    """``seam.timestep_table`` / ``seam.per_token_rows`` (issue 59, item 12): tokens of a
    sample with one timestep per token get ``embed`` of their own; the others their sample's
    per-sample row."""
    from knapformer.integrations import seam

    ts = [torch.tensor(5.0, dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)]
    first, per_token, tokens = seam.timestep_table(ts, [2, 3], "cpu")
    assert first.tolist() == [5.0, 1.0] and per_token.tolist() == [False, True]
    assert tokens.dtype == torch.float64 and tokens.tolist() == [5.0, 5.0, 1.0, 2.0, 3.0]
    per_sample = first[:, None] * 10  # a sample's row: 10 × its first timestep
    seq_id = torch.tensor([1, 0, 1, 1, 0])  # routed tokens in another order
    routed_ts = torch.tensor([2.0, 5.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    (rows,) = seam.per_token_rows(seq_id, (per_sample,), per_token, routed_ts, lambda t: (t[:, None] * 100,))
    assert rows[:, 0].tolist() == [200.0, 50.0, 100.0, 300.0, 50.0]
    none = torch.tensor([False, False])
    (rows,) = seam.per_token_rows(seq_id, (per_sample,), none, routed_ts, lambda t: (t[:, None],))
    assert rows[:, 0].tolist() == [10.0, 50.0, 10.0, 10.0, 50.0]
