"""Count the places where code would synchronise the host with a GPU, on CPU.

On a GPU, reading a device tensor's values on the host (``tolist``, ``item``, ``cpu``,
``int(t)``, ``bool(t)``), a blocking copy (``.to(device)`` without ``non_blocking=True``) and
creating a tensor on a device from host data (``torch.tensor(..., device=...)``, a pageable
copy) each make the host wait for the device, and so does every operator whose output size
depends on the values (``nonzero``, ``unique``, ``masked_select``, indexing by a boolean mask,
``repeat_interleave`` with tensor repeats and no ``output_size``, one-argument ``where``): the
GPU's queue drains, and the next kernel launch waits for Python. On CPU all of these are free,
so a CPU test cannot feel them — but it can count the calls. :class:`SyncSites` patches those
entry points while it is active and counts every call made from knapformer's own code (callers
outside the package, such as the test's model, are not counted), by phase::

    with SyncSites() as syncs:
        syncs.phase("plan");    bal.plan(lens)
        syncs.phase("layer 1"); ...
    syncs.counts  # {"plan": 0, "layer 1": 2, ...}; syncs.sites: where each was

A budget per phase (``plan`` at most one, layers after the first none) is then a test.
Calls on tensors knapformer deliberately keeps on the host (plan inputs, the gloo twin's
agreement rows) are counted too when made through these methods; the code uses ``numpy()``
for those, which reads host memory and is never a device sync.
"""

from __future__ import annotations

import collections
import sys

import torch

__all__ = ["SyncSites"]

_METHODS = ("tolist", "item", "cpu", "__int__", "__bool__", "__float__", "__index__")


class SyncSites:
    """A context manager counting host-device synchronisation sites by phase (module docstring)."""

    def __init__(self, package: str = "knapformer") -> None:
        self.package = package
        self.current = "start"
        self.counts: collections.Counter = collections.Counter()
        self.sites: dict[str, list[str]] = collections.defaultdict(list)
        self._saved: dict = {}

    def phase(self, name: str) -> None:
        """Count what follows under ``name``."""
        self.current = name

    def _ours(self) -> str | None:
        """The first frame of the calling stack inside the package (None: not called from it)."""
        frame = sys._getframe(2)
        while frame is not None:
            mod = frame.f_globals.get("__name__", "")
            if mod == __name__:
                frame = frame.f_back
                continue
            if mod == self.package or mod.startswith(self.package + "."):
                if mod.startswith(f"{self.package}.testing"):
                    return None  # the test helpers themselves
                return f"{mod}:{frame.f_lineno}"
            return None
        return None

    def _hit(self, what: str) -> None:
        where = self._ours()
        if where is not None:
            self.counts[self.current] += 1
            self.sites[self.current].append(f"{what} at {where}")

    def __enter__(self) -> SyncSites:
        T = torch.Tensor
        for name in _METHODS:
            orig = getattr(T, name)
            self._saved[name] = orig

            def counted(t, *a, _orig=orig, _name=name, **k):
                self._hit(_name)
                return _orig(t, *a, **k)

            setattr(T, name, counted)
        orig_to = T.to
        self._saved["to"] = orig_to

        def to(t, *a, **k):
            device = k.get("device")
            for x in a:
                if isinstance(x, (torch.device, str)) or (isinstance(x, torch.Tensor)):
                    device = x
            if device is not None and not k.get("non_blocking", False):
                self._hit("to(device)")
            return orig_to(t, *a, **k)

        T.to = to
        orig_tensor = torch.tensor
        self._saved["tensor"] = orig_tensor

        def tensor(*a, **k):
            if k.get("device") is not None:
                self._hit("torch.tensor(device=...)")
            return orig_tensor(*a, **k)

        torch.tensor = tensor
        self._patch_sized()
        return self

    def _patch_sized(self) -> None:
        """Operators whose output size the device must compute before the host can go on."""
        T = torch.Tensor

        def counted(owner, name: str, when=lambda *a, **k: True) -> None:
            orig = getattr(owner, name)
            self._saved[(owner, name)] = orig

            def wrapped(*a, _orig=orig, _name=name, **k):
                if when(*a, **k):
                    self._hit(_name)
                return _orig(*a, **k)

            setattr(owner, name, wrapped)

        for name in ("nonzero", "masked_select"):
            counted(torch, name)
            counted(T, name)
        counted(torch, "unique")  # (Tensor.unique calls it)
        counted(torch, "unique_consecutive")
        counted(torch, "where", lambda *a, **k: len(a) + len(k) == 1)

        def tensor_repeats(*a, **k) -> bool:
            repeats = k.get("repeats", a[1] if len(a) > 1 else a[0] if len(a) == 1 else None)
            return isinstance(repeats, torch.Tensor) and k.get("output_size") is None

        counted(torch, "repeat_interleave", tensor_repeats)
        counted(T, "repeat_interleave", tensor_repeats)

        def bool_index(t, index) -> bool:
            parts = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)

        counted(T, "__getitem__", bool_index)

    def __exit__(self, *exc) -> None:
        T = torch.Tensor
        for name in _METHODS:
            setattr(T, name, self._saved[name])
        T.to = self._saved["to"]
        torch.tensor = self._saved["tensor"]
        for key, orig in self._saved.items():
            if isinstance(key, tuple):
                setattr(key[0], key[1], orig)
        self._saved.clear()

    def report(self) -> str:
        """Every counted site, by phase (for assertion messages)."""
        lines = []
        for phase, sites in self.sites.items():
            for site, n in collections.Counter(sites).most_common():
                lines.append(f"{phase}: {site} x{n}")
        return "\n".join(lines) or "none"
