import pytest

from knapformer.data import MIXES, parse_codes, sample_batches, sample_seq_lens


def test_paper_mixes_have_32_ranks_and_expected_lengths():
    for name in MIXES:
        assert len(sample_seq_lens(name)) == 32
    lens = sample_seq_lens("paper-lowres")
    assert all(len(r) == 32 for r in lens)
    # 256px -> 16x16 = 256 visual tokens (jittered by 4%) + up to 392 text tokens
    assert all(245 <= v <= 266 + 392 for r in lens for v in r)


def test_video_frames_are_compressed():
    code = parse_codes("g1b1i512f85s1")[0]
    assert code.visual_tokens() == (512 // 16) ** 2 * int(85 / 3.4)
    assert parse_codes("g1b1i256f4s0")[0].visual_tokens() == 256 * 4


def test_deterministic_per_seed_rank_step():
    a = sample_batches(parse_codes(MIXES["paper-joint"]), seed=1, step=2)
    assert a == sample_batches(parse_codes(MIXES["paper-joint"]), seed=1, step=2)
    assert a != sample_batches(parse_codes(MIXES["paper-joint"]), seed=1, step=3)


def test_scale_keeps_shape():
    big = sample_seq_lens("paper-mixres", scale=1)
    small = sample_seq_lens("paper-mixres", scale=4)
    assert max(map(max, small)) < max(map(max, big)) / 8


def test_tiling_to_more_ranks():
    assert len(sample_seq_lens("paper-lowres", num_ranks=64)) == 64


@pytest.mark.parametrize(
    "codes, message",
    [
        ("g1b1i256f1", "malformed data code 'g1b1i256f1'"),
        ("g1b0i256f1s0", "must be >= 1"),
        ("", "data code is empty"),
        ("g1b1i256f1s2", "malformed data code"),
    ],
)
def test_bad_codes(codes, message):
    with pytest.raises(ValueError, match=message):
        parse_codes(codes)


def test_world_size_must_fit_the_mix():
    with pytest.raises(ValueError, match="the mix describes 32 ranks; 48 ranks is not a multiple"):
        sample_seq_lens("paper-lowres", num_ranks=48)
