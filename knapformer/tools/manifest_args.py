"""Steps from a dataset manifest, for ``knapformer cluster`` and ``knapformer plan`` (torch-free).

``--manifest FILE`` (CSV, JSONL or Parquet: :mod:`knapformer.data.manifest`) gives each sample's
pixels, frames, frame rate and text length (or a token count); the tokenizer preset of the
model's family (``--tokenizer`` to choose another, :mod:`knapformer.data.tokenizers`) turns them
into sequence lengths; :class:`~knapformer.data.sampler.TokenBudgetBatchSampler` deals them over
the GPUs at ``--budget`` tokens per GPU, one latent shape per batch (``--no-buckets``: any mix),
and the first ``--steps`` whole steps of epoch 0 (``--seed``) are the steps planned.

``knapformer manifest`` writes a synthetic manifest (:mod:`knapformer.data.synthetic`), or with
``--shards`` a folder of Parquet shards (:mod:`knapformer.data.shards`)::

    knapformer manifest --mix realistic --samples 20000 --out realistic.csv
    knapformer manifest --mix realistic --samples 100000000 --shards 1000 --out realistic-100m/
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from knapformer.data.manifest import dealt_steps, manifest_seq_lens, read_manifest, write_manifest
from knapformer.data.synthetic import MANIFEST_MIXES, synthetic_manifest
from knapformer.data.tokenizers import TOKENIZERS, Tokenizer, tokenizer, tokenizer_for_model
from knapformer.tools.cli_support import CliError, positive_int, run_tool

__all__ = ["ManifestSteps", "add_args", "add_manifest_args", "manifest_steps", "run"]

DEFAULT_BUDGET = 65_536
"""Tokens per GPU and step the sampler packs by default (``--budget``)."""


def add_manifest_args(p: argparse.ArgumentParser) -> None:
    """The flags that shape a manifest's steps (``--manifest`` itself is the caller's)."""
    g = p.add_argument_group("manifest")
    g.add_argument(
        "--tokenizer",
        default=None,
        help=f"latent tokens of a manifest of pixels: one of {sorted(TOKENIZERS)} (aliases flux, flux2, wan); "
        "default: the model family's",
    )
    g.add_argument(
        "--budget", type=positive_int, default=DEFAULT_BUDGET, help="sampler: tokens per GPU and step (max_tokens)"
    )
    g.add_argument("--max-samples", type=positive_int, default=None, help="sampler: samples per GPU and step at most")
    g.add_argument(
        "--no-buckets", action="store_true", help="sampler: any latent shapes in one batch (default: one per batch)"
    )
    g.add_argument(
        "--loaders",
        type=positive_int,
        default=None,
        help="sampler: deal over this many data-parallel loaders, each loader's batch on the first GPU of its "
        "block of GPUs/N (a trainer with a fixed sequence-parallel group loads one batch per group: "
        "N = GPUs / group size); default: every GPU loads",
    )


@dataclass(frozen=True)
class ManifestSteps:
    """The steps of a manifest and what made them."""

    steps: list[list[list[int]]]
    """Per step, per GPU: sequence lengths."""
    tokenizer: Tokenizer | None
    """None for a token-count manifest."""
    context_len: int
    """Cross-attention text tokens per sequence (the manifest's mean; 0 for joint text)."""
    num_samples: int


def manifest_steps(args: argparse.Namespace, model: str, num_gpus: int, num_steps: int) -> ManifestSteps:
    """Read ``args.manifest`` and deal its first ``num_steps`` steps over ``num_gpus`` GPUs."""
    m = read_manifest(args.manifest)
    tok = None
    if m.has_pixels:
        tok = tokenizer(args.tokenizer) if args.tokenizer else tokenizer_for_model(model)
        if tok is None:
            raise CliError(
                f"model {model!r} has no tokenizer preset: pass --tokenizer (one of {sorted(TOKENIZERS)}) "
                "or give the manifest a 'tokens' column"
            )
    lens, buckets = manifest_seq_lens(m, tok)
    loaders = getattr(args, "loaders", None) or num_gpus
    if num_gpus % loaders:
        raise CliError(f"--loaders {loaders} does not divide the {num_gpus} GPUs")
    steps = dealt_steps(
        lens,
        None if args.no_buckets else buckets,
        loaders,
        max_tokens=args.budget,
        steps=num_steps,
        seed=args.seed,
        max_samples=args.max_samples,
    )
    if loaders != num_gpus:  # loader i's batch on GPU i * block; the rest of its block loads nothing
        block = num_gpus // loaders
        steps = [[step[r // block] if r % block == 0 else [] for r in range(num_gpus)] for step in steps]
    ctx = tok.context_len(m.text_tokens) if tok is not None else 0
    return ManifestSteps(steps=steps, tokenizer=tok, context_len=ctx, num_samples=len(m))


def add_args(p: argparse.ArgumentParser) -> None:
    """``knapformer manifest``: write a synthetic manifest."""
    p.add_argument("--mix", default="realistic", choices=sorted(MANIFEST_MIXES), help="synthetic mix")
    p.add_argument("--samples", type=positive_int, default=20_000, help="samples to draw")
    p.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
    p.add_argument(
        "--shards",
        type=positive_int,
        default=None,
        help="write this many Parquet shards and their index into the folder --out (knapformer.data.shards: "
        "drawn one shard at a time, for manifests too large for one table)",
    )
    p.add_argument("--out", required=True, help="output file: .csv, .jsonl or .parquet (a folder with --shards)")


def run(args: argparse.Namespace) -> int:
    if args.shards is not None:
        from knapformer.data.shards import write_sharded_manifest

        if args.shards > args.samples:
            raise ValueError(f"--shards {args.shards} is more than --samples {args.samples}")
        sm = write_sharded_manifest(args.out, args.mix, args.samples, shards=args.shards, seed=args.seed)
        print(f"wrote {sm.root} ({len(sm)} samples of mix {args.mix!r} in {sm.num_shards} shards, seed {args.seed})")
        return 0
    m = synthetic_manifest(args.mix, args.samples, seed=args.seed)
    path = write_manifest(m, args.out)
    print(f"wrote {path} ({len(m)} samples of mix {args.mix!r}, seed {args.seed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("manifest", add_args, run, argv, description="write a synthetic dataset manifest")


if __name__ == "__main__":
    sys.exit(main())
