"""A diurnal LLM-serving load: requests per second over one or more days, seeded, with no I/O.

The model (:class:`DiurnalLoad`, drawn by :func:`load_series`):

- **Envelope.** The arrival rate follows a raised cosine over the day,
  lambda(t) = mean x (1 + a cos(2 pi (t - peak) / 1 day)), with a = (R - 1) / (R + 1). Its maximum over its minimum
  is exactly R (`peak_to_trough`) and its mean is `mean_rps`. Real days have two humps (late morning and
  afternoon) and quieter weekends; one cosine is a simplification, and weekends are not modelled.
- **Burstiness.** Arrivals are a Gamma renewal process in operational time Lambda(t) = integral of lambda (time
  rescaling): the gaps are Gamma(k = 1/CV^2, theta = CV^2), mean 1 and coefficient of variation `arrival_cv`, and
  each arrival at operational time tau happens at Lambda^-1(tau). CV 1 is a Poisson process; above 1 arrivals
  bunch. The count in a bin then has mean integral-of-lambda and variance about CV^2 x that mean (its index of
  dispersion is CV^2), which is what the simulator sees: the offered requests per second of each bin
  (`bin_s`, default 60 s).

Where the defaults come from (docs/evaluation.md, "Serving next to training", has the same list):

- BurstGPT (Wang et al., "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems",
  arXiv:2401.17644, 2024; github.com/HPMLL/BurstGPT): Azure OpenAI GPT services of one region, 121 days in its
  public release (5.29 million requests). Its workload generator's "Modeled Scaling" draws request times from
  Gamma distributions (the repository's workload-generator figure), the model used here. Its daily-periodicity
  figure shows conversation traffic with a deep night trough: the ChatGPT conversation log's median request count
  per hour is about 5 at 04:00-07:00 and about 190 at 15:00-16:00 (read off the figure, so approximate), a ratio
  of some 35 for a single-region, single-time-zone population; its API logs have no clear daily shape and vary more
  within an hour than between hours.
- Azure LLM inference trace 2024 (Stojkovic et al., "DynamoLLM: Designing LLM Inference Clusters for Performance
  and Energy Efficiency", HPCA 2025, arXiv:2408.00741; github.com/Azure/AzurePublicDataset,
  AzureLLMInferenceDataset2024.md): one week of two production services, coding (16,803,695 requests,
  2024-05-10 to 05-16) and conversation (27,303,999 requests, 2024-05-12 to 05-18). We digitized the per-minute
  invocation plots of the dataset's own notebook (analysis/AzureLLMInferenceDataset2024.ipynb); the digitized
  means match the published request counts within 1% (1,680 and 2,700 per minute against 1,667 and 2,709). On the
  weekdays, the hourly-smoothed daily maximum over minimum is 1.9-2.3 for conversation and 9.6-11.4 for coding
  (weekend days 1.7 and 5.5-6.8). The default `peak_to_trough` = 2.0 is the conversation service's.
- The same plots give the minute-scale noise around the trend: per-minute counts of conversation have an index of
  dispersion of about 4 (coding about 8), which a Gamma renewal process with CV about 2 (coding about 2.8)
  reproduces. The default `arrival_cv` = 2.0 is that estimate: approximate (the spread is wide), an assumption
  more than a measurement.
- The Azure LLM inference trace 2023 (Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase
  Splitting", ISCA 2024) covers one hour, so it says nothing of the day.
- The peak hour (14:00 of the simulated clock) is arbitrary: only the shape matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DAY_S = 86400.0

# Defaults from the sources in the module docstring.
AZURE_CONVERSATION_PEAK_TO_TROUGH = 2.0  # Azure LLM inference 2024, conversation, weekdays: 1.9-2.3
AZURE_CODING_PEAK_TO_TROUGH = 10.0  # the same trace, coding, weekdays: 9.6-11.4
DEFAULT_ARRIVAL_CV = 2.0  # Gamma inter-arrivals; conversation's minute-scale dispersion (about 4 = CV^2)

_CHUNK = 1 << 20  # arrivals drawn at a time: memory stays bounded whatever the rate


@dataclass(frozen=True)
class DiurnalLoad:
    """Requests per second over the day: a raised cosine of mean `mean_rps` whose maximum is `peak_to_trough`
    times its minimum, peaking at `peak_hour`; arrivals a Gamma renewal process of coefficient of variation
    `arrival_cv` (1: Poisson), counted in bins of `bin_s` seconds."""

    mean_rps: float
    peak_to_trough: float = AZURE_CONVERSATION_PEAK_TO_TROUGH
    arrival_cv: float = DEFAULT_ARRIVAL_CV
    peak_hour: float = 14.0
    bin_s: float = 60.0

    def __post_init__(self) -> None:
        problems = []
        if not (self.mean_rps > 0 and math.isfinite(self.mean_rps)):
            problems.append(f"mean requests per second must be a positive number, not {self.mean_rps}")
        if not (self.peak_to_trough >= 1 and math.isfinite(self.peak_to_trough)):
            problems.append(f"the peak-to-trough ratio must be at least 1, not {self.peak_to_trough}")
        if not (self.arrival_cv > 0 and math.isfinite(self.arrival_cv)):
            problems.append(f"the arrivals' coefficient of variation must be positive, not {self.arrival_cv}")
        if not (self.bin_s > 0 and DAY_S % self.bin_s == 0):
            problems.append(f"the bin must be a positive divisor of a day in seconds, not {self.bin_s}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def amplitude(self) -> float:
        """a in lambda = mean x (1 + a cos(...)): (R - 1) / (R + 1), so that max / min = R."""
        return (self.peak_to_trough - 1) / (self.peak_to_trough + 1)

    @property
    def peak_rps(self) -> float:
        return self.mean_rps * (1 + self.amplitude)

    @property
    def trough_rps(self) -> float:
        return self.mean_rps * (1 - self.amplitude)

    def rate(self, t: np.ndarray | float) -> np.ndarray:
        """The envelope lambda(t), requests per second at `t` seconds from the start (midnight)."""
        phase = 2 * np.pi * (np.asarray(t, dtype=float) - self.peak_hour * 3600.0) / DAY_S
        return self.mean_rps * (1 + self.amplitude * np.cos(phase))

    def cumulative(self, t: np.ndarray | float) -> np.ndarray:
        """Lambda(t): the expected arrivals in [0, t), the integral of the envelope (strictly increasing)."""
        t = np.asarray(t, dtype=float)
        w = 2 * np.pi / DAY_S
        shift = self.peak_hour * 3600.0
        return self.mean_rps * (t + self.amplitude / w * (np.sin(w * (t - shift)) - np.sin(-w * shift)))


@dataclass(frozen=True)
class LoadSeries:
    """Offered requests per bin: `counts[i]` arrivals in [i x bin_s, (i + 1) x bin_s)."""

    model: DiurnalLoad
    counts: np.ndarray  # int64, one per bin

    @property
    def bin_s(self) -> float:
        return self.model.bin_s

    @property
    def rates(self) -> np.ndarray:
        """Requests per second in each bin."""
        return self.counts / self.model.bin_s

    @property
    def hours(self) -> float:
        return len(self.counts) * self.model.bin_s / 3600.0

    def rate_at(self, t: float) -> float:
        """The offered requests per second of the bin holding `t` (the last bin's after the end)."""
        i = min(max(int(t // self.model.bin_s), 0), len(self.counts) - 1)
        return float(self.counts[i]) / self.model.bin_s


def load_series(model: DiurnalLoad, hours: float, seed: int = 0) -> LoadSeries:
    """`hours` of offered load under `model` (whole bins), the same for the same seed."""
    if not (hours > 0 and math.isfinite(hours)):
        raise ValueError(f"hours must be a positive number, not {hours}")
    bins = max(1, int(round(hours * 3600.0 / model.bin_s)))
    edges = model.cumulative(np.arange(bins + 1) * model.bin_s)  # operational time at the bin edges
    counts = np.zeros(bins, dtype=np.int64)
    rng = np.random.default_rng(seed)
    shape = 1.0 / model.arrival_cv**2
    tau = 0.0
    end = float(edges[-1])
    while tau < end:
        gaps = rng.gamma(shape, 1.0 / shape, size=int(min(_CHUNK, 1.1 * (end - tau) + 1000)))
        times = tau + np.cumsum(gaps)
        tau = float(times[-1])
        # Arrivals at operational times `times` fall in the bin whose edges bracket them.
        where = np.searchsorted(edges, times[times < end], side="right") - 1
        counts += np.bincount(where, minlength=bins)[:bins]
    return LoadSeries(model, counts)


def arrival_times(model: DiurnalLoad, hours: float, seed: int = 0) -> np.ndarray:
    """Every arrival (seconds from the start) over `hours`: the same process as `load_series`, kept whole (for
    small loads and tests: memory grows with the arrivals)."""
    end_t = hours * 3600.0
    grid = np.linspace(0.0, end_t, max(2, int(end_t // 10.0) + 1))  # Lambda is smooth: invert it by interpolation
    big = model.cumulative(grid)
    rng = np.random.default_rng(seed)
    shape = 1.0 / model.arrival_cv**2
    expected = float(big[-1])
    gaps = rng.gamma(shape, 1.0 / shape, size=int(expected + 10 * math.sqrt(expected) * model.arrival_cv + 100))
    taus = np.cumsum(gaps)
    taus = taus[taus < expected]
    return np.interp(taus, big, grid)


def replicas_for(rps: float, per_replica_rps: float) -> int:
    """Replicas that hold `rps` at `per_replica_rps` each (at least one)."""
    return max(1, math.ceil(rps / per_replica_rps - 1e-9))
