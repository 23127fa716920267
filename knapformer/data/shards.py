"""Datasets in shards: Parquet files with a small index, read a shard or a row at a time.

Large image and video sets (10M–2B samples) live in thousands of shard files, not in one table
a process could hold. Two kinds of shards go through here:

- a **sharded manifest** (:func:`write_sharded_manifest`, ``knapformer manifest --shards N``):
  each sample's shape (the manifest's columns, :mod:`knapformer.data.manifest`) in Parquet
  shards, and :meth:`ShardedManifest.seq_lens` — each sample's sequence length and bucket for a
  tokenizer, computed one shard at a time into two ``.npy`` files beside the shards and opened
  memory-mapped (``mmap_mode="r"``). The processes of a node then share those pages instead of
  each holding a copy, and :class:`~knapformer.data.sampler.TokenBudgetBatchSampler` takes
  them as they are (a 100M-sample dataset is 400 MB of lengths on disk, no Python objects);
- **sample shards** (:class:`ParquetShards`): the samples themselves (e.g. latents and text
  embeddings as bytes), row ``i`` of the dataset found through the shard index; a worker keeps
  the shard it read last, so a sampler that keeps consecutive samples together (its blocks)
  reads each shard once per block.

Both share the index file ``index.json``: the shards' file names and row counts, in order, so
that sample ``i`` is row ``i − offsets[s]`` of shard ``s``. Needs ``pyarrow`` (the ``parquet``
extra). Torch-free. Legend: n samples, S shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knapformer.data.manifest import COLUMNS, Manifest, _require_pyarrow
from knapformer.data.tokenizers import Tokenizer

__all__ = ["INDEX", "ParquetShards", "ShardedManifest", "bucket_keys", "write_shards", "write_sharded_manifest"]

INDEX = "index.json"
"""The index file of a folder of shards."""
_VERSION = 1


@dataclass(frozen=True)
class _Index:
    """Shard file names and row counts, in dataset order."""

    root: Path
    files: tuple[str, ...]
    rows: tuple[int, ...]
    meta: dict

    @classmethod
    def read(cls, root: str | Path) -> _Index:
        root = Path(root)
        path = root / INDEX
        if not path.is_file():
            raise ValueError(f"{str(root)!r} is not a folder of shards: it has no {INDEX}")
        try:
            doc = json.loads(path.read_text())
            files = tuple(str(s["file"]) for s in doc["shards"])
            rows = tuple(int(s["rows"]) for s in doc["shards"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{str(path)!r} is not a shard index: {exc}") from None
        if doc.get("version") != _VERSION or any(r < 0 for r in rows):
            raise ValueError(f"{str(path)!r}: unsupported shard index (version {doc.get('version')!r})")
        return cls(root, files, rows, {k: v for k, v in doc.items() if k not in ("shards", "version")})

    @staticmethod
    def write(root: Path, files: Sequence[str], rows: Sequence[int], **meta) -> None:
        doc = {"version": _VERSION, **meta, "shards": [{"file": f, "rows": int(n)} for f, n in zip(files, rows)]}
        tmp = root / (INDEX + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(root / INDEX)

    @property
    def offsets(self) -> np.ndarray:
        """(S + 1,) the first sample of each shard, and n."""
        return np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)])


def bucket_keys(t: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """One int64 per latent grid (frames, rows, columns), the same in every shard (a sharded
    dataset's buckets: :func:`~knapformer.data.manifest.manifest_seq_lens` numbers them per
    table, which would differ between shards)."""
    t, h, w = (np.asarray(a, dtype=np.int64) for a in (t, h, w))
    if (t >= 1 << 23).any() or (h >= 1 << 20).any() or (w >= 1 << 20).any():
        raise ValueError("latent grid too large for a bucket key (frames < 2^23, rows and columns < 2^20)")
    return (t << 40) | (h << 20) | w


class ShardedManifest:
    """A manifest in Parquet shards (module docstring); ``root``: its folder."""

    def __init__(self, root: str | Path) -> None:
        self.index = _Index.read(root)
        self.root = self.index.root

    def __len__(self) -> int:
        return int(sum(self.index.rows))

    @property
    def num_shards(self) -> int:
        return len(self.index.files)

    def shard(self, s: int) -> Manifest:
        """Shard ``s`` as a :class:`~knapformer.data.manifest.Manifest`."""
        from knapformer.data.manifest import read_manifest

        return read_manifest(self.root / self.index.files[s])

    def seq_lens(self, tok: Tokenizer | None) -> tuple[np.ndarray, np.ndarray]:
        """((n,) int32 lengths, (n,) int64 bucket keys) for tokenizer ``tok`` (None: a
        token-count manifest, one bucket), memory-mapped read-only from ``lengths-<name>.npy``
        and ``buckets-<name>.npy`` in the folder — computed one shard at a time the first time
        (then every process of a node maps the same pages)."""
        name = tok.name if tok is not None else "tokens"
        paths = [self.root / f"{what}-{name}.npy" for what in ("lengths", "buckets")]
        if not all(p.is_file() for p in paths):
            self._compute(tok, paths)
        lens, buckets = (np.load(p, mmap_mode="r") for p in paths)
        if lens.shape != (len(self),) or buckets.shape != (len(self),):
            raise ValueError(f"{str(paths[0])!r} does not match the shard index ({len(self)} samples): delete it")
        return lens, buckets

    def _compute(self, tok: Tokenizer | None, paths: list[Path]) -> None:
        n = len(self)
        tmp = [p.with_suffix(".tmp.npy") for p in paths]
        lens = np.lib.format.open_memmap(tmp[0], mode="w+", dtype=np.int32, shape=(n,))
        keys = np.lib.format.open_memmap(tmp[1], mode="w+", dtype=np.int64, shape=(n,))
        for s, (lo, hi) in enumerate(zip(self.index.offsets[:-1], self.index.offsets[1:])):
            m = self.shard(s)
            if m.has_pixels:
                if tok is None:
                    raise ValueError("a manifest of pixels needs a tokenizer to count its tokens")
                seq = tok.seq_lens(m.width, m.height, m.frames, m.text_tokens, m.fps)
                key = bucket_keys(*tok.latent_grid(m.width, m.height, m.frames, m.fps))
            else:
                seq, key = m.tokens, np.zeros(len(m), dtype=np.int64)
            if len(m) != hi - lo:
                raise ValueError(f"shard {self.index.files[s]!r} has {len(m)} rows, the index says {hi - lo}")
            if seq.size and int(seq.max()) >= 1 << 31:
                raise ValueError(f"shard {self.index.files[s]!r}: a sequence of {int(seq.max())} tokens")
            lens[lo:hi] = seq
            keys[lo:hi] = key
        lens.flush()
        keys.flush()
        del lens, keys
        for t, p in zip(tmp, paths):  # whole files appear at once: a crash leaves no half-written cache
            t.replace(p)


def write_sharded_manifest(
    root: str | Path, mix: str, num_samples: int, *, shards: int, seed: int = 0
) -> ShardedManifest:
    """A synthetic manifest of ``num_samples`` samples of ``mix``
    (:func:`~knapformer.data.synthetic.synthetic_manifest`) in ``shards`` Parquet shards under
    ``root``, drawn and written one shard at a time (shard s from its own seed; a 100M-sample
    manifest never exists as one table)."""
    from knapformer.data.manifest import write_manifest
    from knapformer.data.synthetic import synthetic_manifest

    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or not 1 <= shards <= num_samples:
        raise ValueError(f"shards must be an int in [1, num_samples={num_samples}], got {shards!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [num_samples // shards + (s < num_samples % shards) for s in range(shards)]
    files = []
    for s, n in enumerate(rows):
        files.append(f"shard-{s:06d}.parquet")
        write_manifest(synthetic_manifest(mix, n, seed=seed * 1_000_003 + s), root / files[-1])
    _Index.write(root, files, rows, kind="manifest", mix=mix, seed=seed, columns=list(COLUMNS))
    return ShardedManifest(root)


def write_shards(root: str | Path, rows: Iterable[dict], *, rows_per_shard: int, **meta) -> ParquetShards:
    """Write ``rows`` (dicts of the same keys: ints, floats, bytes, strings) to Parquet shards of
    ``rows_per_shard`` rows under ``root``, with their index; returns the reader."""
    pa, pq = _require_pyarrow()
    if isinstance(rows_per_shard, bool) or not isinstance(rows_per_shard, int) or rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be a positive int, got {rows_per_shard!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    counts: list[int] = []
    buf: list[dict] = []

    def flush() -> None:
        files.append(f"shard-{len(files):06d}.parquet")
        counts.append(len(buf))
        pq.write_table(pa.Table.from_pylist(buf), root / files[-1])
        buf.clear()

    for row in rows:
        buf.append(row)
        if len(buf) == rows_per_shard:
            flush()
    if buf:
        flush()
    _Index.write(root, files, counts, kind="samples", **meta)
    return ParquetShards(root)


class ParquetShards:
    """Rows of a dataset in Parquet shards (:func:`write_shards`), by dataset index: ``ds[i]`` is
    a dict of the row's columns. Keeps the last shard it read (pickles without it: each
    ``DataLoader`` worker opens its own)."""

    def __init__(self, root: str | Path) -> None:
        self.index = _Index.read(root)
        self.root = self.index.root
        self._offsets = self.index.offsets
        self._open: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, row in it) of dataset row ``i``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of a dataset of {n}")
        i = i % n
        s = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return s, i - int(self._offsets[s])

    def __getitem__(self, i: int) -> dict:
        s, r = self.locate(int(i))
        if self._open is None or self._open[0] != s:
            _, pq = _require_pyarrow()
            self._open = (s, pq.read_table(self.root / self.index.files[s]).to_pydict())
        return {k: v[r] for k, v in self._open[1].items()}

    def column(self, name: str, dtype=np.int64) -> np.ndarray:
        """Column ``name`` of every row, as ``dtype``, memory-mapped read-only from
        ``<name>.npy`` beside the shards — read one shard at a time into it the first time (run it
        on one process first, e.g. rank 0 before a barrier; then every process of a node maps the
        same pages). Sample lengths and buckets for the sampler come this way."""
        path = self.root / f"{name}.npy"
        if not path.is_file():
            _, pq = _require_pyarrow()
            tmp = path.with_suffix(".tmp.npy")
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(len(self),))
            for s, (lo, hi) in enumerate(zip(self._offsets[:-1], self._offsets[1:])):
                values = pq.read_table(self.root / self.index.files[s], columns=[name]).column(name).to_numpy()
                if values.size != hi - lo:
                    raise ValueError(f"shard {self.index.files[s]!r} has {values.size} rows, the index says {hi - lo}")
                out[lo:hi] = values
            out.flush()
            del out
            tmp.replace(path)
        arr = np.load(path, mmap_mode="r")
        if arr.shape != (len(self),) or arr.dtype != np.dtype(dtype):
            raise ValueError(
                f"{str(path)!r} does not match the shards ({len(self)} rows of {np.dtype(dtype)}): delete it"
            )
        return arr

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}
