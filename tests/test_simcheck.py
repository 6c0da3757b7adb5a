"""Every tiny zoo model: simulated peak within 3% of measured, allclose to eager."""
import pytest

from magis_nb import zoo
from magis_nb.bench.simcheck import check_model


@pytest.mark.parametrize("name", zoo.names("tiny"))
def test_simulated_matches_measured_and_eager(name):
    r = check_model(name)
    assert r["allclose"], r["mismatches"]
    assert r["rel_error"] <= 0.03, r
