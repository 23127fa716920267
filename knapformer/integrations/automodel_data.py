"""Token-budget batches of mixed resolutions and durations for NeMo Automodel's diffusion recipe.

Automodel's loaders draw each step from one resolution bucket with a fixed batch size, so a
step never mixes clip lengths or image sizes (its issue #3245). :class:`TokenBudgetDataloaderConfig`
is a ``data.dataloader._target_`` its recipe accepts (a dataclass with
``build(*, dp_rank, dp_world_size, batch_size)``): it reads the same preprocessed caches
(``metadata.json`` + shards + ``.meta`` files), gives each rank batches under a token budget
drawn across every size (:class:`knapformer.data.TokenBudgetBatchSampler`), and pads each
batch into the dense tensors Automodel's pipeline needs, with each sample's true size in
``batch["latent_shapes"]`` and its text rows in ``batch["text_mask"]`` for
:class:`knapformer.integrations.automodel.KnapformerAdapter`, which leaves the padding out of
the model and the loss.

Padding costs host memory and the loss's elementwise work only (the model runs unpadded); a
batch whose samples differ a lot in size pads a lot, so keep budgets per rank modest or set
``max_samples``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from knapformer.data import TokenBudgetBatchSampler

__all__ = [
    "AutomodelCache",
    "StepsWithSamples",
    "TokenBudgetDataloaderConfig",
    "collate_padded",
    "write_automodel_cache",
]

_LATENTS = ("video_latents", "image_latents")
_TEXT = (("text_embeddings", "text_mask"), ("text_embeddings_2", "text_mask_2"))


def write_automodel_cache(directory: str | os.PathLike, samples: Sequence[dict[str, torch.Tensor]]) -> Path:
    """Write ``samples`` (dicts of tensors with a leading batch dim of 1, as Automodel's
    preprocessing saves them) as an Automodel cache: one ``.meta`` file each, a shard listing
    them with their latent sizes, and ``metadata.json``. For tests and small datasets."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    items = []
    for i, sample in enumerate(samples):
        key = next((k for k in _LATENTS if k in sample), None)
        if key is None:
            raise ValueError(f"sample {i} has none of {_LATENTS}")
        path = root / f"sample_{i:06d}.meta"
        torch.save(sample, path)
        shape = list(sample[key].shape[2:])
        items.append({"cache_file": str(path), "latent_shape": shape, "aspect_ratio": shape[-1] / shape[-2]})
    (root / "shard_000.json").write_text(json.dumps(items))
    (root / "metadata.json").write_text(json.dumps({"shards": ["shard_000.json"]}))
    return root


class AutomodelCache(torch.utils.data.Dataset):
    """The samples of one or more Automodel caches, in order. ``latents_key``: the latents
    the model trains on; a video model (``video_latents``) takes an image cache's
    ``image_latents`` as one-frame clips, so image and video caches mix."""

    def __init__(self, cache_dirs: str | Sequence[str], latents_key: str = "video_latents") -> None:
        if latents_key not in _LATENTS:
            raise ValueError(f"latents_key must be one of {_LATENTS}, got {latents_key!r}")
        self.latents_key = latents_key
        self.items: list[dict] = []
        for d in [cache_dirs] if isinstance(cache_dirs, (str, os.PathLike)) else list(cache_dirs):
            meta = Path(d) / "metadata.json"
            if not meta.exists():
                raise FileNotFoundError(f"no metadata.json in {d} (an Automodel preprocessed cache)")
            shards = json.loads(meta.read_text()).get("shards")
            if not isinstance(shards, list):
                raise ValueError(f"{meta} must hold a 'shards' list")
            for shard in shards:
                self.items += json.loads((Path(d) / shard).read_text())
        if not self.items:
            raise ValueError(f"the caches {cache_dirs} hold no samples")

    def __len__(self) -> int:
        return len(self.items)

    def latent_shape(self, i: int) -> tuple[int, ...]:
        """Sample ``i``'s latent sizes after the channels (from the shard's ``latent_shape``, or
        read from its ``.meta`` file once when the shard does not say)."""
        item = self.items[i]
        if "latent_shape" not in item:
            item["latent_shape"] = list(self[i][self.latents_key].shape[2:])
        shape = tuple(int(n) for n in item["latent_shape"])
        if self.latents_key == "video_latents" and len(shape) == 2:
            shape = (1, *shape)
        return shape

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.items[i]["cache_file"], "rb") as f:
            data = torch.load(f, weights_only=True)
        if self.latents_key == "video_latents" and "video_latents" not in data and "image_latents" in data:
            data["video_latents"] = data.pop("image_latents").unsqueeze(2)  # an image: a one-frame clip
        if self.latents_key not in data:
            raise KeyError(f"{self.items[i]['cache_file']} has no {self.latents_key}")
        return data


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``[1, ...]`` tensors along dim 0, zero-padding every other dim to the largest."""
    full = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    return torch.cat(
        [F.pad(p, [x for n, m in zip(reversed(p.shape[1:]), reversed(full)) for x in (0, m - n)]) for p in parts]
    )


def collate_padded(items: list[dict[str, Any]], latents_key: str = "video_latents") -> dict[str, Any]:
    """Automodel's batch from samples of different sizes: latents and text zero-padded to the
    largest, ``latent_shapes`` (B, dims) and text masks saying what is real."""
    if not items:
        raise ValueError("an empty batch: the token-budget sampler dealt this rank no sample (use drop_last=True)")
    lat = [it[latents_key] for it in items]
    batch: dict[str, Any] = {
        latents_key: _pad_cat(lat),
        "latent_shapes": torch.tensor([list(x.shape[2:]) for x in lat], dtype=torch.long),
        "data_type": "video" if latents_key == "video_latents" else "image",
    }
    for text, mask in _TEXT:
        if text not in items[0]:
            continue
        rows = [it[text] for it in items]
        batch[text] = _pad_cat(rows)
        masks = [it[mask] if mask in it else torch.ones(1, r.shape[1], dtype=torch.long) for it, r in zip(items, rows)]
        batch[mask] = _pad_cat(masks)
    done = set(batch) | {latents_key}
    for key in items[0]:
        if key in done:
            continue
        values = [it[key] for it in items]
        if all(isinstance(v, torch.Tensor) for v in values) and values[0].dim() >= 1:
            batch[key] = _pad_cat(values)
        else:
            batch[key] = values
    return batch


class StepsWithSamples:
    """A :class:`TokenBudgetBatchSampler`'s batches for one rank, leaving out the steps where any
    rank's batch is empty: Automodel's pipeline cannot run an empty batch, and every rank must
    leave out the same steps (its adapter's plan is collective). Only the last step of an epoch
    dealt with ``drop_last=False`` can have one, when it holds fewer samples than ranks. The
    sampler's ``set_epoch`` and state (Automodel checkpoints it) pass through."""

    def __init__(self, sampler: TokenBudgetBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        for step in self.sampler.iter_steps():
            if all(step):
                yield step[self.sampler.rank]

    def __len__(self) -> int:
        return sum(1 for step in self.sampler.steps() if all(step))

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


@dataclass
class TokenBudgetDataloaderConfig:
    """``data.dataloader._target_: knapformer.integrations.automodel_data.TokenBudgetDataloaderConfig``.

    ``cache_dir``: one Automodel cache or a list (images and clips mix). ``max_tokens``: latent
    tokens per rank per step (sizes divided by ``patch``: Wan ``[1, 2, 2]``, HunyuanVideo 1.5
    ``[1, 1, 1]``, FLUX.1 ``[2, 2]``). The recipe's ``batch_size`` (``local_batch_size``) is
    not used: the budget decides how many samples a batch holds (``max_samples`` caps it).
    ``drop_last``: drop the epoch's last partial step (the default). Without it the last step's
    batches are halved to reach every rank, and a step that still leaves a rank without a sample
    is left out on every rank (:class:`StepsWithSamples`): Automodel's pipeline cannot take an
    empty batch. Automodel's validation loader defaults to ``drop_last: false``.
    """

    cache_dir: str | list[str]
    max_tokens: int
    patch: list[int] = field(default_factory=lambda: [1, 2, 2])
    latents_key: str = "video_latents"
    max_samples: int | None = None
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True
    num_workers: int = 0

    def lengths(self, dataset: AutomodelCache) -> np.ndarray:
        """Tokens of each sample: its latent sizes over ``patch``, rounded up."""
        out = np.empty(len(dataset), dtype=np.int64)
        for i in range(len(dataset)):
            shape = dataset.latent_shape(i)
            if len(shape) != len(self.patch):
                raise ValueError(f"sample {i} has latent sizes {shape}; patch {list(self.patch)} has another rank")
            out[i] = math.prod(-(-n // p) for n, p in zip(shape, self.patch))
        return out

    def build(self, *, dp_rank: int, dp_world_size: int, batch_size: int | None = None) -> Any:
        """Automodel's ``DiffusionDataloaderBuild`` for this data-parallel rank."""
        from functools import partial

        from nemo_automodel.components.datasets.diffusion.loader import DiffusionDataloaderBuild

        dataset = AutomodelCache(self.cache_dir, self.latents_key)
        sampler = TokenBudgetBatchSampler(
            self.lengths(dataset),
            int(self.max_tokens),
            max_samples=self.max_samples,
            num_replicas=dp_world_size,
            rank=dp_rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
        )
        batches = sampler if self.drop_last else StepsWithSamples(sampler)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=partial(collate_padded, latents_key=self.latents_key),
            num_workers=self.num_workers,
        )
        return DiffusionDataloaderBuild(dataloader=loader, sampler=batches, drop_last=self.drop_last)
