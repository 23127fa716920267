"""TokenBudgetBatchSampler and PackedCollate: each sample once per epoch, budgets kept, equal
steps per rank, the same batches in every process, exact resume; packing round trips."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from knapformer.data import PackedCollate, TokenBudgetBatchSampler, pack_batches

lengths_st = st.lists(st.integers(1, 300), min_size=0, max_size=120)
WINDOWED = {"window": 16, "block": 4}
"""Small windows and blocks: the epoch dealt window by window, as for a dataset of millions."""


def _all_ranks(lengths, world, **kw):
    samplers = [TokenBudgetBatchSampler(lengths, num_replicas=world, rank=r, **kw) for r in range(world)]
    return samplers, [list(s) for s in samplers]


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_st,
    world=st.integers(1, 6),
    budget=st.integers(300, 1200),
    max_samples=st.none() | st.integers(1, 5),
    nbuckets=st.integers(0, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 3),
    windowed=st.booleans(),
)
def test_every_sample_once_budgets_kept_and_equal_steps(
    lengths, world, budget, max_samples, nbuckets, shuffle, drop_last, seed, epoch, windowed
):
    buckets = None if nbuckets == 0 else [n % nbuckets for n in lengths]
    if windowed and buckets is not None:
        buckets = np.asarray(buckets, dtype=np.int64)  # a large dataset's buckets: an integer array
    kw = dict(max_tokens=budget, max_samples=max_samples, buckets=buckets, shuffle=shuffle, drop_last=drop_last)
    kw.update(WINDOWED if windowed else {})
    samplers, _ = _all_ranks(lengths, world, seed=seed, **kw)
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    steps = {len(b) for b in per_rank} | {len(s) for s in samplers}
    assert len(steps) == 1, "every rank runs the same number of steps"
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)), "no sample twice in an epoch"
    if not drop_last:
        assert sorted(seen) == list(range(len(lengths))), "every sample once"
    else:  # only the trailing batches that do not fill a step are dropped: < world batches
        dropped = set(range(len(lengths))) - set(seen)
        assert sum(lengths[i] for i in dropped) <= (world - 1) * budget
    for batches in per_rank:
        for b in batches:
            assert sum(lengths[i] for i in b) <= budget
            if max_samples is not None:
                assert len(b) <= max_samples
            if buckets is not None:
                assert len({buckets[i] for i in b}) <= 1, "one bucket per batch"


def test_empty_batches_only_when_nothing_can_split():
    # 5 one-sample-fitting samples, 4 ranks: 2 batches of 2+3 samples get split to fill the step
    s = TokenBudgetBatchSampler([10] * 5, 1000, num_replicas=4, rank=0, shuffle=False)
    step = s.steps()[0]
    assert sorted(len(b) for b in step) == [1, 1, 1, 2] and sorted(i for b in step for i in b) == list(range(5))
    # 2 samples on 3 ranks: one rank gets an empty batch
    s = TokenBudgetBatchSampler([10, 10], 1000, num_replicas=3, rank=2, shuffle=False)
    assert sorted(len(b) for b in s.steps()[0]) == [0, 1, 1]


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    world=st.integers(1, 4),
    cut=st.integers(0, 50),
    seed=st.integers(0, 5),
    windowed=st.booleans(),
)
def test_resume_mid_epoch_yields_the_remaining_batches_exactly(lengths, world, cut, seed, windowed):
    kw = WINDOWED if windowed else {}
    for rank in range(world):
        a = TokenBudgetBatchSampler(lengths, 500, num_replicas=world, rank=rank, seed=seed, **kw)
        a.set_epoch(2)
        full = list(a)
        done = min(cut, len(full))
        state = json.loads(json.dumps(a.state_dict(steps_done=done)))  # survives a checkpoint file
        b = TokenBudgetBatchSampler(lengths, 500, num_replicas=world, rank=rank, seed=seed, **kw)
        b.load_state_dict(state)
        assert len(b) == len(full) - done
        assert list(b) == full[done:]
        assert list(b) == full, "the next pass is a whole epoch again"


@settings(max_examples=120, deadline=None)
@given(
    lengths=lengths_st,
    worlds=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    cuts=st.lists(st.integers(0, 40), min_size=3, max_size=3),
    budget=st.integers(300, 900),
    nbuckets=st.integers(0, 3),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
    windowed=st.booleans(),
)
def test_resume_on_other_numbers_of_ranks_sees_every_sample_exactly_once(
    lengths, worlds, cuts, budget, nbuckets, drop_last, shuffle, seed, windowed
):
    """An epoch interrupted after some steps and resumed on another number of ranks (several
    times: W0 -> W1 -> W2 ...): over the epoch every sample is seen exactly once (at most once
    with drop_last), every resumed pass gives every rank the same number of steps, every batch
    keeps the budget and one bucket, the state is a few numbers (JSON), and the next epoch is
    whole on the new ranks."""
    buckets = None if nbuckets == 0 else [n % nbuckets for n in lengths]
    kw = dict(max_tokens=budget, buckets=buckets, drop_last=drop_last, shuffle=shuffle, seed=seed)
    kw.update(WINDOWED if windowed else {})
    seen, state = [], None
    for w, world in enumerate(worlds):
        samplers = [TokenBudgetBatchSampler(lengths, num_replicas=world, rank=r, **kw) for r in range(world)]
        for smp in samplers:
            if state is None:
                smp.set_epoch(1)
            else:
                smp.load_state_dict(state)
        start = samplers[0].pass_start
        assert len(samplers[0]) == len(samplers[0].steps()) - start
        passes = [list(smp) for smp in samplers]
        assert len({len(p) for p in passes}) == 1, "equal steps on every rank"
        done = len(passes[0]) if w == len(worlds) - 1 else min(cuts[w % 3], len(passes[0]))
        for p in passes:
            for b in p[:done]:
                seen += b
                assert sum(lengths[i] for i in b) <= budget
                assert buckets is None or len({buckets[i] for i in b}) <= 1
        state = json.loads(json.dumps(samplers[0].state_dict(steps_done=start + done)))
        assert all(smp.state_dict(steps_done=start + done) == state for smp in samplers), "the same state everywhere"
        # a few numbers, not the indices (windowed: and fewer batches than ranks of each pass)
        assert len(json.dumps(state)) < (400 if not windowed else 400 + 60 * sum(worlds) * 8)
    assert len(seen) == len(set(seen)), "no sample twice in the interrupted epoch"
    if not drop_last:
        assert sorted(seen) == list(range(len(lengths))), "every sample once"
    last = TokenBudgetBatchSampler(lengths, num_replicas=worlds[-1], rank=0, **kw)
    last.load_state_dict(state)
    list(last)
    last.set_epoch(2)
    fresh = TokenBudgetBatchSampler(lengths, num_replicas=worlds[-1], rank=0, **kw)
    fresh.set_epoch(2)
    assert list(last) == list(fresh), "the next epoch is whole"


@pytest.mark.parametrize("window", ["", ", window=40, block=8"])
def test_a_resized_resume_is_the_same_in_another_process(window):
    """What a resumed sampler deals is a pure function of its state (another interpreter, other
    hash seed, gives the same batches), whole-epoch or windowed."""
    code = (
        "import json, sys; from knapformer.data import TokenBudgetBatchSampler as T\n"
        "lens = [(i * 37) % 250 + 1 for i in range(300)]\n"
        f"a = T(lens, 700, num_replicas=4, rank=0, seed=3, buckets=[n % 3 for n in lens]{window}); a.set_epoch(5)\n"
        "st = a.state_dict(steps_done=7)\n"
        f"b = T(lens, 700, num_replicas=3, rank=2, seed=3, buckets=[n % 3 for n in lens]{window})\n"
        "b.load_state_dict(json.loads(json.dumps(st)))\n"
        "print(json.dumps(list(b)))\n"
    )
    outs = set()
    for hashseed in ("0", "1"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        outs.add(proc.stdout)
    assert len(outs) == 1 and json.loads(outs.pop())


def test_resume_refuses_a_different_sampler():
    a = TokenBudgetBatchSampler([5, 6, 7], 10, num_replicas=2, rank=0)
    state = a.state_dict(steps_done=1)
    for other in (
        TokenBudgetBatchSampler([5, 6, 8], 10, num_replicas=2, rank=0),
        TokenBudgetBatchSampler([5, 6, 7], 11, num_replicas=2, rank=0),
        TokenBudgetBatchSampler([5, 6, 7], 10, num_replicas=2, rank=0, seed=1),
        TokenBudgetBatchSampler([5, 6, 7], 10, num_replicas=2, rank=0, drop_last=True),
    ):
        with pytest.raises(ValueError, match="other lengths"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="steps_done"):
        a.state_dict(steps_done=99)


def test_epochs_differ_and_seeds_repeat():
    lens = list(np.random.default_rng(0).integers(1, 200, 400))
    s = TokenBudgetBatchSampler(lens, 600, num_replicas=2, rank=1, seed=7)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
    s.set_epoch(0)
    assert list(s) == e0
    assert list(TokenBudgetBatchSampler(lens, 600, num_replicas=2, rank=1, seed=8)) != e0


def test_identical_batches_in_another_process():
    lens = [int(x) for x in np.random.default_rng(1).integers(1, 900, 300)]
    keys = [f"{n % 3}x{n % 5}" for n in lens]  # string keys: hash randomisation must not matter
    code = (
        "import json,sys; from knapformer.data import TokenBudgetBatchSampler as T; a=json.loads(sys.argv[1]);"
        "s=T(a['l'],1000,buckets=a['k'],num_replicas=3,rank=2,seed=4); s.set_epoch(5); print(json.dumps(list(s)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps({"l": lens, "k": keys})],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout
    here = TokenBudgetBatchSampler(lens, 1000, buckets=keys, num_replicas=3, rank=2, seed=4)
    here.set_epoch(5)
    assert json.loads(out) == list(here)


def test_oversize_samples():
    with pytest.raises(ValueError, match="sample 2 has 50 tokens, more than max_tokens=40"):
        TokenBudgetBatchSampler([10, 20, 50, 5], 40, num_replicas=1, rank=0)
    s = TokenBudgetBatchSampler([10, 20, 50, 5], 40, num_replicas=1, rank=0, oversize="alone", shuffle=False)
    assert list(s) == [[2], [0, 1, 3]]  # the long one alone; the rest packs around it


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[1, 0, 2], max_tokens=5), "sample 1 has 0 tokens"),
        (dict(lengths=[1, 2], max_tokens=0), "max_tokens must be a positive int"),
        (dict(lengths=[1, 2], max_tokens=5, max_samples=0), "max_samples"),
        (dict(lengths=[1.5, 2], max_tokens=5), "whole token counts"),
        (dict(lengths=[[1, 2]], max_tokens=5), "one token count per sample"),
        (dict(lengths=lambda i: 3, max_tokens=5), "num_samples"),
        (dict(lengths=[1, 2], max_tokens=5, buckets=[0]), "buckets has 1 keys for 2 samples"),
        (dict(lengths=[1, 2], max_tokens=5, oversize="drop"), "oversize"),
        (dict(lengths=[1, 2], max_tokens=5, num_replicas=2, rank=2), "rank must be in"),
    ],
)
def test_bad_arguments_raise_clearly(kwargs, match):
    kwargs.setdefault("num_replicas", 1)
    kwargs.setdefault("rank", 0)
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatchSampler(**kwargs)


def test_callable_lengths_and_pack_batches():
    s = TokenBudgetBatchSampler(lambda i: i + 1, 6, num_samples=5, num_replicas=1, rank=0, shuffle=False)
    assert list(s) == [[0, 1, 2], [3], [4]]
    assert pack_batches([0, 1, 2, 3], np.array([3, 3, 3, 3]), 6, max_samples=1) == [[0], [1], [2], [3]]


# -- collate ---------------------------------------------------------------------------------------------
class _Toy(Dataset):
    def __init__(self, lens):
        self.lens = lens

    def __len__(self):
        return len(self.lens)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = self.lens[i]
        return {
            "tokens": torch.randn(n, 4, generator=g),
            "text": torch.randint(0, 9, (i % 3 + 1,), generator=g),
            "t": torch.tensor(i / 10),
            "vec": torch.full((2,), float(i)),
            "name": f"s{i}",
        }


def test_collate_packs_and_round_trips():
    ds = _Toy([3, 1, 5])
    batch = PackedCollate(("tokens", "text"))([ds[0], ds[1], ds[2]])
    assert batch["seq_lens"] == [3, 1, 5] and batch["text_lens"] == [1, 2, 3]
    assert batch["tokens"].shape == (9, 4) and batch["vec"].shape == (3, 2) and batch["t"].shape == (3,)
    assert batch["name"] == ["s0", "s1", "s2"]
    for i, part in enumerate(batch["tokens"].split(batch["seq_lens"])):
        assert torch.equal(part, ds[i]["tokens"])
    for i, part in enumerate(batch["text"].split(batch["text_lens"])):
        assert torch.equal(part, ds[i]["text"])


def test_collate_errors_and_empty_batches():
    ds = _Toy([3, 1])
    with pytest.raises(ValueError, match="example="):
        PackedCollate(("tokens", "text"))([])
    empty = PackedCollate(("tokens", "text"), example=ds[0])([])
    assert empty["tokens"].shape == (0, 4) and empty["seq_lens"] == [] and empty["vec"].shape == (0, 2)
    with pytest.raises(ValueError, match="cannot be stacked"):
        PackedCollate(("tokens",))([ds[0], ds[1]])  # "text" varies in length but is not packed
    with pytest.raises(KeyError, match="latents"):
        PackedCollate(("latents",))([ds[0]])
    bad = dict(ds[1], tokens=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="only the first"):
        PackedCollate(("tokens", "text"))([ds[0], bad])


def test_dataloader_with_workers_gives_the_same_batches():
    lens = [int(x) for x in np.random.default_rng(2).integers(1, 40, 60)]
    ds = _Toy(lens)
    sampler = TokenBudgetBatchSampler(lens, 100, num_replicas=2, rank=1, seed=3)
    collate = PackedCollate(("tokens", "text"), example=ds[0])
    plain = list(DataLoader(ds, batch_sampler=sampler, collate_fn=collate))
    workers = list(DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=2))
    assert len(plain) == len(workers) == len(sampler)
    for a, b in zip(plain, workers):
        assert a["seq_lens"] == b["seq_lens"] and torch.equal(a["tokens"], b["tokens"])
        assert sum(a["seq_lens"]) <= 100


def test_state_dict_defaults_to_the_batches_handed_out_and_resume_is_per_epoch():
    lens = list(range(1, 60))
    a = TokenBudgetBatchSampler(lens, 120, num_replicas=2, rank=0, seed=1)
    it = iter(a)
    first = [next(it), next(it)]
    state = a.state_dict()  # no workers: the two batches handed out
    assert state["steps_done"] == 2
    b = TokenBudgetBatchSampler(lens, 120, num_replicas=2, rank=0, seed=1)
    b.load_state_dict(state)
    rest = list(b)
    assert first + rest == list(a)
    b.load_state_dict(state)
    b.set_epoch(1)  # moving to another epoch drops the resumed position
    assert len(b) == len(list(b)) and list(b) == [s[0] for s in b.steps(1)]
    with pytest.raises(ValueError, match="steps_done must be an int"):
        a.state_dict(steps_done=1.5)


def test_degenerate_datasets():
    assert list(TokenBudgetBatchSampler([], 10, num_replicas=3, rank=1)) == []
    s = [TokenBudgetBatchSampler([4], 10, num_replicas=3, rank=r) for r in range(3)]
    got = [list(x) for x in s]
    assert all(len(x) == 1 for x in s) and sorted(g[0] for g in got) == [[], [], [0]]  # one step each
    assert list(TokenBudgetBatchSampler([4], 10, num_replicas=3, rank=0, drop_last=True)) == []


def test_collate_takes_bare_tensors():
    parts = [torch.randn(3, 2), torch.randn(5, 2)]
    batch = PackedCollate(("latents",))(parts)
    assert batch["seq_lens"] == [3, 5] and torch.equal(batch["latents"], torch.cat(parts))
    empty = PackedCollate(("latents",), example=parts[0])([])
    assert empty["latents"].shape == (0, 2) and empty["seq_lens"] == []


def test_resume_bookkeeping_corner_cases():
    lens = list(range(1, 80))
    a = TokenBudgetBatchSampler(lens, 150, num_replicas=2, rank=1, seed=2)
    full = list(a)
    b = TokenBudgetBatchSampler(lens, 150, num_replicas=2, rank=1, seed=2)
    b.load_state_dict(a.state_dict(steps_done=4))
    assert b.state_dict()["steps_done"] == 4, "a checkpoint right after resuming keeps the position"
    it = iter(b)
    next(it)
    assert len(b) == len(full) - 4, "len during the resumed pass"
    assert [*([full[4]]), *it] == full[4:]
    with pytest.raises(ValueError, match="seed"):
        TokenBudgetBatchSampler(lens, 150, num_replicas=1, rank=0, seed=-1)
    with pytest.raises(ValueError, match="oversize"):
        pack_batches([0], np.array([5]), 4, oversize="drop")


def test_collate_accepts_keys_in_any_order():
    a = {"tokens": torch.zeros(2, 3), "t": torch.tensor(0.5)}
    b = {"t": torch.tensor(0.1), "tokens": torch.ones(1, 3)}
    batch = PackedCollate(("tokens",))([a, b])
    assert batch["seq_lens"] == [2, 1] and batch["t"].tolist() == pytest.approx([0.5, 0.1])


def test_collate_stacks_python_numbers_into_tensors():
    """An int, float or bool field (a frame count, a text length, a flag) becomes an (S,) tensor
    of int64, the default float dtype or bool, as a tensor field does; an empty batch gets the
    same dtype with no rows; strings stay lists."""
    a = {"tokens": torch.zeros(2, 3), "frames": 5, "scale": 0.5, "flip": True, "name": "a"}
    b = {"tokens": torch.ones(1, 3), "frames": 1, "scale": 2.0, "flip": False, "name": "b"}
    collate = PackedCollate(("tokens",), example=a)
    batch = collate([a, b])
    assert torch.equal(batch["frames"], torch.tensor([5, 1])) and batch["frames"].dtype == torch.int64
    assert batch["scale"].dtype == torch.get_default_dtype() and batch["scale"].tolist() == [0.5, 2.0]
    assert batch["flip"].dtype == torch.bool and batch["flip"].tolist() == [True, False]
    assert batch["name"] == ["a", "b"]
    empty = collate([])
    assert [(empty[k].shape, empty[k].dtype) for k in ("frames", "scale", "flip")] == [
        ((0,), torch.int64),
        ((0,), torch.get_default_dtype()),
        ((0,), torch.bool),
    ]
    assert empty["name"] == []


def test_millions_of_samples_windowed_exactly_once_and_resized_mid_epoch():
    """At 2.2M samples (three windows of the default size): every sample exactly once, equal
    steps, budgets and one bucket per batch, the first batch from one window only; a state
    saved mid-epoch on 64 ranks resumes on 48 with no sample lost or repeated."""
    n = 2_200_000
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.0, 1.2, n), 16, 65_536).astype(np.int32)
    buckets = np.floor(np.log2(lengths)).astype(np.int8)
    kw = dict(buckets=buckets, seed=1)
    a = TokenBudgetBatchSampler(lengths, 65_536, num_replicas=64, rank=5, **kw)
    assert a.windowed and len(a._window_blocks(0)) == 3
    steps = a.steps()
    flat = np.asarray([i for step in steps for b in step for i in b], dtype=np.int64)
    assert flat.size == n and np.bincount(flat, minlength=n).max() == 1, "every sample exactly once"
    assert all(len(step) == 64 for step in steps)
    for step in steps[:: max(1, len(steps) // 50)]:
        for b in step:
            assert int(lengths[b].sum()) <= 65_536 and len(set(buckets[b].tolist())) <= 1
    it = iter(a)
    assert next(it) == steps[0][5]
    cut = len(steps) // 2
    state = json.loads(json.dumps(a.state_dict(steps_done=cut)))
    b = TokenBudgetBatchSampler(lengths, 65_536, num_replicas=48, rank=0, **kw)
    b.load_state_dict(state)
    rest = b.steps()
    assert all(len(step) == 48 for step in rest)
    seen = np.concatenate(
        [np.asarray([i for step in steps[:cut] for bb in step for i in bb], dtype=np.int64)]
        + [np.asarray([i for step in rest for bb in step for i in bb], dtype=np.int64)]
    )
    assert seen.size == n and np.bincount(seen, minlength=n).max() == 1, "none lost, none repeated"


def test_a_dataset_of_one_window_is_dealt_as_before_windows_existed():
    """Batches and state fingerprint of 0.2.0's sampler (values it produced): checkpoints saved
    before the windowed deal resume unchanged."""
    lens = [(i * 37) % 250 + 1 for i in range(300)]
    a = TokenBudgetBatchSampler(lens, 700, num_replicas=4, rank=0, seed=3, buckets=[n % 3 for n in lens])
    a.set_epoch(5)
    assert not a.windowed
    assert a._fingerprint() == "630a513baeb6b8e4"
    assert list(a)[:2] == [[147, 285, 271, 112, 63, 204, 288], [19, 97, 157, 90, 93]]
