"""NeMo Automodel's own diffusion recipe (``TrainDiffusionRecipe.setup()`` then
``run_train_validation_loop()``) on 2 gloo ranks with tiny models built from local configs:
stock and with knapformer's one hook, in one spawn (importing Automodel costs ~9 s a process).

Only the recipe's numbers are instrumented: the loss each ``FlowMatchingPipeline.step``
returns and the gradient norm ``scale_grads_and_clip_grad_norm`` returns (the recipe logs both
rounded), plus, for the mixed-size case, what the adapter saw and returned."""

from __future__ import annotations

import io
import os

import torch

from tests.hunyuanvideo15_workers import TINY as TINY_HUNYUAN

WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=8,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=64,
)
HUNYUAN = TINY_HUNYUAN
"""Automodel's hunyuan adapter feeds 2 noisy + 2 condition latents + 1 mask channel: 5 in, 2 out."""
FLUX = dict(
    in_channels=16,  # 4 latent channels packed 2x2
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=8,
    pooled_projection_dim=768,  # Automodel's flux adapter passes zeros(B, 768) without CLIP states
    guidance_embeds=True,  # and always passes guidance
    axes_dims_rope=(2, 2, 4),
)
MODELS = {
    "wan": ("WanTransformer3DModel", WAN, "simple", {}),
    "hunyuan": ("HunyuanVideo15Transformer3DModel", HUNYUAN, "hunyuan", {"default_image_embed_shape": [4, 3]}),
    "flux": ("FluxTransformer2DModel", FLUX, "flux", {}),
}


def write_model(kind: str, root: str) -> str:
    """A local model directory (``transformer/config.json``) Automodel's ``pretrain`` mode
    builds from."""
    import diffusers

    cls, cfg, _, _ = MODELS[kind]
    path = os.path.join(root, kind)
    getattr(diffusers, cls)(**cfg).save_config(os.path.join(path, "transformer"))
    return path


def mixed_samples(kind: str, seed: int = 0) -> list[dict]:
    """Samples of different sizes and durations (and text lengths) in Automodel's cache layout."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = []
    if kind == "flux":
        for h, w, txt in [(4, 6, 3), (8, 8, 5), (6, 4, 2), (4, 4, 4), (10, 8, 6), (6, 6, 3), (4, 8, 5), (8, 4, 2)] * 2:
            out.append({"image_latents": rnd(1, 4, h, w), "text_embeddings": rnd(1, txt, 8)})
        return out
    channels, width = (4, 8) if kind == "wan" else (2, 6)
    sizes = [
        (1, 4, 6),
        (5, 8, 8),
        (3, 4, 4),
        (1, 8, 8),
        (2, 6, 4),
        (1, 4, 4),
        (4, 4, 8),
        (1, 6, 6),
        (3, 6, 6),
        (1, 8, 4),
    ]
    for i, (f, h, w) in enumerate(sizes * 2):
        txt = 3 + i % 4
        item = {"video_latents": rnd(1, channels, f, h, w), "text_embeddings": rnd(1, txt, width)}
        if kind == "hunyuan":  # its MLLM mask as Automodel's preprocessing stores it, and byT5 glyph text
            glyph = 1 + i % 3
            item["text_mask"] = torch.ones(1, txt, dtype=torch.long)
            item["text_embeddings_2"] = rnd(1, glyph, 4)
            item["text_mask_2"] = torch.ones(1, glyph, dtype=torch.long)
        out.append(item)
    return out


def uniform_samples(kind: str, n: int = 12, seed: int = 1) -> list[dict]:
    """Same-size samples in Automodel's cache layout, for the stock run: FLUX images (Automodel's
    mock loader makes only videos) and HunyuanVideo clips with byT5 text (the stock diffusers
    model needs it; the mock loader has none)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if kind == "flux":
        return [{"image_latents": rnd(1, 4, 4, 6), "text_embeddings": rnd(1, 5, 8)} for _ in range(n)]
    ones = lambda k: torch.ones(1, k, dtype=torch.long)  # noqa: E731
    return [
        {
            "video_latents": rnd(1, 2, 2, 4, 6),
            "text_embeddings": rnd(1, 5, 6),
            "text_mask": ones(5),
            "text_embeddings_2": rnd(1, 3, 4),
            "text_mask_2": ones(3),
        }
        for _ in range(n)
    ]


def recipe_config(kind: str, root: str, loader: dict, *, lr: float = 1e-3, steps: int = 3) -> dict:
    """A recipe config as Automodel's YAML would give it: fp64, FSDP2 (root sharded),
    ``cp_size: 1``, no checkpointing or logging services."""
    cls, _, adapter, adapter_kwargs = MODELS[kind]
    return {
        "seed": 42,
        "dist_env": {"backend": "gloo", "timeout_minutes": 1},
        "model": {
            "pretrained_model_name_or_path": os.path.join(root, kind),
            "mode": "pretrain",
            "torch_dtype": "float64",
            "compute_dtype": "float64",
            "pipeline_spec": {"transformer_cls": cls, "subfolder": "transformer", "load_full_pipeline": False},
        },
        "step_scheduler": {
            "global_batch_size": 4,  # = local_batch_size x 2 ranks: one micro-batch per step
            "local_batch_size": 2,
            "ckpt_every_steps": 1000,
            "num_epochs": 1,
            "max_steps": steps,
            "log_remote_every_steps": 1,
        },
        "data": {"dataloader": loader},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": lr},
        "flow_matching": {"adapter_type": adapter, "adapter_kwargs": adapter_kwargs, "timestep_sampling": "uniform"},
        "fsdp": {"tp_size": 1, "cp_size": 1, "pp_size": 1, "dp_replicate_size": 1, "reduce_dtype": "float64"},
        "checkpoint": {
            "enabled": False,
            "checkpoint_dir": os.path.join(root, f"ckpt-{kind}"),
            "model_save_format": "safetensors",
            "save_consolidated": False,
        },
    }


def mock_loader(kind: str) -> dict:
    """Automodel's own mock video loader (every sample the same size), for Wan."""
    return {
        "_target_": "nemo_automodel.components.datasets.diffusion.mock_dataloader.build_mock_dataloader",
        "length": 12,
        "num_channels": 4,
        "num_frame_latents": 2,
        "spatial_h": 4,
        "spatial_w": 6,
        "text_seq_len": 5,
        "text_embed_dim": 8,
        "shuffle": False,
    }


def budget_loader(cache: str, kind: str, max_tokens: int) -> dict:
    return {
        "_target_": "knapformer.integrations.automodel_data.TokenBudgetDataloaderConfig",
        "cache_dir": cache,
        "max_tokens": max_tokens,
        "patch": {"wan": [1, 2, 2], "hunyuan": [1, 1, 1], "flux": [2, 2]}[kind],
        "latents_key": "image_latents" if kind == "flux" else "video_latents",
        "shuffle": True,
        "seed": 3,
    }


def run_recipe(cfg: dict, *, knapformer: dict | None = None, record: bool = False) -> dict:
    """Automodel's recipe, set up and trained; ``knapformer``: the hook's arguments (None:
    stock). Returns the per-step losses and gradient norms (and, with ``record``, what the
    adapter saw: per sample inputs, targets and predictions, with the full weights)."""
    import nemo_automodel.recipes.diffusion.train as train
    from nemo_automodel.components.config.loader import ConfigNode

    from knapformer.integrations.automodel import use_knapformer

    norms: list[float] = []
    clip = train.scale_grads_and_clip_grad_norm

    def clip_and_record(*a, **k):
        n = clip(*a, **k)
        norms.append(float(n))
        return n

    train.scale_grads_and_clip_grad_norm = clip_and_record
    try:
        recipe = train.TrainDiffusionRecipe(ConfigNode(cfg))
        recipe.setup()
        adapter = use_knapformer(recipe, **knapformer) if knapformer is not None else None
        pipe = recipe.flow_matching_pipeline
        losses: list[float] = []
        steps: list[dict] = []
        step = pipe.step

        def step_and_record(*a, **k):
            if not torch.is_grad_enabled():  # Automodel's validation (recorded by its own wrapper)
                return step(*a, **k)
            if record:
                batch = k.get("batch", a[1] if len(a) > 1 else None)
                clean = batch["video_latents"] if "video_latents" in batch else batch["image_latents"]
                steps.append({"weights": _full_weights(recipe.model), "clean": clean.clone()})
            out = step(*a, **k)
            losses.append(float(out[1].detach()))
            return out

        pipe.step = step_and_record
        validate = recipe._run_validation_epoch
        vals: list[float] = []
        recipe._run_validation_epoch = lambda step: vals.append(validate(step)) or vals[-1]
        if record:
            _record_adapter(adapter, steps)
            weigh = pipe.compute_loss

            def weigh_and_record(pred, target, sigma, batch=None):
                if torch.is_grad_enabled():
                    steps[-1]["sigma"] = sigma.detach().clone()
                return weigh(pred, target, sigma, batch)

            pipe.compute_loss = weigh_and_record
        recipe.run_train_validation_loop()
    finally:
        train.scale_grads_and_clip_grad_norm = clip
    return {"losses": losses, "norms": norms, "steps": steps, "val": vals}


def _full_weights(model) -> dict:
    """Every parameter, gathered (FSDP2 shards them; every rank calls this equally often)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()  # Automodel checkpoints blocks
    return out


def _record_adapter(adapter, steps: list[dict]) -> None:
    """Keep, per step, the stock adapter's latents, timesteps and guidance (Wan's, HunyuanVideo's
    or FLUX's; the pipeline's noisy latents, which FLUX's adapter packs), the predictions and
    targets."""
    forward, loss = adapter.forward, adapter.inner.compute_loss

    def forward_and_record(model, inputs):
        pred = forward(model, inputs)
        if not torch.is_grad_enabled():  # Automodel's validation: not a training step
            return pred
        for key in (
            "hidden_states",
            "timestep",
            "latents",
            "timesteps",
            "guidance",
            "_noisy_latents",
        ):  # the stock adapter's inputs
            if key in inputs:
                steps[-1][key] = inputs[key].detach().clone()
        steps[-1]["shapes"] = inputs["_shapes"]
        steps[-1]["pred"] = pred.detach().clone()
        return pred

    def loss_and_record(pred, target):
        if torch.is_grad_enabled():
            steps[-1]["target"] = target.detach().clone()
        return loss(pred, target)

    adapter.forward = forward_and_record
    adapter.inner.compute_loss = loss_and_record


def _loader(root: str, kind: str) -> dict:
    """Wan: Automodel's own mock loader; the others: same-size samples from a cache, two per
    batch (see uniform_samples)."""
    if kind == "wan":
        return mock_loader(kind)
    return budget_loader(os.path.join(root, f"{kind}-uniform"), kind, {"flux": 12, "hunyuan": 96}[kind])


def stock_vs_knapformer(rank: int, world: int, root: str, kinds: list[str]) -> dict:
    """Each model: the stock recipe, then the recipe with knapformer (``auto``), same seed; Wan
    also runs Automodel's validation loop after every step; ``wan-ddp``: Wan under
    Automodel's DDP mode instead of FSDP2."""
    torch.set_num_threads(1)
    out = {}
    for name in kinds:
        kind, ddp = name.removesuffix("-ddp"), name.endswith("-ddp")  # "wan-ddp": Automodel's ddp: mode
        runs = []
        for hook in (None, {"layout": "auto"}):
            cfg = recipe_config(kind, root, _loader(root, kind))
            if ddp:
                del cfg["fsdp"]
                cfg["ddp"] = {}
            elif kind == "wan":
                cfg["data"]["validation_dataloader"] = {**_loader(root, kind), "length": 4}
                cfg["step_scheduler"]["val_every_steps"] = 1
            runs.append(run_recipe(cfg, knapformer=hook))
        out[name] = tuple(runs)
    return out


def mixed(rank: int, world: int, root: str, kind: str, max_tokens: int) -> bytes:
    """knapformer's token-budget loader (different sizes and durations on the two ranks),
    recorded for the per-sample reference (as ``torch.save`` bytes: tensors shared through
    the result queue would outlive their process)."""
    torch.set_num_threads(1)
    cfg = recipe_config(kind, root, budget_loader(os.path.join(root, f"{kind}-mixed"), kind, max_tokens))
    cfg["flow_matching"]["i2v_prob"] = 0.0
    cfg["flow_matching"]["cfg_dropout_prob"] = 0.0
    # Automodel's validation on knapformer's loader too (its default drop_last: false for validation)
    cfg["data"]["validation_dataloader"] = budget_loader(os.path.join(root, f"{kind}-mixed"), kind, max_tokens)
    cfg["step_scheduler"]["val_every_steps"] = 3
    buf = io.BytesIO()
    torch.save(run_recipe(cfg, knapformer={"layout": "auto"}, record=True), buf)
    return buf.getvalue()


def bad_sizes_everywhere(rank: int, world: int) -> tuple[str, str]:
    """The adapter alone (no Automodel), Wan, 2 ranks: rank 1's batch says a size larger than its
    padded latents. Every rank raises, naming rank 1, at the step's plan (none waits in a
    collective the other left). Returns (exception type, message)."""
    from types import SimpleNamespace

    import diffusers

    from knapformer.integrations.automodel import KnapformerAdapter

    class SimpleAdapter:  # Automodel's Wan adapter, as far as the knapformer adapter uses it
        def prepare_inputs(self, context):
            n = context.noisy_latents.shape[0]
            return {
                "hidden_states": context.noisy_latents,
                "timestep": torch.full((n,), 500.0, dtype=torch.float64),
                "encoder_hidden_states": context.batch["text_embeddings"],
            }

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WAN).double()
    adapter = KnapformerAdapter(SimpleAdapter())
    latents = torch.randn(2, 4, 2, 4, 6, dtype=torch.float64)
    shapes = [[2, 4, 6], [1, 4, 4]] if rank == 0 else [[2, 4, 6], [1, 6, 4]]  # rank 1: 6 rows > 4
    batch = {"text_embeddings": torch.randn(2, 3, 8, dtype=torch.float64), "latent_shapes": torch.tensor(shapes)}
    try:
        inputs = adapter.prepare_inputs(SimpleNamespace(batch=batch, noisy_latents=latents))
        adapter.forward(model, inputs)
    except Exception as exc:  # noqa: BLE001 (the test compares what each rank raised)
        return type(exc).__name__, str(exc)
    return "ok", ""
