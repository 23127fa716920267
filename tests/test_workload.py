import numpy as np
import pytest

from knapformer.workload import WorkloadModel, transformer_flops


def test_paper_form():
    m = WorkloadModel(d_model=64, gamma=0.5)
    L = 100
    assert m.cost(L) == pytest.approx(24 * L * 64**2 + 0.5 * 4 * L**2 * 64)
    assert WorkloadModel(d_model=64, causal=True).quad(L) == pytest.approx(0.5 * 4 * L**2 * 64)


def test_chunks_of_a_bag_sum_to_the_sequence():
    m = WorkloadModel(d_model=32, gamma=1.3)
    L, k = 1001, 4
    chunks = [251, 250, 250, 250]
    assert sum(m.chunk_cost(c, L, k) for c in chunks) == pytest.approx(m.cost(L))


def test_flops_multipliers():
    m = WorkloadModel(d_model=16, num_layers=3)
    fwd = transformer_flops(10, 16)
    assert m.flops(10, backward=False) == pytest.approx(3 * fwd)
    assert m.flops(10) == pytest.approx(9 * fwd)
    assert m.flops(10, recompute=True) == pytest.approx(12 * fwd)


def test_vectorised():
    m = WorkloadModel(d_model=8)
    np.testing.assert_allclose(m.cost(np.array([1, 2, 3])), [m.cost(1), m.cost(2), m.cost(3)])


def test_profile_round_trip(tmp_path):
    m = WorkloadModel(
        d_model=128, gamma=0.7, causal=True, num_layers=4, linear=3.0, quadratic=0.01, meta={"device": "cpu"}
    )
    p = tmp_path / "prof.json"
    m.save(p)
    m2 = WorkloadModel.from_profile(p)
    assert m2 == m and m2.meta == {"device": "cpu"}
    assert m2.linear_coef == 3.0 and m2.quad_coef == 0.01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"d_model": 0}, "d_model must be a positive int"),
        ({"d_model": 64, "gamma": -1.0}, "gamma must be a finite number >= 0"),
        ({"d_model": 64, "num_layers": 0}, "num_layers must be a positive int"),
        ({"d_model": 64, "linear": float("nan")}, "linear coefficient must be finite"),
        ({"d_model": 64, "linear": 0.0, "quadratic": 0.0}, "zero cost"),
    ],
)
def test_bad_models(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkloadModel(**kwargs)


def test_bad_profiles(tmp_path):
    with pytest.raises(ValueError, match="cannot read workload profile"):
        WorkloadModel.from_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"d_model": 8, "gama": 1}')
    with pytest.raises(ValueError, match=r"unknown workload profile keys: \['gama'\]"):
        WorkloadModel.from_profile(bad)
    bad.write_text('{"gamma": 1}')
    with pytest.raises(ValueError, match="lacks 'd_model'"):
        WorkloadModel.from_profile(bad)
