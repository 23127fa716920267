"""Failure behaviour: bad input on one rank of a running job raises the same clear error on
every rank (2 and 4 gloo ranks, with a timeout) — never a hang, never an abort — and the
balancer keeps working afterwards."""

import pytest

from knapformer.testing import run_distributed
from tests import failure_workers as W


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_on_one_rank_raises_everywhere(world):
    results = run_distributed(W.run_cases, world, timeout=240)
    for case, (exc_type, text) in W.EXPECTED.items():
        seen = [r[case] for r in results]
        names = {name for name, _ in seen}
        assert names == {exc_type.__name__}, f"{case}: ranks raised {[n for n, _ in seen]}"
        for rank, (_, msg) in enumerate(seen):
            assert text in msg, f"{case} rank {rank}: {msg!r} lacks {text!r}"
