"""A dataset described by its samples' shapes: the manifest (CSV, JSONL or Parquet).

One row per sample. Either its pixels —

- ``width``, ``height`` (required), ``frames`` (default 1: an image), ``fps`` (the clip's frame
  rate; default 0 = unknown, no resampling), ``text_tokens`` (default 0) —

or a plain token count ``tokens`` (the sequence length as the model sees it; the tokenizer
is then not used). Extra columns are ignored. :func:`read_manifest` validates every row and
names the file, row and column of a bad value; Parquet needs ``pyarrow`` (the ``parquet``
extra), imported only for Parquet files.

:func:`manifest_seq_lens` turns a manifest into per-sample sequence lengths with a tokenizer
preset (:mod:`knapformer.data.tokenizers`), and the bucket each sample falls in (its latent
grid), the form :class:`~knapformer.data.sampler.TokenBudgetBatchSampler` takes.

Legend: ``n`` samples.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from knapformer.data.tokenizers import Tokenizer

__all__ = ["COLUMNS", "Manifest", "dealt_steps", "manifest_seq_lens", "read_manifest", "write_manifest"]

COLUMNS = ("width", "height", "frames", "fps", "text_tokens")
"""The pixel columns, in the order :func:`write_manifest` writes them."""
_DEFAULTS = {"frames": 1, "fps": 0, "text_tokens": 0}
_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True, eq=False)
class Manifest:
    """Per-sample columns, each an (n,) int64 array; ``tokens`` set for a token-count manifest
    (then the pixel columns are None)."""

    width: np.ndarray | None = None
    height: np.ndarray | None = None
    frames: np.ndarray | None = None
    fps: np.ndarray | None = None
    text_tokens: np.ndarray | None = None
    tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.width is None):
            raise ValueError("a manifest holds either token counts or pixel columns (width, height, ...), not both")
        cols = {"tokens": self.tokens} if self.tokens is not None else {c: getattr(self, c) for c in COLUMNS}
        n = None
        for name, v in cols.items():
            if v is None:
                raise ValueError(f"manifest column {name!r} is missing")
            arr = np.asarray(v)
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
                raise ValueError(f"manifest column {name!r} must be a 1-D array of ints, got {arr.dtype} {arr.shape}")
            n = arr.size if n is None else n
            if arr.size != n:
                raise ValueError(f"manifest column {name!r} has {arr.size} rows, the others {n}")
            object.__setattr__(self, name, arr.astype(np.int64))
        lows = {"tokens": 1, "width": 1, "height": 1, "frames": 1, "fps": 0, "text_tokens": 0}
        for name in cols:
            bad = np.flatnonzero(getattr(self, name) < lows[name])
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"manifest row {i}: {name} = {int(getattr(self, name)[i])} must be >= {lows[name]}")

    def __len__(self) -> int:
        return int((self.tokens if self.tokens is not None else self.width).size)

    @property
    def has_pixels(self) -> bool:
        return self.tokens is None

    def columns(self) -> dict[str, np.ndarray]:
        """The manifest's columns by name (what :func:`write_manifest` writes)."""
        if self.tokens is not None:
            return {"tokens": self.tokens}
        return {c: getattr(self, c) for c in COLUMNS}


def _format(path: Path) -> str:
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"manifest {str(path)!r}: unknown format {path.suffix!r}; use .csv, .jsonl or .parquet")
    return fmt


def _require_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            "reading or writing a Parquet manifest needs pyarrow: pip install 'knapformer[parquet]' "
            "(or use a .csv or .jsonl manifest)"
        ) from exc
    return pa, pq


def _rows(path: Path, fmt: str) -> tuple[list[str], list[dict]]:
    """(column names, rows as dicts of raw values) of a CSV or JSONL file."""
    if fmt == "csv":
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            return list(reader.fieldnames or []), rows
    rows, names = [], {}
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"manifest {str(path)!r} line {line_no}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"manifest {str(path)!r} line {line_no}: a row must be a JSON object")
            names.update(dict.fromkeys(row))
            rows.append(row)
    return list(names), rows


def _as_int(v, where: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{where} = {v!r} is not an integer")
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        s = v.strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
    raise ValueError(f"{where} = {v!r} is not an integer")


def _clean_ints(values: list) -> np.ndarray | None:
    """The column as int64 in one numpy conversion when every value is a plain int or a digit
    string (a 100k-row manifest in milliseconds); None: check row by row (naming the culprit)."""
    kinds = set(map(type, values))
    if kinds <= {int} or (kinds <= {str} and all(v.isascii() and v.isdigit() for v in values)):
        return np.asarray(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
    return None


def read_manifest(path: str | Path) -> Manifest:
    """The manifest in ``path`` (``.csv``, ``.jsonl``/``.ndjson`` or ``.parquet``; module
    docstring for the columns). Errors name the file, row and column."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"manifest {str(path)!r} does not exist")
    fmt = _format(path)
    if fmt == "parquet":
        _, pq = _require_pyarrow()
        table = pq.read_table(path).to_pydict()
        names = list(table)
        n = len(next(iter(table.values()))) if table else 0
        rows = None
    else:
        names, rows = _rows(path, fmt)
        table, n = None, len(rows)
    wanted = ["tokens"] if "tokens" in names else [c for c in COLUMNS if c in names or c not in _DEFAULTS]
    missing = [c for c in wanted if c not in names]
    if missing:
        raise ValueError(
            f"manifest {str(path)!r} lacks column(s) {missing}: give width and height (frames, fps, "
            f"text_tokens optional) or a token count 'tokens'; it has {names}"
        )
    cols = {}
    for c in COLUMNS if "tokens" not in names else ("tokens",):
        if c not in names:
            cols[c] = np.full(n, _DEFAULTS[c], dtype=np.int64)
            continue
        values = table[c] if table is not None else [r.get(c) for r in rows]
        fast = _clean_ints(values)
        if fast is not None:
            cols[c] = fast
            continue
        out = np.empty(n, dtype=np.int64)
        for i, v in enumerate(values):
            if v is None or v == "":
                if c not in _DEFAULTS:
                    raise ValueError(f"manifest {str(path)!r} row {i}: {c} is empty")
                out[i] = _DEFAULTS[c]
            else:
                out[i] = _as_int(v, f"manifest {str(path)!r} row {i}: {c}")
        cols[c] = out
    try:
        return Manifest(**cols)
    except ValueError as exc:
        raise ValueError(f"manifest {str(path)!r}: {exc}") from None


def write_manifest(manifest: Manifest, path: str | Path) -> Path:
    """Write ``manifest`` to ``path`` in the format its suffix names; returns the path."""
    path = Path(path)
    fmt = _format(path)
    cols = manifest.columns()
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        pa, pq = _require_pyarrow()
        pq.write_table(pa.table({k: pa.array(v) for k, v in cols.items()}), path)
    elif fmt == "csv":
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(list(cols))
            w.writerows(zip(*(v.tolist() for v in cols.values())))
    else:
        names = list(cols)
        with path.open("w") as fh:
            for row in zip(*(v.tolist() for v in cols.values())):
                fh.write(json.dumps(dict(zip(names, row))) + "\n")
    return path


def manifest_seq_lens(manifest: Manifest, tok: Tokenizer | None) -> tuple[np.ndarray, np.ndarray]:
    """((n,) sequence lengths, (n,) bucket ids) of a manifest: a pixel manifest through the
    tokenizer (buckets: its latent grid, (frames, rows, columns)); a token-count manifest as
    given (buckets: none, all 0)."""
    if not manifest.has_pixels:
        return manifest.tokens.copy(), np.zeros(len(manifest), dtype=np.int64)
    if tok is None:
        raise ValueError("a manifest of pixels needs a tokenizer preset (--tokenizer) to count its tokens")
    m = manifest
    lens = tok.seq_lens(m.width, m.height, m.frames, m.text_tokens, m.fps)
    t, h, w = tok.latent_grid(m.width, m.height, m.frames, m.fps)
    key = (t * (int(h.max(initial=0)) + 1) + h) * (int(w.max(initial=0)) + 1) + w
    _, buckets = np.unique(key, return_inverse=True)
    return lens, buckets.astype(np.int64)


def dealt_steps(
    lengths: np.ndarray,
    buckets: np.ndarray | None,
    num_ranks: int,
    *,
    max_tokens: int,
    steps: int,
    seed: int = 0,
    max_samples: int | None = None,
) -> list[list[list[int]]]:
    """The first ``steps`` steps of epoch 0 as :class:`~knapformer.data.sampler.TokenBudgetBatchSampler`
    deals them over ``num_ranks`` ranks (its ``max_tokens`` budget, ``buckets``, ``seed``; whole
    steps only, a sample over the budget in a batch of its own): per step, per rank, the
    sequence lengths. Raises when the manifest fills fewer steps."""
    from knapformer.data.sampler import TokenBudgetBatchSampler

    lengths = np.asarray(lengths, dtype=np.int64)
    sampler = TokenBudgetBatchSampler(
        lengths,
        max_tokens,
        buckets=None if buckets is None else np.asarray(buckets).tolist(),
        max_samples=max_samples,
        num_replicas=num_ranks,
        rank=0,
        seed=seed,
        drop_last=True,
        oversize="alone",
    )
    dealt = sampler.steps()
    if len(dealt) < steps:
        raise ValueError(
            f"the manifest's {lengths.size} samples fill {len(dealt)} whole step(s) of {num_ranks} ranks at "
            f"{max_tokens} tokens per rank; {steps} were asked for (a larger manifest, or fewer steps)"
        )
    return [[lengths[batch].tolist() for batch in step] for step in dealt[:steps]]
