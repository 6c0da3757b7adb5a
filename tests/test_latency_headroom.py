"""Under a latency budget the search leaves out children predicted over it:
swap and remat batches whose lower-bound price exceeds what the state has left
(swaps sharing one copy stream), and F-Tree mutations whose latency, linear in
n along the region's line, would end past the budget."""
from types import SimpleNamespace

from magis_nb.search.algorithm import Search
from magis_nb.search.objective import Objective, SearchLog
from magis_nb.search.pricing import Ranked, batch_price
from magis_nb.search.proposals import BATCHES, batch_sizes
from magis_nb.search.space import Remat, Swap


def _swaps(k):
    return [Swap(f"op{i}", 0, frozenset({f"user{i}"})) for i in range(k)]


def _ranked(swaps, exposed, copy, idle, remats=(), remat_price=0.0):
    price = {s: exposed for s in swaps} | {r: remat_price for r in remats}
    return Ranked(list(swaps), list(remats), [], [], price, {s: copy for s in swaps}, idle)


def test_without_a_latency_budget_every_power_of_two_is_proposed():
    sw = _swaps(200)
    r = _ranked(sw, 0.0, 0.05, 5.0)
    assert batch_sizes(sw, r, None) == sorted(BATCHES, reverse=True)


def test_swaps_hidden_one_by_one_still_fill_the_copy_stream():
    # each swap hides alone (exposed 0), but 200 x 0.05 s of copies against 5 s
    # of idle copy stream: at most 101 fit 0.07 s of headroom
    sw = _swaps(200)
    r = _ranked(sw, 0.0, 0.05, 5.0)
    assert batch_price(r, sw[:100]) == 0.0
    assert abs(batch_price(r, sw[:120]) - 1.0) < 1e-9
    assert batch_sizes(sw, r, 0.07) == [101, 64, 32, 16, 8, 4, 2]
    # no room at all: nothing but batches that cost nothing
    assert batch_sizes(sw, r, -0.01) == []


def test_remats_are_priced_by_their_recompute():
    rm = [Remat(f"op{i}", frozenset({f"user{i}"})) for i in range(50)]
    r = _ranked([], 0.0, 0.0, 0.0, rm, 0.01)
    assert batch_sizes(rm, r, 0.205) == [20, 16, 8, 4, 2]
    assert batch_sizes(rm, r, 0.005) == []


def _search(limit, seen):
    log = SearchLog(best=None)
    return SimpleNamespace(objective=Objective("lat", limit), plan_lat=dict(seen), log=log)


def test_a_mutation_is_skipped_when_the_line_predicts_it_over_the_budget():
    # root 4.64 s, split in 2 4.79 s, in 16 5.04 s: 32 extrapolates to 5.32 s
    seen = {(): 4.64, ((7, 2),): 4.79, ((7, 16),): 5.04}
    st = SimpleNamespace(plan=((7, 16),))
    s = _search(5.10, seen)
    assert Search.too_slow(s, st, ((7, 32),))
    assert s.log.over == 1
    # within a looser budget it is built; so is a mutation down, or of another region
    s = _search(5.40, seen)
    assert not Search.too_slow(s, st, ((7, 32),))
    assert not Search.too_slow(_search(5.10, seen), st, ((7, 8),))
    assert not Search.too_slow(_search(5.10, seen), st, ((7, 16), (9, 2)))
    # one point on the line predicts nothing
    assert not Search.too_slow(_search(5.10, {(): 4.64}), SimpleNamespace(plan=((7, 2),)),
                                ((7, 4),))
    # under a memory budget nothing is predicted
    s = _search(5.10, seen)
    s.objective = Objective("mem", 1e9)
    assert not Search.too_slow(s, st, ((7, 32),))
