import pytest

from knapformer.layout import BagLayout, parse_layout


def test_bags_are_contiguous_smaller_first():
    lay = parse_layout("g2n1 + g1n2")
    assert lay.bags == ((0,), (1,), (2, 3))
    assert lay.group_size == 4 and lay.num_bags == 3 and lay.spec() == "g1n2+g2n1"


def test_spec_round_trips():
    lay = parse_layout("g1n16+g2n8+g4n4+g8n2")
    assert parse_layout(lay.spec()) == lay
    assert lay.group_size == 64


def test_replicas_tile_the_world():
    lay = parse_layout("g1n2+g2n1")
    assert lay.num_replicas(8) == 2
    assert lay.replica_ranks(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("g1n4+x", "malformed bag term 'x'"),
        ("g2", "malformed bag term 'g2'"),
        ("g0n4", "size G and count N must be >= 1"),
        ("g2n0", "size G and count N must be >= 1"),
        ("g1n2+g1n3", "bag size 1 appears twice"),
        ("", "bag spec is empty"),
        ("g1n2++g2n1", "malformed bag term ''"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_layout(spec)


def test_world_not_divisible_by_group():
    with pytest.raises(ValueError, match="world size 6 is not divisible by the group size 4"):
        parse_layout("g2n2").num_replicas(6)


def test_non_string_spec():
    with pytest.raises(TypeError, match="bag spec must be a string"):
        parse_layout(42)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="appears twice"):
        BagLayout(((2, 1), (2, 3)))
