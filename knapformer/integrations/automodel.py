"""Balanced training inside NeMo Automodel's diffusion recipe (``nemo-automodel`` 0.7).

Automodel's ``TrainDiffusionRecipe`` runs each step as ``FlowMatchingPipeline.step``: it samples
timesteps and noise for a dense batch ``[B, C, (F,) H, W]``, asks its *model adapter* for the
model's inputs (``prepare_inputs``) and prediction (``forward``), and takes the adapter's
per-element loss (``compute_loss``) times its loss weight, averaged. knapformer goes in as
that adapter, with one assignment after ``setup()`` (:func:`use_knapformer`):

- :class:`KnapformerAdapter` wraps Automodel's own adapter for the model (``simple`` for Wan,
  ``flux``, ``hunyuan`` for HunyuanVideo 1.5). The stock adapter still prepares the inputs, so
  text dropout, condition latents, timestep units and the random numbers drawn are exactly
  the stock recipe's; knapformer then splits the batch into samples, plans the step over the
  data-parallel group and runs the family's packed, balanced forward (``packed_*_forward``,
  through the model's own ``__call__``, so FSDP2 with a sharded root works).
- A batch may hold samples of different sizes: :mod:`knapformer.integrations.automodel_data`
  pads them into the dense tensors the pipeline needs and says each sample's true size in
  ``batch["latent_shapes"]``. The model never sees the padding; the loss leaves it out.
- **The loss.** Automodel averages the loss over a rank's elements, and FSDP2 then averages
  the gradients over ranks: with equal batches on every rank that is the mean over the whole
  group. With token budgets, ranks hold different numbers of samples and tokens, and the same
  two means weigh an element of a rank with little data more. ``loss="global_mean"`` (the
  default) scales each rank's loss so that the gradients FSDP2 averages are those of the mean
  over every element of the group (:func:`knapformer.training.global_mean_loss`: one
  all-reduce of a count per step). With equal batches it equals the stock loss.
  ``loss="rank_mean"`` keeps Automodel's weighting (padding still left out).

Nothing here imports ``nemo_automodel``: the adapter follows the protocol of Automodel's
``ModelAdapter`` (``prepare_inputs``, ``forward``, ``post_process_prediction``,
``compute_loss``, ``auxiliary_losses``), which its pipeline calls by name.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from knapformer.config import BalancerConfig
from knapformer.integrations._diffusers import called_through
from knapformer.training import global_mean_loss

__all__ = ["KnapformerAdapter", "use_knapformer"]

_LOSSES = ("global_mean", "rank_mean")


@dataclass(frozen=True)
class _Family:
    """How one of Automodel's stock adapters maps onto a knapformer family."""

    name: str
    split: Callable[[Any, dict, list[tuple[int, ...]], Any], list]  # (model, inputs, shapes, adapter) -> samples
    seq_lens: Callable[[Any, list], list[int]]
    forward: Callable[[Any, list, Any], list]  # (model, samples, balancer) -> per-sample outputs
    workload: Callable[[Any], Any]
    unsplit: Callable[[Any, list[torch.Tensor], list[tuple[int, ...]], Any], list[torch.Tensor]]


def _rows(mask: torch.Tensor | None, b: int, x: torch.Tensor) -> torch.Tensor:
    """Sample ``b``'s rows of a padded ``[B, L, D]`` tensor (all rows without a mask)."""
    if mask is None:
        return x[b]
    keep = torch.nonzero(mask[b].cpu().bool()).flatten()  # the loader's mask is on the host: no sync
    return x[b].index_select(0, keep.to(x.device, non_blocking=True))


def _as_is(model, outs: list[torch.Tensor], shapes, inner) -> list[torch.Tensor]:
    """Per-sample outputs already in the stock adapter's layout (Wan, HunyuanVideo 1.5)."""
    return outs


def _crop(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The leading corner ``shape`` of ``x``'s trailing dims (a sample inside a padded batch)."""
    return x[(..., *(slice(0, n) for n in shape))]


# -- Wan (Automodel's "simple" adapter) -------------------------------------------------------------
def _wan_split(model, inputs: dict, shapes, inner) -> list:
    from knapformer.integrations.wan import WanSample

    hs, ts, text = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    mask = inputs.get("_text_mask")
    return [
        WanSample(latents=_crop(hs[b], shape), text=_rows(mask, b, text), timestep=ts[b])
        for b, shape in enumerate(shapes)
    ]


def _wan_family() -> _Family:
    from knapformer.integrations import wan

    return _Family("wan", _wan_split, wan.wan_seq_lens, wan.packed_wan_forward, wan.wan_workload, _as_is)


# -- Flux (Automodel's "flux" adapter) --------------------------------------------------------------
def _flux_split(model, inputs: dict, shapes, inner) -> list:
    from knapformer.integrations.flux import FluxSample

    noisy, text, mask = inputs["_noisy_latents"], inputs["encoder_hidden_states"], inputs.get("_text_mask")
    guided = bool(getattr(model.config, "guidance_embeds", False))
    out = []
    for b, (h, w) in enumerate(shapes):
        rows = _rows(mask, b, text)
        packed = inner._pack_latents(_crop(noisy[b : b + 1], (h, w)))[0]
        out.append(
            FluxSample(
                latents=packed,
                text=rows,
                pooled=inputs["pooled_projections"][b],
                timestep=inputs["timestep"][b],
                img_ids=inner._prepare_latent_image_ids(1, h, w, packed.device, inputs["img_ids"].dtype),
                txt_ids=inputs["txt_ids"][b, : rows.shape[0]],
                guidance=inputs["guidance"][b] if guided else None,
            )
        )
    return out


def _flux_unsplit(model, outs, shapes, inner) -> list[torch.Tensor]:
    vae = 8  # the stock adapter's unpacking works in pixels of an 8x VAE
    return [inner._unpack_latents(o[None], h * vae, w * vae, vae)[0] for o, (h, w) in zip(outs, shapes)]


def _flux_family() -> _Family:
    from knapformer.integrations import flux

    return _Family("flux", _flux_split, flux.flux_seq_lens, flux.packed_flux_forward, flux.flux_workload, _flux_unsplit)


# -- HunyuanVideo 1.5 (Automodel's "hunyuan" adapter) -------------------------------------------------
def _hunyuan_split(model, inputs: dict, shapes, inner) -> list:
    from knapformer.integrations.hunyuanvideo15 import HunyuanVideo15Sample

    lat, ts = inputs["latents"], inputs["timesteps"]
    text, mask = inputs["encoder_hidden_states"], inputs.get("encoder_attention_mask")
    text_2, mask_2 = inputs.get("encoder_hidden_states_2"), inputs.get("encoder_attention_mask_2")
    image = inputs.get("image_embeds")
    return [
        HunyuanVideo15Sample(
            latents=_crop(lat[b], shape),
            text=text[b],
            timestep=ts[b],
            text_mask=None if mask is None else mask[b].bool(),
            text_2=None if text_2 is None else text_2[b],
            text_2_mask=None if mask_2 is None or text_2 is None else mask_2[b].bool(),
            image_embeds=None if image is None else image[b],
        )
        for b, shape in enumerate(shapes)
    ]


def _hunyuan_family() -> _Family:
    from knapformer.integrations import hunyuanvideo15 as hv

    return _Family(
        "hunyuanvideo15",
        _hunyuan_split,
        hv.hunyuanvideo15_seq_lens,
        hv.packed_hunyuanvideo15_forward,
        hv.hunyuanvideo15_workload,
        _as_is,
    )


FAMILIES: dict[str, Callable[[], _Family]] = {
    "SimpleAdapter": _wan_family,
    "FluxAdapter": _flux_family,
    "HunyuanAdapter": _hunyuan_family,
}
"""Automodel adapter class name -> the knapformer family it runs (``flow_matching.adapter_type``
``simple`` = Wan, ``flux`` = FLUX.1, ``hunyuan`` = HunyuanVideo 1.5)."""


def _sizes(given: Any, count: int, full: tuple[int, ...]) -> tuple[list[tuple[int, ...]], str]:
    """Each sample's true latent sizes (``batch["latent_shapes"]``; all ``full`` without it),
    and what is wrong with them ("" when nothing is)."""
    if count == 0:
        return [], "an empty batch: Automodel's pipeline needs at least one sample on every rank per step"
    if given is None:
        return [full] * count, ""
    shapes = [tuple(int(n) for n in s) for s in torch.as_tensor(given).tolist()]
    if len(shapes) != count or any(len(s) != len(full) for s in shapes):
        return (
            shapes,
            f"batch['latent_shapes'] must give the {len(full)} trailing sizes of each of the {count} samples, "
            f"got {shapes}",
        )
    if any(not 0 < n <= m for s in shapes for n, m in zip(s, full)):
        return shapes, f"batch['latent_shapes'] {shapes} must fit the padded latents {full}"
    return shapes, ""


class KnapformerAdapter:
    """Automodel's model adapter, balanced: see the module docstring.

    ``inner``: Automodel's stock adapter for the model (``recipe.flow_matching_pipeline.model_adapter``).
    ``balancer``: a :class:`~knapformer.SequenceBalancer` over the data-parallel group, or None
    to build one at the first step from the model (``layout``, the family's cost model, the
    default process group). ``loss``: ``"global_mean"`` or ``"rank_mean"`` (module docstring);
    either way, under ``torch.no_grad()`` (Automodel's validation) the loss is the rank's mean,
    which is what its validation averages by sample counts.
    """

    def __init__(self, inner: Any, *, balancer: Any = None, layout: str = "auto", loss: str = "global_mean") -> None:
        kind = type(inner).__name__
        if kind not in FAMILIES:
            raise ValueError(
                f"knapformer runs Automodel's adapters {sorted(FAMILIES)} (flow_matching.adapter_type simple, "
                f"flux, hunyuan); got {kind}"
            )
        if loss not in _LOSSES:
            raise ValueError(f"loss must be one of {_LOSSES}, got {loss!r}")
        self.inner, self.family, self.loss = inner, FAMILIES[kind](), loss
        self.balancer, self.layout = balancer, layout
        self._step: dict | None = None  # what compute_loss needs from this step's forward

    # -- the ModelAdapter protocol ----------------------------------------------------------------------
    def prepare_inputs(self, context: Any) -> dict[str, Any]:
        """The stock adapter's inputs, plus each sample's true size and text rows."""
        inputs = self.inner.prepare_inputs(context)
        batch, latents = context.batch, context.noisy_latents
        full = tuple(latents.shape[2:])
        shapes, problem = _sizes(batch.get("latent_shapes"), latents.shape[0], full)
        # a problem only this rank sees is raised on every rank by the step's plan (forward), so
        # that no rank waits in a collective this one has left
        inputs["_problem"] = problem
        inputs["_shapes"] = shapes if not problem else [full] * latents.shape[0]
        inputs["_noisy_latents"] = latents
        mask = batch.get("text_mask")
        if mask is not None and "encoder_hidden_states" in inputs:
            inputs["_text_mask"] = mask[:, : inputs["encoder_hidden_states"].shape[1]]
        return inputs

    def forward(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Plan the step, run the packed forward, and return the dense prediction the
        pipeline expects (each sample in its corner of the padded batch, zeros around it)."""
        shapes = inputs["_shapes"]
        wrapper, model = (model, model.module) if isinstance(model, DistributedDataParallel) else (None, model)
        samples = self.family.split(model, inputs, shapes, self.inner)
        bal = self._balancer(model)
        if inputs["_problem"]:
            bal.report_error(f"KnapformerAdapter: {inputs['_problem']}")
        bal.plan(self.family.seq_lens(model, samples))
        # under DDP (Automodel's ``ddp:`` mode) the wrapper's call runs the packed forward, so DDP
        # prepares its gradient reduction as for a stock forward
        with called_through(wrapper, model) if wrapper is not None else contextlib.nullcontext():
            outs = list(self.family.forward(model, samples, bal))
        outs = self.family.unsplit(model, outs, shapes, self.inner)
        full = tuple(inputs["_noisy_latents"].shape[2:])
        pred = torch.stack(
            [F.pad(o, [p for n, m in zip(reversed(o.shape[1:]), reversed(full)) for p in (0, m - n)]) for o in outs]
        )
        self._step = {"shapes": shapes, "full": full}
        return pred

    def post_process_prediction(self, model_pred: Any) -> Any:
        return self.inner.post_process_prediction(model_pred)

    def compute_loss(self, model_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-element loss whose plain mean (what the pipeline takes, after its per-sample
        weight) is the chosen average over the valid elements: padding weighs 0."""
        loss = self.inner.compute_loss(model_pred, target)
        if self._step is None:
            raise RuntimeError("compute_loss before forward: the adapter keeps the step's sample sizes")
        shapes, full = self._step["shapes"], self._step["full"]
        self._step = None
        channels = loss.shape[1]
        valid = channels * sum(math.prod(s) for s in shapes)
        padded = loss.numel()
        if valid != padded:
            mask = torch.zeros((len(shapes), 1, *full), dtype=loss.dtype, device=loss.device)
            for b, s in enumerate(shapes):
                _crop(mask[b], s).fill_(1)
            loss = loss * mask
        if self.loss == "rank_mean" or not torch.is_grad_enabled():
            return loss * (padded / valid) if valid != padded else loss
        # the pipeline takes mean = sum / padded; global_mean_loss(padded, valid) = world · padded / N
        share = torch.tensor(float(padded), dtype=torch.float64)
        factor = global_mean_loss(share, valid, group=getattr(self.balancer, "group", None)).item()
        return loss * factor

    def auxiliary_losses(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return self.inner.auxiliary_losses(inputs)

    # -- helpers ------------------------------------------------------------------------------------------
    def _balancer(self, model: torch.nn.Module) -> Any:
        if self.balancer is None:
            from knapformer import SequenceBalancer

            self.balancer = SequenceBalancer(BalancerConfig(layout=self.layout, cost=self.family.workload(model)))
        return self.balancer


def use_knapformer(recipe: Any, **kwargs: Any) -> KnapformerAdapter:
    """The one hook: after ``recipe.setup()``, run the recipe's steps (training and validation)
    through knapformer. ``kwargs`` go to :class:`KnapformerAdapter`. Refuses Automodel's own
    context parallelism (``fsdp.cp_size`` > 1): knapformer's per-sequence groups replace it, and
    the two would split the same sequences twice."""
    pipeline = getattr(recipe, "flow_matching_pipeline", None)
    if pipeline is None or not hasattr(pipeline, "model_adapter"):
        raise RuntimeError(
            f"use_knapformer needs a set-up recipe: call recipe.setup() first ({type(recipe).__name__} has no "
            "flow_matching_pipeline with a model_adapter yet)"
        )
    cp = int(getattr(recipe, "cp_size", 1) or 1)
    if cp > 1:
        raise ValueError(
            f"fsdp.cp_size is {cp}: set it to 1 with knapformer (its per-sequence groups replace fixed context "
            "parallelism)"
        )
    if dist.is_initialized() and getattr(recipe, "dp_size", None) not in (None, dist.get_world_size()):
        raise ValueError(
            f"knapformer balances over the data-parallel group, which must be the world here (dp_size "
            f"{recipe.dp_size}, world {dist.get_world_size()}): leave tp/pp/cp at 1"
        )
    inner = pipeline.model_adapter
    if isinstance(inner, KnapformerAdapter):
        return inner
    adapter = KnapformerAdapter(inner, **kwargs)
    pipeline.model_adapter = adapter
    return adapter
