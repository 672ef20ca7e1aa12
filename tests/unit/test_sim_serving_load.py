"""The diurnal LLM-serving load model (phalanx/sim/serving_load.py): its day has the peak-to-trough ratio it is given,
its arrivals the burstiness it is given, and a seed fixes it."""

from __future__ import annotations

import numpy as np
import pytest

from phalanx.sim.serving_load import DiurnalLoad, arrival_times, load_series, replicas_for


def hourly(counts: np.ndarray, bin_s: float = 60.0) -> np.ndarray:
    per_hour = int(3600 / bin_s)
    return counts[: len(counts) // per_hour * per_hour].reshape(-1, per_hour).mean(axis=1)


@pytest.mark.parametrize("ratio", [2.0, 10.0])
def test_the_day_peaks_and_dips_by_the_ratio_given(ratio):
    # Peak and trough in the middle of an hour, so that hour averages flatten them by little (1.3% at most).
    model = DiurnalLoad(mean_rps=50.0, peak_to_trough=ratio, arrival_cv=2.0, peak_hour=14.5)
    # The envelope: exactly the ratio, the mean as given, the peak at its hour.
    t = np.arange(0, 86400, 60.0)
    rate = model.rate(t)
    assert rate.max() / rate.min() == pytest.approx(ratio)
    assert rate.mean() == pytest.approx(50.0)
    assert t[rate.argmax()] == pytest.approx(14.5 * 3600)
    assert model.peak_rps / model.trough_rps == pytest.approx(ratio)
    # The drawn load: each day's busiest hour over its quietest is the ratio (the noise of an hour at the trough
    # is about 1%).
    series = load_series(model, 48, seed=3)
    for day in hourly(series.counts).reshape(2, 24):
        assert day.max() / day.min() == pytest.approx(ratio, rel=0.05)
    assert series.rates.mean() == pytest.approx(50.0, rel=0.01)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 3.0])
def test_the_arrivals_are_as_bursty_as_the_gamma_gaps_given(cv):
    # A flat day: the counts per 60 s bin have an index of dispersion (variance / mean) of CV^2, the gaps a
    # coefficient of variation of CV.
    flat = DiurnalLoad(mean_rps=50.0, peak_to_trough=1.0, arrival_cv=cv)
    counts = load_series(flat, 24, seed=1).counts
    assert counts.var() / counts.mean() == pytest.approx(cv**2, rel=0.12)
    gaps = np.diff(arrival_times(DiurnalLoad(mean_rps=1.0, peak_to_trough=1.0, arrival_cv=cv), 24, seed=2))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_the_arrivals_follow_the_envelope_and_agree_with_the_binned_counts():
    model = DiurnalLoad(mean_rps=5.0, peak_to_trough=4.0, arrival_cv=1.5)
    times = arrival_times(model, 24, seed=7)
    assert np.all(np.diff(times) >= 0) and 0 <= times[0] and times[-1] < 86400
    per_hour = np.histogram(times, bins=24, range=(0, 86400))[0]
    expected = np.diff(model.cumulative(np.arange(25) * 3600.0))
    assert per_hour.sum() == pytest.approx(expected.sum(), rel=0.03)
    assert np.argmax(per_hour) in (13, 14) and np.argmin(per_hour) in (1, 2)


def test_a_seed_fixes_the_load_and_another_changes_it():
    model = DiurnalLoad(mean_rps=30.0)
    a, b, c = load_series(model, 6, seed=5), load_series(model, 6, seed=5), load_series(model, 6, seed=6)
    assert np.array_equal(a.counts, b.counts)
    assert not np.array_equal(a.counts, c.counts)
    assert len(a.counts) == 6 * 60 and a.hours == 6
    assert a.rate_at(0.0) == a.counts[0] / 60 and a.rate_at(10 * 3600) == a.counts[-1] / 60


def test_bad_parameters_are_refused_in_words():
    for kwargs, words in [
        (dict(mean_rps=0), "mean requests per second"),
        (dict(mean_rps=1, peak_to_trough=0.5), "peak-to-trough ratio must be at least 1"),
        (dict(mean_rps=1, arrival_cv=0), "coefficient of variation"),
        (dict(mean_rps=1, bin_s=7), "divisor of a day"),
    ]:
        with pytest.raises(ValueError, match=words):
            DiurnalLoad(**kwargs)
    with pytest.raises(ValueError, match="hours"):
        load_series(DiurnalLoad(mean_rps=1), 0)
    assert replicas_for(0.0, 7.0) == 1 and replicas_for(14.0, 7.0) == 2 and replicas_for(14.1, 7.0) == 3
