"""magis_nb.timing: pairs, warm-ups and the ratio's spread, on a fake clock."""
import pytest

from magis_nb.timing import PairTiming, call_seconds, clear_grads, time_steps


class FakeClock:
    """Each call to a timed function advances the clock by that function's next duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def fn(self, durations, calls):
        it = iter(durations)

        def run():
            calls.append(1)
            self.now += next(it)
        return run


def test_pairs_follow_the_warmups_and_the_ratio_is_the_median_of_pairs():
    clock, calls, ref_calls, cleared = FakeClock(), [], [], []
    step = clock.fn([9.0, 8.0, 2.0, 3.0, 10.0, 2.0, 2.0], calls)   # 2 warm-ups (compile), 5 timed
    ref = clock.fn([7.0, 1.0, 1.0, 5.0, 2.0, 1.0], ref_calls)       # 1 warm-up, 5 timed
    t = time_steps(step, 5, ref=ref, before=lambda: cleared.append("s"),
                   ref_before=lambda: cleared.append("r"), clock=clock)
    assert len(calls) == 7 and len(ref_calls) == 6
    assert cleared.count("s") == 7 and cleared.count("r") == 6
    assert t.first_s == 9.0 and t.step_s == 2.0 and t.ref_s == 1.0
    assert t.ratios == [2.0, 3.0, 2.0, 1.0, 2.0]    # a slow burst (10 s) hits both sides of its pair
    assert t.ratio == 2.0 and t.quartiles == (2.0, 2.0)


def test_quartiles_show_the_spread_and_no_ref_gives_no_ratio():
    t = PairTiming(1.0, 1.0, 1.0, [1.00, 1.04, 1.08, 1.12, 1.20])
    assert t.ratio == 1.08
    assert t.quartiles == pytest.approx((1.04, 1.12))
    clock = FakeClock()
    alone = time_steps(clock.fn([1.0] * 4, []), 2, clock=clock)
    assert alone.ref_s is None and alone.ratios == [] and alone.ratio is None and alone.quartiles is None
    with pytest.raises(ValueError, match="reps"):
        time_steps(lambda: None, 0)


def test_call_seconds_times_one_call_with_its_arguments():
    clock, got = FakeClock(), []

    def op(a, b=0):
        got.append((a, b))
        clock.now += 0.25
    assert call_seconds(op, (1,), {"b": 2}, clock=clock) == 0.25 and got == [(1, 2)]
    assert call_seconds(lambda: op(3), clock=clock) == 0.25 and got[-1] == (3, 0)


def test_clear_grads_drops_every_gradient():
    import torch

    ps = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    for p in ps:
        p.grad = torch.ones(2)
    clear_grads(ps)()
    assert all(p.grad is None for p in ps)


@pytest.mark.slow
def test_bench_optimize_row_reports_the_ratio_with_its_quartiles():
    from magis_nb.bench.optimize import cpu_row

    r = cpu_row("mlp", "lat", 1.10, time_budget=2, reps=5)
    assert r["allclose"] is True and r["measured"] is True
    assert 0 < r["lat_ratio_q1"] <= r["lat_ratio"] <= r["lat_ratio_q3"]
    assert r["eager_s"] > 0 and r["opt_s"] > 0
    # fit_measured timed select()'s pick at least; the copies columns are there
    assert r["tried"] >= 1 and len(r["fits"]) == r["tried"]
    assert min(r["copies_ms"], r["copies_priced_ms"], r["copies_alone_ms"]) >= 0


def test_median_bound_sits_one_binomial_deviation_above_the_median_and_narrows():
    """31 pairs: the 19th ratio of 31 (rank 15.5 + 2.8); 301 pairs of the same
    spread: the 160th of 301, nearer the median than the third quartile."""
    few = PairTiming(1.0, 1.0, 1.0, [1 + i / 100 for i in range(31)])
    assert few.median_bound == pytest.approx(1.18)
    assert few.ratio < few.median_bound < few.quartiles[1]
    many = PairTiming(1.0, 1.0, 1.0, [1 + i * 0.3 / 300 for i in range(301)])
    assert many.median_bound == pytest.approx(1 + 159 * 0.3 / 300)
    assert many.median_bound - many.ratio < few.median_bound - few.ratio
    assert PairTiming(1.0, 1.0, 1.0, [1.05]).median_bound == 1.05
    assert PairTiming(1.0, 1.0, None, []).median_bound is None
