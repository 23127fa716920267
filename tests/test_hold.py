"""A rank never waits for a rank it moves no data with, and each exchange involves only the
peers the plan gives a rank (5 gloo ranks, steady state, both attention paths).

No clock is read: rank 0 is held inside its attention until rank 2 (in another synchronised
set) announces that it finished forward and backward; any coupling deadlocks that step, and
rank 0's wait then fails (``hold_workers.WAIT_S``), failing the spawn."""

from knapformer.testing import run_distributed
from tests import hold_workers as W


def test_a_held_rank_holds_up_only_the_ranks_it_moves_data_with():
    res = run_distributed(W.run, W.WORLD, timeout=120)
    for rank, by_path in enumerate(res):
        for path, r in by_path.items():
            assert r["same"], (rank, path)  # the held step computed what an unheld one does
            route, layer = r["expected"]["route"], r["expected"]["layer"]
            for phase, peer in r["ops"]:
                allowed = {"route": route, "layer": layer, "backward": route | layer}[phase]
                assert peer in allowed, (rank, path, phase, peer, route, layer)
            peers = {p for _, p in r["ops"]}
            other_set = {0: {2, 3, 4}, 1: {2, 3, 4}, 2: {0, 1, 4}, 3: {0, 1, 4}, 4: {0, 1, 2, 3}}[rank]
            assert not peers & other_set, (rank, path, peers)
            if rank == 4:  # alone, tokens home: no communication at all in its step
                assert r["ops"] == [], (path, r["ops"])
            else:  # the others do exchange with their group
                assert layer and any(phase == "layer" for phase, _ in r["ops"]), (rank, path, r["ops"])
