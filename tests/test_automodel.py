"""NeMo Automodel's own diffusion recipe with knapformer (``knapformer.integrations.automodel``):
on 2 gloo ranks, FSDP2 with the root sharded, fp64, tiny Wan / HunyuanVideo 1.5 / FLUX.1 built
from local configs, ``TrainDiffusionRecipe.setup()`` then ``run_train_validation_loop()``.

- Stock recipe vs the recipe with the one hook: the losses and gradient norms of 3 steps equal.
- knapformer's token-budget loader (clips and images of different sizes and durations, a
  different number on each rank): every prediction equals the stock model's per-sample
  forward, and the loss and gradient norm equal per-sample math's global mean.

``make test`` installs ``nemo-automodel`` (its import closure on CPU: transformers and
torchdata, both already here), so these run in CI."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'knapformer[diffusers]')")
pytest.importorskip("nemo_automodel", reason="nemo-automodel is not installed (make setup installs it)")

from knapformer.integrations.automodel_data import write_automodel_cache  # noqa: E402
from knapformer.testing import run_distributed  # noqa: E402
from tests import automodel_workers as W  # noqa: E402

LOSS_TOL = 1e-6
"""Automodel's adapters compute the loss in fp32 (``mse_loss(pred.float(), target.float())``)."""
NORM_TOL = 1e-7
"""fp64 models, but the stock norms of Wan and HunyuanVideo run in fp32: measured ≤ 1e-9."""


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_knapformer_equals_the_stock_recipe_for_wan_hunyuanvideo_and_flux(tmp_path):
    """FSDP2 (root sharded, Automodel's activation checkpointing) for the three models, and
    Wan under Automodel's DDP mode; Wan also validates after every step."""
    root = str(tmp_path)
    kinds = ["wan", "wan-ddp", "hunyuan", "flux"]
    for kind in ("wan", "hunyuan", "flux"):
        W.write_model(kind, root)
    for kind in ("hunyuan", "flux"):
        write_automodel_cache(os.path.join(root, f"{kind}-uniform"), W.uniform_samples(kind))
    out = run_distributed(W.stock_vs_knapformer, 2, root, kinds, timeout=400, start_method="spawn")
    for kind in kinds:
        for rank in range(2):
            stock, balanced = out[rank][kind]
            assert len(stock["losses"]) == len(balanced["losses"]) == 3, (kind, stock, balanced)
            assert len(stock["norms"]) == len(balanced["norms"]) == 3, (kind, stock, balanced)
            for a, b in zip(balanced["losses"], stock["losses"]):
                assert _rel(a, b) < LOSS_TOL, (kind, rank, balanced["losses"], stock["losses"])
            for a, b in zip(balanced["norms"], stock["norms"]):
                assert _rel(a, b) < NORM_TOL, (kind, rank, balanced["norms"], stock["norms"])
            # Automodel's validation loop goes through the adapter too (Wan: after every step)
            assert len(balanced["val"]) == len(stock["val"]) == (3 if kind == "wan" else 0), kind
            for a, b in zip(balanced["val"], stock["val"]):
                assert _rel(a, b) < LOSS_TOL, (kind, rank, balanced["val"], stock["val"])


def _crop(x: torch.Tensor, shape) -> torch.Tensor:
    return x[(..., *(slice(0, n) for n in shape))]


def _stock(kind: str, model, rec: dict, b: int, shape, source: dict) -> torch.Tensor:
    """The stock model's forward of sample ``b`` alone: the latents and timestep the stock
    adapter prepared (cropped to the sample), its own unpadded text from the cache."""
    text = source["text_embeddings"][0].double()
    if kind == "flux":  # packed 2x2 as FLUX pipelines do, ids (0, row, column), no CLIP states
        c, (h, w) = rec["_noisy_latents"].shape[1], shape
        x = _crop(rec["_noisy_latents"][b], shape).reshape(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4)
        ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(h // 2.0), torch.arange(w // 2.0), indexing="ij"), -1
        )
        out = model(
            hidden_states=x.reshape(1, -1, 4 * c),
            encoder_hidden_states=text[None],
            pooled_projections=torch.zeros(1, 768, dtype=torch.float64),
            timestep=rec["timestep"][b][None],
            img_ids=ids.reshape(-1, 3).double(),
            txt_ids=torch.zeros(text.shape[0], 3, dtype=torch.float64),
            guidance=rec["guidance"][b][None],
            return_dict=False,
        )[0][0]
        return out.reshape(h // 2, w // 2, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, h, w)
    if kind == "wan":
        hidden = _crop(rec["hidden_states"][b], shape)
        args = dict(hidden_states=hidden[None], timestep=rec["timestep"][b][None], encoder_hidden_states=text[None])
    else:  # the hunyuan adapter's T2V inputs: zero image states of its default shape, masks of ones
        ones = lambda n: torch.ones(1, n, dtype=torch.float64)  # noqa: E731
        text_2 = source["text_embeddings_2"][0].double()
        args = dict(
            hidden_states=_crop(rec["latents"][b], shape)[None],
            timestep=rec["timesteps"][b][None],
            encoder_hidden_states=text[None],
            encoder_attention_mask=ones(text.shape[0]),
            encoder_hidden_states_2=text_2[None],
            encoder_attention_mask_2=ones(text_2.shape[0]),
            image_embeds=torch.zeros(1, 4, 3, dtype=torch.float64),
        )
    return model(**args, return_dict=False)[0][0]


def _source(items: list[dict], clean: torch.Tensor) -> dict:
    """The cache sample whose latents these are (every cache sample is distinct random data)."""
    key = "video_latents" if "video_latents" in items[0] else "image_latents"
    found = [it for it in items if it[key][0].shape == clean.shape and torch.equal(it[key][0], clean)]
    assert len(found) == 1, len(found)
    return found[0]


@pytest.mark.parametrize("kind", ["wan", "hunyuan", "flux"])
def test_mixed_sizes_and_durations_are_exact_against_per_sample_math(tmp_path, kind):
    """knapformer's loader deals each rank clips of 1-5 latent frames and images at several
    sizes under a token budget (FLUX: images of 7 sizes; with text, and HunyuanVideo's byT5
    text, of different lengths);
    every step, on both ranks: each prediction = the stock model's forward of that sample
    alone; the recipe's loss (mean over ranks) and its gradient norm = those of the global mean
    over every valid element, computed per sample."""
    import diffusers

    root = str(tmp_path)
    W.write_model(kind, root)
    items = W.mixed_samples(kind)
    write_automodel_cache(os.path.join(root, f"{kind}-mixed"), items)
    budget = {"wan": 80, "hunyuan": 320, "flux": 20}[
        kind
    ]  # the longest sample fits: 80 Wan tokens, 320 HunyuanVideo tokens
    out = run_distributed(W.mixed, 2, root, kind, budget, timeout=300, start_method="spawn")
    out = [torch.load(io.BytesIO(b), weights_only=False) for b in out]
    cls, cfg, _, _ = W.MODELS[kind]
    model = getattr(diffusers, cls)(**cfg).double()
    shift = 3.0  # Automodel's default flow_shift: loss weight 1 + shift · sigma
    steps = [r["steps"] for r in out]
    assert len(steps[0]) == len(steps[1]) == 3 and len(out[0]["norms"]) == 3
    # Automodel's validation after step 3 ran on the same loader (drop_last: false) on both ranks
    assert len(out[0]["val"]) == len(out[1]["val"]) == 1 and out[0]["val"] == out[1]["val"], [r["val"] for r in out]
    assert math.isfinite(out[0]["val"][0])
    counts = [(len(steps[0][s]["shapes"]), len(steps[1][s]["shapes"])) for s in range(3)]
    shapes = {tuple(x) for r in steps for st in r for x in st["shapes"]}
    assert any(a != b for a, b in counts), counts  # ranks hold different numbers of samples
    assert len(shapes) >= 5, shapes  # many sizes
    if kind != "flux":
        assert {f for f, _, _ in shapes} >= {1, 3}, shapes  # images and clips
    for s in range(3):
        weights = steps[0][s]["weights"]
        params = dict(model.named_parameters())
        assert set(weights) == set(params)
        for name, p in params.items():
            assert torch.equal(weights[name], steps[1][s]["weights"][name])
            p.data.copy_(weights[name])
        model.zero_grad()
        total, elements = torch.zeros((), dtype=torch.float64), 0
        for rank in range(2):
            rec = steps[rank][s]
            for b, shape in enumerate(rec["shapes"]):
                source = _source(items, _crop(rec["clean"][b], shape))
                ref = _stock(kind, model, rec, b, shape, source)
                pred = _crop(rec["pred"][b], shape)
                assert pred.shape == ref.shape
                err = ((pred - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-9, (s, rank, b, err)
                target = _crop(rec["target"][b], shape).double()
                weight = 1.0 + shift * rec["sigma"][b].double()
                total = total + weight * ((ref - target) ** 2).sum()
                elements += math.prod(ref.shape)
        loss = total / elements
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
        recipe_loss = sum(r["losses"][s] for r in out) / 2  # each rank's value is its share · ranks
        assert _rel(recipe_loss, loss.item()) < LOSS_TOL, (s, recipe_loss, loss.item())
        for r in out:
            assert _rel(r["norms"][s], norm) < 1e-6, (s, r["norms"][s], norm)


def test_cache_lengths_collate_and_clear_errors(tmp_path):
    """The loader's pieces on one process: a real Automodel shard has no ``latent_shape`` (the
    sizes are read from the ``.meta`` file), an image cache feeds a video model as one-frame
    clips, a batch pads to the largest sample and says each one's size and text rows; bad input
    is refused with the reason."""
    import json

    from knapformer.integrations.automodel import KnapformerAdapter, use_knapformer
    from knapformer.integrations.automodel_data import AutomodelCache, TokenBudgetDataloaderConfig, collate_padded

    clips = write_automodel_cache(tmp_path / "clips", W.mixed_samples("wan")[:3])
    shard = clips / "shard_000.json"
    items = json.loads(shard.read_text())
    for it in items:
        del it["latent_shape"]  # as Automodel's own preprocessing writes them
    shard.write_text(json.dumps(items))
    images = write_automodel_cache(
        tmp_path / "images", [{"image_latents": torch.randn(1, 4, 6, 4), "text_embeddings": torch.randn(1, 2, 8)}]
    )
    data = AutomodelCache([str(clips), str(images)])
    assert [data.latent_shape(i) for i in range(4)] == [(1, 4, 6), (5, 8, 8), (3, 4, 4), (1, 6, 4)]
    cfg = TokenBudgetDataloaderConfig(cache_dir=[str(clips), str(images)], max_tokens=64)
    assert cfg.lengths(data).tolist() == [6, 80, 12, 6]
    batch = collate_padded([data[0], data[3], data[2]])
    assert batch["video_latents"].shape == (3, 4, 3, 6, 6)
    assert batch["latent_shapes"].tolist() == [[1, 4, 6], [1, 6, 4], [3, 4, 4]]
    assert batch["text_mask"].sum(1).tolist() == [3, 2, 5] and batch["text_embeddings"].shape == (3, 5, 8)
    assert torch.equal(batch["video_latents"][1, :, :1, :6, :4], data[3]["video_latents"][0])
    assert batch["video_latents"][1, :, :, :, 4:].abs().sum() == 0  # padding is zeros
    # drop_last=False: the last step (3 one-sample batches on 2 ranks) leaves rank 1 without a
    # sample, so both ranks leave it out (an empty batch would stop one rank's pipeline only)
    lone = TokenBudgetDataloaderConfig(cache_dir=str(clips), max_tokens=80, max_samples=1, drop_last=False)
    for rank in range(2):
        build = lone.build(dp_rank=rank, dp_world_size=2, batch_size=1)
        assert len(build.dataloader) == 1 and len(list(build.dataloader)) == 1
        assert build.sampler.state_dict() == build.sampler.sampler.state_dict()
    with pytest.raises(ValueError, match="patch"):
        TokenBudgetDataloaderConfig(cache_dir=str(clips), max_tokens=64, patch=[2, 2]).lengths(data)
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        AutomodelCache(str(tmp_path))
    with pytest.raises(ValueError, match="empty batch"):
        collate_padded([])

    class FluxAdapter:  # the name decides the family
        pass

    class QwenImageAdapter:
        pass

    assert KnapformerAdapter(FluxAdapter()).family.name == "flux"
    with pytest.raises(ValueError, match="QwenImageAdapter"):
        KnapformerAdapter(QwenImageAdapter())
    with pytest.raises(ValueError, match="loss"):
        KnapformerAdapter(FluxAdapter(), loss="mean")

    class Recipe:
        cp_size = 2
        flow_matching_pipeline = type("P", (), {"model_adapter": FluxAdapter()})()

    with pytest.raises(ValueError, match="cp_size is 2"):
        use_knapformer(Recipe())
    with pytest.raises(RuntimeError, match=r"call recipe.setup\(\) first"):
        use_knapformer(type("TrainDiffusionRecipe", (), {})())


def test_bad_sizes_on_one_rank_raise_on_every_rank():
    """A batch whose ``latent_shapes`` do not fit its latents, on rank 1 only: both ranks raise
    the same ``BalancerInputError`` naming rank 1 and the sizes (no hang)."""
    res = run_distributed(W.bad_sizes_everywhere, 2, timeout=120)
    for kind, msg in res:
        assert kind == "BalancerInputError", msg
        assert "rank(s) [1]" in msg and "must fit the padded latents (2, 4, 6)" in msg, msg
