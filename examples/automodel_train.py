"""NeMo Automodel's diffusion recipe, balanced by knapformer: Automodel's own launcher plus one line.

    torchrun --nproc-per-node 8 examples/automodel_train.py -c my_wan.yaml   # your config (docs/automodel.md)
    torchrun --nproc-per-node 2 examples/automodel_train.py --tiny DIR        # a tiny Wan on CPU (gloo)

``--tiny DIR`` writes a tiny Wan 2.1 config, a cache of clips and images of different sizes
and durations (Automodel's cache layout) and a recipe config into ``DIR``, then trains 3 steps
with knapformer's token-budget loader: ranks hold different numbers of samples of different
sizes, which Automodel's own loaders cannot batch. Needs ``nemo-automodel`` (``make setup``
installs it) and diffusers.
"""

from __future__ import annotations

import os
import sys

import torch
import yaml


def write_tiny(root: str) -> str:
    """A tiny Wan, a mixed-size cache and the recipe config (YAML) under ``root``; the config's path."""
    from diffusers import WanTransformer3DModel

    from knapformer.integrations.automodel_data import write_automodel_cache

    WanTransformer3DModel(
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
    ).save_config(os.path.join(root, "wan", "transformer"))
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 8, 8), (5, 8, 8), (3, 4, 6), (1, 4, 4), (2, 6, 6), (4, 4, 8), (1, 6, 4), (3, 8, 4)] * 3
    samples = [
        {
            "video_latents": torch.randn(1, 4, f, h, w, generator=g),
            "text_embeddings": torch.randn(1, 3 + i % 5, 8, generator=g),
        }
        for i, (f, h, w) in enumerate(sizes)
    ]
    write_automodel_cache(os.path.join(root, "cache"), samples)
    config = {
        "seed": 42,
        "dist_env": {"backend": "gloo", "timeout_minutes": 1},
        "model": {
            "pretrained_model_name_or_path": os.path.join(root, "wan"),
            "mode": "pretrain",
            "torch_dtype": "float32",
            "compute_dtype": "float32",
            "pipeline_spec": {"transformer_cls": "WanTransformer3DModel", "subfolder": "transformer"},
        },
        # one token-budget batch per rank per optimizer step: global = local x data-parallel ranks
        "step_scheduler": {
            "global_batch_size": 2,
            "local_batch_size": 1,
            "max_steps": 3,
            "num_epochs": 1,
            "ckpt_every_steps": 1000,
            "log_remote_every_steps": 1,
        },
        "data": {
            "dataloader": {
                "_target_": "knapformer.integrations.automodel_data.TokenBudgetDataloaderConfig",
                "cache_dir": os.path.join(root, "cache"),
                "max_tokens": 80,  # latent tokens per rank per step: (frames, h/2, w/2) for Wan
                "patch": [1, 2, 2],
            }
        },
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-4},
        "flow_matching": {"adapter_type": "simple", "timestep_sampling": "uniform"},
        "fsdp": {"tp_size": 1, "cp_size": 1, "pp_size": 1, "dp_replicate_size": 1},  # cp_size 1: knapformer's groups
        "checkpoint": {
            "enabled": False,
            "checkpoint_dir": os.path.join(root, "ckpt"),
            "model_save_format": "safetensors",
            "save_consolidated": False,
        },
    }
    path = os.path.join(root, "wan_knapformer.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def main() -> None:
    from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    from nemo_automodel.recipes.diffusion.train import TrainDiffusionRecipe

    from knapformer.integrations.automodel import use_knapformer

    argv = sys.argv[1:]
    if argv[:1] == ["--tiny"] and len(argv) == 2:
        # every rank writes its own copy (the same bytes): no rank reads a file another is writing
        root = os.path.join(argv[1], f"rank{os.environ.get('RANK', '0')}")
        cfg = parse_args_and_load_config(write_tiny(root), argv=[])
    else:
        cfg = parse_args_and_load_config("my_wan.yaml", argv=argv)
    torch.set_num_threads(1)
    recipe = TrainDiffusionRecipe(cfg)
    recipe.setup()
    use_knapformer(recipe)  # the one line: steps and validation go through knapformer
    recipe.run_train_validation_loop()
    if recipe.dist_env.is_main:
        print(f"knapformer: trained {int(recipe.step_scheduler.step)} steps with Automodel's recipe", flush=True)


if __name__ == "__main__":
    main()
