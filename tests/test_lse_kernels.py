"""Which block kernel ring attention runs: the attention backend's preference, each kernel's
conditions (device, dtype, head dims — pure, so CUDA choices are checked on CPU), and a probe
that keeps a kernel giving wrong numbers from being chosen."""

import pytest
import torch

from knapformer.attention import lse as L
from knapformer.attention.registry import get_backend

SDPA = get_backend("sdpa").block_kernels
FLASH = get_backend("flash").block_kernels
bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.fixture
def fresh_probe():
    """Probe verdicts are cached per process: start and leave with none."""
    L._probe.cache_clear()
    yield
    L._probe.cache_clear()


@pytest.mark.parametrize(
    ("prefs", "device", "dtype", "d", "dv", "want"),
    [
        (SDPA, "cuda", bf16, 128, 128, "cuda_flash"),
        (SDPA, "cuda", fp16, 64, 64, "cuda_flash"),
        (SDPA, "cuda", fp32, 128, 128, "cuda_efficient"),  # flash kernels need half types
        (SDPA, "cuda", bf16, 512, 512, "cuda_efficient"),  # flash: D ≤ 256
        (SDPA, "cuda", bf16, 128, 64, "cuda_efficient"),  # flash: D = Dv
        (SDPA, "cuda", bf16, 12, 12, "tiled"),  # neither: D % 8
        (SDPA, "cuda", fp64, 64, 64, "tiled"),
        (SDPA, "cpu", fp32, 64, 64, "cpu_flash"),
        (SDPA, "cpu", bf16, 64, 64, "cpu_flash"),
        (SDPA, "cpu", fp64, 64, 48, "tiled"),  # the fused CPU kernel: D = Dv
        (FLASH, "cpu", fp32, 64, 64, "tiled"),  # flash's list has no CPU kernel
        (("tiled",), "cuda", bf16, 128, 128, "tiled"),
    ],
)
def test_kernel_choice_by_device_dtype_and_head_dims(prefs, device, dtype, d, dv, want):
    assert L.choose_kernel(prefs, device, dtype, d, dv, probe=False) == want


def test_flash_attn_is_first_for_the_flash_backend_when_it_can_run(monkeypatch):
    """On CUDA half types flash-attn's kernel leads the flash backend's list; without the
    package it says so and the next kernel runs."""
    why = L.kernel_conditions("flash_attn", "cuda", bf16, 128, 128)
    try:
        import flash_attn  # noqa: F401

        assert why is None
    except ImportError:
        assert why == "flash-attn is not importable"
        assert L.choose_kernel(FLASH, "cuda", bf16, 128, 128, probe=False) == "cuda_flash"
    monkeypatch.setitem(L.KERNELS, "flash_attn", L.KERNELS["flash_attn"].__class__("flash_attn", None, None, L._any))
    assert L.choose_kernel(FLASH, "cuda", bf16, 128, 128, probe=False) == "flash_attn"


@pytest.mark.parametrize("dtype", [fp64, fp32, bf16])
def test_on_cpu_the_fused_kernel_passes_its_probe_and_is_chosen(dtype):
    assert L.kernel_report(SDPA, "cpu", dtype, 16, 16)["cpu_flash"] is None
    assert L.choose_kernel(SDPA, "cpu", dtype, 16, 16) == "cpu_flash"


def test_a_kernel_that_gets_the_lse_wrong_fails_its_probe_and_is_skipped(monkeypatch, fresh_probe):
    cpu = L.KERNELS["cpu_flash"]

    def off_by_one(q, k, v, causal):
        o, lse = cpu.forward(q, k, v, causal)
        return o, lse + 1.0

    monkeypatch.setitem(L.KERNELS, "cpu_flash", L.LseKernel("cpu_flash", off_by_one, cpu.backward, cpu.conditions))
    assert L.choose_kernel(SDPA, "cpu", fp64, 24, 24) == "tiled"
    assert "lse differs from the tiled math" in L.kernel_report(SDPA, "cpu", fp64, 24, 24)["cpu_flash"]


def test_a_kernel_that_raises_fails_its_probe_with_the_reason(monkeypatch, fresh_probe):
    def broken(*args):
        raise TypeError("unexpected keyword argument 'window_size'")

    monkeypatch.setitem(L.KERNELS, "cpu_flash", L.LseKernel("cpu_flash", broken, broken, L._cpu_conditions))
    assert L.choose_kernel(SDPA, "cpu", fp64, 32, 32) == "tiled"
    assert "TypeError: unexpected keyword argument" in L.kernel_report(SDPA, "cpu", fp64, 32, 32)["cpu_flash"]


def test_unknown_kernel_names_are_refused():
    with pytest.raises(ValueError, match="unknown block kernel 'triton'"):
        L.choose_kernel(("triton",), "cpu", fp32, 8, 8)


def test_the_backend_registry_picks_the_block_kernel_for_real_tensors():
    q = torch.zeros(4, 2, 8, dtype=fp64)
    assert L.block_kernel("auto", q, q, q).name == "cpu_flash"
    assert L.block_kernel("sdpa", q, q[:, :1], q[:, :1]).name == "cpu_flash"  # GQA probe too
    assert L.block_kernel("sdpa", q, q, torch.zeros(4, 2, 6, dtype=fp64)).name == "tiled"


def test_the_probe_is_not_fooled_by_the_autocast_region_it_first_runs_in(fresh_probe):
    """The verdict is cached per process: a first call inside a CPU bf16 autocast region (a
    training step) must still find the fused kernel sound."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert L.choose_kernel(SDPA, "cpu", fp32, 40, 40) == "cpu_flash"
