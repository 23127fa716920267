"""Describing a dataset directly: manifests, tokenizer presets, the synthetic mixes, the sampler's
steps, and ``knapformer cluster``/``plan --manifest`` (issue 42)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from knapformer.cli import main
from knapformer.data import (
    TOKENIZERS,
    Manifest,
    dealt_steps,
    manifest_seq_lens,
    read_manifest,
    synthetic_manifest,
    tokenizer,
    tokenizer_for_model,
    write_manifest,
)
from knapformer.integrations.registry import CONFIGS, FAMILIES, family_sizes, model_config

ROOT = Path(__file__).resolve().parent.parent


def test_tokenizer_presets_count_the_published_latent_tokens():
    """Wan: 81 frames of 832×480 are 21 × 30 × 52 = 32,760 tokens (text is context); Flux: 16×16
    pixels per token plus the text; a 30 fps clip is resampled to Wan's 16 fps first."""
    wan, flux = tokenizer("wan"), tokenizer("flux")
    assert wan.seq_lens([832], [480], [81], [300]).tolist() == [32_760]
    assert wan.context_len([100, 301]) == 200 and flux.context_len([100, 301]) == 0
    assert flux.seq_lens([1024, 2048], [1024, 2048], [1, 1], [100, 20]).tolist() == [4_196, 16_404]
    # 161 frames at 30 fps -> 1 + 160·16/30 = 86 frames -> 22 latent frames of 45 × 80
    assert wan.seq_lens([1280], [720], [161], [0], [30]).tolist() == [22 * 45 * 80]
    assert wan.seq_lens([1280], [720], [161], [0], [16]).tolist() == [41 * 45 * 80]
    # a causal VAE keeps the first frame alone: 16 frames are 1 + 15 // 4 = 4 latent frames
    assert wan.seq_lens([832, 832], [480, 480], [16, 1], [0, 0]).tolist() == [4 * 1560, 1560]
    assert tokenizer_for_model("diffusers-wan-14b") is TOKENIZERS["diffusers-wan"]
    assert tokenizer_for_model("torchtitan-flux-dev") is TOKENIZERS["torchtitan-flux"]
    assert tokenizer_for_model("transformer-tiny") is None
    with pytest.raises(ValueError, match="unknown tokenizer 'sd3'"):
        tokenizer("sd3")


def test_every_integrated_family_has_a_tokenizer_preset():
    """One preset per registered family (the reference models take Flux's)."""
    assert set(FAMILIES) - {"reference"} <= set(TOKENIZERS)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_manifests_round_trip_in_every_format(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    m = synthetic_manifest("longtail", 300, seed=3)
    back = read_manifest(write_manifest(m, tmp_path / f"m{suffix}"))
    for name, col in m.columns().items():
        assert np.array_equal(getattr(back, name), col), name
    tokens = Manifest(tokens=np.array([5, 7, 9]))
    assert read_manifest(write_manifest(tokens, tmp_path / f"t{suffix}")).tokens.tolist() == [5, 7, 9]


def test_manifest_defaults_and_errors_name_the_culprit(tmp_path):
    """Optional columns default (an image, no fps, no text); a bad value names its file, row and
    column; a missing column, an unknown format and a missing pyarrow say what to do."""
    f = tmp_path / "m.csv"
    f.write_text("width,height\n512,512\n1024,768\n")
    m = read_manifest(f)
    assert m.frames.tolist() == [1, 1] and m.text_tokens.tolist() == [0, 0]
    f.write_text("width,height,frames\n512,512,1\n512,x,1\n")
    with pytest.raises(ValueError, match=r"m.csv' row 1: height = 'x' is not an integer"):
        read_manifest(f)
    f.write_text("width,frames\n512,1\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['height'\]"):
        read_manifest(f)
    f.write_text("width,height,frames\n512,512,0\n")
    with pytest.raises(ValueError, match="row 0: frames = 0 must be >= 1"):
        read_manifest(f)
    j = tmp_path / "m.jsonl"
    j.write_text('{"tokens": 5}\n[1]\n')
    with pytest.raises(ValueError, match="line 2: a row must be a JSON object"):
        read_manifest(j)
    with pytest.raises(ValueError, match="unknown format '.txt'"):
        read_manifest(tmp_path / "m.txt") if (tmp_path / "m.txt").write_text("x") else None
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "from knapformer.data import read_manifest\n"
        f"read_manifest({str(tmp_path / 'x.parquet')!r})\n"
    )
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "pip install 'knapformer[parquet]'" in res.stderr


def test_the_sampler_deals_each_sample_once_within_budget_one_shape_per_batch():
    m = synthetic_manifest("realistic", 4000, seed=1)
    lens, buckets = manifest_seq_lens(m, tokenizer("wan"))
    steps = dealt_steps(lens, buckets, 16, max_tokens=65_536, steps=4, seed=1)
    assert len(steps) == 4 and all(len(s) == 16 for s in steps)
    seen = [x for s in steps for batch in s for x in batch]
    assert all(sum(b) <= 65_536 or len(b) == 1 for s in steps for b in s)  # a long clip alone
    assert len(seen) <= len(lens)
    # Wan's lengths are its latent grids (text is context): one shape per batch, one length
    assert all(len(set(b)) <= 1 for s in steps for b in s)
    with pytest.raises(ValueError, match="fill .* whole step"):
        dealt_steps(lens[:100], buckets[:100], 64, max_tokens=65_536, steps=3)


def test_synthetic_mixes_are_seeded_and_shaped_as_documented():
    a, b = synthetic_manifest("realistic", 10_000, seed=5), synthetic_manifest("realistic", 10_000, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a.columns().values(), b.columns().values()))
    clips = a.frames > 1
    big = (a.width == 2048) & (a.height == 2048)
    assert abs(clips.mean() - 0.10) < 0.02 and abs(big.mean() - 0.30) < 0.02
    assert a.text_tokens.min() >= 20 and a.text_tokens.max() <= 300
    assert (a.width % 16 == 0).all() and (a.height % 16 == 0).all()
    assert set(((a.frames[clips] - 1) // 16).tolist()) <= set(range(2, 11)) and set(a.fps[clips].tolist()) == {16}
    with pytest.raises(ValueError, match="unknown manifest mix 'laion'"):
        synthetic_manifest("laion", 10)


def test_every_family_size_is_known_without_torch():
    """``model_config`` reads every registered family's sizes (Wan 1.3B/14B, Flux-dev, Flux.2,
    torchtitan Flux, ...) from torch-free tables."""
    code = (
        "import sys\n"
        "from knapformer.integrations.registry import CONFIGS, family_sizes, model_config\n"
        "for fam in CONFIGS:\n"
        "    for size in family_sizes(fam):\n"
        "        c = model_config(f'{fam}-{size}')\n"
        "        assert c.dim % c.num_heads == 0 and c.num_layers > 0\n"
        "print('torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert res.stdout.strip() == "False"
    assert set(CONFIGS) == set(FAMILIES) - {"reference"}
    wan = model_config("diffusers-wan-14b")
    assert (wan.dim, wan.num_heads, wan.num_layers, wan.ffn_dim) == (5120, 40, 40, 13824)
    assert (model_config("diffusers-wan-1.3b").dim, model_config("diffusers-flux2-dev").dim) == (1536, 6144)
    assert {"dev", "tiny"} <= set(family_sizes("torchtitan-flux"))


def _readme_command() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return next(x for x in lines if x.startswith("knapformer cluster --manifest")).split()[1:]


def test_cluster_manifest_from_the_readme_reports_auto_against_static_ulysses(capsys, monkeypatch):
    """The README's one command: auto against data parallel and the best static layout, each with
    its memory; auto within 0.5% of the static layout on every sampled step."""
    monkeypatch.chdir(ROOT)
    assert main([*_readme_command(), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^g8n8 .*1\.000", out, re.M) and "vs static" in out and "max tok" in out
    assert main([*_readme_command(), "--quiet", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    none, auto, static = doc["rows"][0], doc["rows"][1], doc["static"]
    assert none["bags"] == "none" and auto["bags"] == "auto" and re.fullmatch(r"g\d+n\d+", static["bags"])
    assert all(a <= 1.005 * s for a, s in zip(auto["step_times"], static["step_times"]))
    assert doc["manifest"]["samples"] == 5000 and doc["manifest"]["tokenizer"] == "diffusers-wan"
    assert 20 <= doc["manifest"]["context_len"] <= 300 and auto["max_tokens"] > 0


def test_cluster_flags_a_baseline_over_the_memory_cap(capsys, monkeypatch):
    """Under ``--max-tokens`` auto plans within the cap; a baseline that needs more is flagged."""
    monkeypatch.chdir(ROOT)
    args = [*_readme_command(), "--quiet", "--json", "--steps", "1", "--max-tokens", "80000"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0]["over_cap"] is True  # a 147k-token clip loaded whole by one GPU
    assert doc["rows"][1]["over_cap"] is False and doc["rows"][1]["max_tokens"] <= 80000


def test_plan_manifest_takes_the_model_flag_and_reports_each_step(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["plan", "--manifest", "examples/manifests/realistic.csv", "--gpus", "16", "--model", "diffusers-flux-dev"]
    assert main([*args, "--hardware", "h100", "--bags", "auto", "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["step", "seqs", "per"] and len(out) == 3
    assert main([*args, "--bags", "auto", "--heads", "8"]) == 2
    assert "gives the model's sizes; drop --heads" in capsys.readouterr().err


def test_loaders_put_one_batch_per_group_on_its_first_gpu(capsys, monkeypatch):
    """``--loaders 8`` on 64 GPUs (a trainer with a fixed group of 8 loading one sample per
    group, as HunyuanVideo 1.5's train.py): the sampler's 8-replica steps, each batch on GPU 8i,
    the other GPUs empty; a count that does not divide the GPUs is refused."""
    monkeypatch.chdir(ROOT)
    args = ["cluster", "--manifest", "examples/manifests/realistic.csv", "--gpus", "64"]
    args += ["--model", "diffusers-hunyuanvideo15-8.3b", "--max-samples", "1", "--steps", "2", "--quiet", "--json"]
    assert main([*args, "--loaders", "8", "--bags", "g8n8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    from knapformer.tools.manifest_args import manifest_steps

    ns = type("Args", (), dict(manifest=args[2], tokenizer=None, budget=65_536, max_samples=1, no_buckets=False))
    ns.seed, ns.loaders = 0, 8
    steps = manifest_steps(ns, "diffusers-hunyuanvideo15-8.3b", 64, 2).steps
    lens, buckets = manifest_seq_lens(read_manifest(args[2]), tokenizer_for_model("diffusers-hunyuanvideo15-8.3b"))
    dealt = dealt_steps(lens, buckets, 8, max_tokens=65_536, steps=2, seed=0, max_samples=1)
    assert [[s[r] for r in range(0, 64, 8)] for s in steps] == dealt
    assert all(len(s[r]) == (r % 8 == 0) for s in steps for r in range(64))
    assert doc["rows"][1]["bags"] == "g8n8" and doc["rows"][0]["max_tokens"] == max(max(s)[0] for s in dealt)
    assert main([*args, "--loaders", "6"]) == 2
    assert "--loaders 6 does not divide the 64 GPUs" in capsys.readouterr().err


def test_a_sharded_manifest_gives_the_lengths_and_buckets_of_the_whole_table(tmp_path, capsys):
    """``knapformer manifest --shards``: the shards together are the manifest, their lengths
    memory-mapped equal the one-table computation, a latent grid gets one bucket key in every
    shard, and the sampler deals them window by window."""
    pytest.importorskip("pyarrow")
    from knapformer.data import ShardedManifest, TokenBudgetBatchSampler, read_manifest
    from knapformer.data.shards import bucket_keys

    out = tmp_path / "m"
    assert main(["manifest", "--mix", "realistic", "--samples", "3000", "--shards", "4", "--out", str(out)]) == 0
    assert "in 4 shards" in capsys.readouterr().out
    sm = ShardedManifest(out)
    assert len(sm) == 3000 and sm.num_shards == 4
    tok = tokenizer_for_model("diffusers-wan-14b")
    lens, buckets = sm.seq_lens(tok)
    assert isinstance(lens, np.memmap) and lens.dtype == np.int32
    parts = [read_manifest(out / f) for f in sm.index.files]
    whole = np.concatenate([manifest_seq_lens(p, tok)[0] for p in parts])
    assert np.array_equal(np.asarray(lens), whole)
    grids = np.concatenate([np.stack(tok.latent_grid(p.width, p.height, p.frames, p.fps), 1) for p in parts])
    assert np.array_equal(np.asarray(buckets), bucket_keys(grids[:, 0], grids[:, 1], grids[:, 2]))
    again = ShardedManifest(out).seq_lens(tok)[0]  # the second time: the files, mapped
    assert np.array_equal(np.asarray(again), whole)
    s = TokenBudgetBatchSampler(
        lens, 65_536, buckets=buckets, num_replicas=4, rank=1, window=700, block=50, oversize="alone"
    )
    seen = [i for step in s.steps() for b in step for i in b]
    assert s.windowed and sorted(seen) == list(range(3000))
    for step in s.steps():
        for b in step:
            assert len({int(buckets[i]) for i in b}) <= 1
    assert main(["manifest", "--samples", "3", "--shards", "5", "--out", str(tmp_path / "bad")]) == 2
    assert "more than --samples" in capsys.readouterr().err


def test_parquet_shards_read_rows_by_index_and_map_columns(tmp_path):
    pytest.importorskip("pyarrow")
    import pickle

    from knapformer.data import ParquetShards, write_shards

    rows = [{"x": i, "blob": bytes([i % 256]) * (i % 5), "name": f"s{i}"} for i in range(53)]
    ds = write_shards(tmp_path, rows, rows_per_shard=10, note="test")
    assert len(ds) == 53 and len(ds.index.files) == 6 and ds.index.meta["note"] == "test"
    for i in (0, 9, 10, 52, -1):
        assert ds[i] == rows[i]
    assert ds.locate(25) == (2, 5)
    with pytest.raises(IndexError):
        ds[53]
    col = ds.column("x", np.int32)
    assert isinstance(col, np.memmap) and col.tolist() == list(range(53))
    clone = pickle.loads(pickle.dumps(ds))  # a DataLoader worker's copy opens its own shard
    assert clone._open is None and clone[31] == rows[31]
    with pytest.raises(ValueError, match="no index.json"):
        ParquetShards(tmp_path / "nowhere")
