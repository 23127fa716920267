"""Realistic synthetic manifests for tests and benchmarks (pure numpy, seeded).

Each named mix of :data:`MANIFEST_MIXES` draws per-sample pixels, frames, frame rate and text
length from its own distributions (these are this project's choices, written down here, not
measured from any dataset):

- ``realistic``: 60% images of 256²–1,024² pixels of area (7 sides from 256 to 1,024, uniform)
  at 7 aspect ratios; 30% images of 2,048²; 10% clips of 2–10 s (whole seconds) at 480p or
  720p, 16 fps; 20–300 text tokens (uniform).
- ``longtail``: image sides lognormal around 640 (192–3,072) at the 7 aspect ratios, square
  twice as likely; 6% clips, lognormal around 3 s (1–20 s) at 360p / 480p / 720p / 1080p
  (3:3:3:1), recorded at 24, 25 or 30 fps; text lognormal around 60 tokens (5–512).
- ``video-heavy``: 40% clips of 1–8 s at 480p / 720p, 24 fps; 60% images of 512²–1,024²;
  30–200 text tokens.
- ``hires``: images only, 1,024² / 1,536² / 2,048² / 4,096² (4:2:3:1) at the 7 aspect ratios;
  20–300 text tokens.
- ``lowres-clips``: 70% images of 256²–512²; 30% clips of 1–4 s at 256p / 360p, 8 or 16 fps;
  10–120 text tokens.

Sides are multiples of 16 pixels (what 8× VAEs with 2×2 patches need). Clips are landscape.

    from knapformer.data.synthetic import synthetic_manifest
    m = synthetic_manifest("realistic", 20_000, seed=0)   # a Manifest
"""

from __future__ import annotations

import numpy as np

from knapformer.data.manifest import Manifest

__all__ = ["ASPECTS", "MANIFEST_MIXES", "synthetic_manifest"]

ASPECTS = ((1, 1), (4, 3), (3, 4), (3, 2), (2, 3), (16, 9), (9, 16))
"""Width:height ratios of the images."""
_RES = {256: (448, 256), 360: (640, 360), 480: (848, 480), 720: (1280, 720), 1080: (1920, 1080)}
"""Clip sizes by height (width, height), widths rounded to 16 pixels."""


def _round16(x: np.ndarray) -> np.ndarray:
    return np.maximum(16, (np.rint(np.asarray(x, dtype=np.float64) / 16) * 16).astype(np.int64))


def _images(rng: np.random.Generator, sides: np.ndarray, aspect_p=None) -> tuple[np.ndarray, np.ndarray]:
    """(width, height) of images of ``sides``² pixels of area at random aspect ratios."""
    a = rng.choice(len(ASPECTS), size=sides.size, p=aspect_p)
    r = np.asarray([ASPECTS[i][0] / ASPECTS[i][1] for i in a])
    return _round16(sides * np.sqrt(r)), _round16(sides / np.sqrt(r))


def _clips(rng, n: int, heights, p, seconds: np.ndarray, fps: np.ndarray):
    """(width, height, frames, fps) of n clips: ``seconds`` long at ``fps`` (frames = s·fps + 1)."""
    h = rng.choice(heights, size=n, p=p)
    w = np.asarray([_RES[int(v)][0] for v in h], dtype=np.int64)
    hh = np.asarray([_RES[int(v)][1] for v in h], dtype=np.int64)
    frames = np.rint(seconds * fps).astype(np.int64) + 1
    return w, hh, frames, fps.astype(np.int64)


def _assemble(rng, n: int, parts: list[tuple[float, callable]], text) -> Manifest:
    """Samples drawn from ``parts`` (share, maker(rng, count) -> (w, h, frames, fps)), shuffled."""
    shares = np.asarray([s for s, _ in parts])
    counts = rng.multinomial(n, shares / shares.sum())
    cols = [maker(rng, int(c)) for (_, maker), c in zip(parts, counts)]
    w, h, f, fps = (np.concatenate([c[i] for c in cols]).astype(np.int64) for i in range(4))
    order = rng.permutation(n)
    return Manifest(width=w[order], height=h[order], frames=f[order], fps=fps[order], text_tokens=text(rng, n))


def _still(w, h):
    return w, h, np.ones(w.size, dtype=np.int64), np.zeros(w.size, dtype=np.int64)


def _realistic(rng, n):
    def small(rng, c):
        return _still(*_images(rng, rng.choice(np.arange(256, 1025, 128), size=c)))

    def big(rng, c):
        return _still(np.full(c, 2048), np.full(c, 2048))

    def clips(rng, c):
        return _clips(rng, c, [480, 720], None, rng.integers(2, 11, size=c).astype(float), np.full(c, 16.0))

    return _assemble(rng, n, [(0.6, small), (0.3, big), (0.1, clips)], lambda rng, m: rng.integers(20, 301, size=m))


def _longtail(rng, n):
    def images(rng, c):
        sides = np.clip(np.exp(rng.normal(np.log(640), 0.55, size=c)), 192, 3072)
        p = np.asarray([2, 1, 1, 1, 1, 1, 1], dtype=float)
        return _still(*_images(rng, sides, p / p.sum()))

    def clips(rng, c):
        secs = np.clip(np.exp(rng.normal(np.log(3.0), 0.7, size=c)), 1.0, 20.0)
        fps = rng.choice([24.0, 25.0, 30.0], size=c)
        return _clips(rng, c, [360, 480, 720, 1080], [0.3, 0.3, 0.3, 0.1], secs, fps)

    def text(rng, m):
        return np.clip(np.rint(np.exp(rng.normal(np.log(60), 0.9, size=m))), 5, 512).astype(np.int64)

    return _assemble(rng, n, [(0.94, images), (0.06, clips)], text)


def _video_heavy(rng, n):
    def images(rng, c):
        return _still(*_images(rng, rng.choice(np.arange(512, 1025, 128), size=c)))

    def clips(rng, c):
        return _clips(rng, c, [480, 720], None, rng.uniform(1.0, 8.0, size=c), np.full(c, 24.0))

    return _assemble(rng, n, [(0.6, images), (0.4, clips)], lambda rng, m: rng.integers(30, 201, size=m))


def _hires(rng, n):
    def images(rng, c):
        return _still(*_images(rng, rng.choice([1024, 1536, 2048, 4096], size=c, p=[0.4, 0.2, 0.3, 0.1])))

    return _assemble(rng, n, [(1.0, images)], lambda rng, m: rng.integers(20, 301, size=m))


def _lowres_clips(rng, n):
    def images(rng, c):
        return _still(*_images(rng, rng.choice(np.arange(256, 513, 64), size=c)))

    def clips(rng, c):
        fps = rng.choice([8.0, 16.0], size=c)
        return _clips(rng, c, [256, 360], None, rng.uniform(1.0, 4.0, size=c), fps)

    return _assemble(rng, n, [(0.7, images), (0.3, clips)], lambda rng, m: rng.integers(10, 121, size=m))


MANIFEST_MIXES = {
    "realistic": _realistic,
    "longtail": _longtail,
    "video-heavy": _video_heavy,
    "hires": _hires,
    "lowres-clips": _lowres_clips,
}
"""Named synthetic mixes (module docstring): name -> maker(rng, num_samples)."""


def synthetic_manifest(mix: str, num_samples: int, *, seed: int = 0) -> Manifest:
    """``num_samples`` samples of the named mix, a pure function of ``(mix, num_samples, seed)``."""
    if mix not in MANIFEST_MIXES:
        raise ValueError(f"unknown manifest mix {mix!r}; choose one of {sorted(MANIFEST_MIXES)}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    rng = np.random.default_rng([int(seed), sorted(MANIFEST_MIXES).index(mix)])
    return MANIFEST_MIXES[mix](rng, int(num_samples))
