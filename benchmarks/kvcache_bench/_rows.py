"""What every case of kvcache-bench builds on: a row of the report and the statistics of paired
timings. The package's cases import it; it imports none of them."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field


@dataclass
class Row:
    case: str
    kvcache_ns: float | None       # median per operation; None: the case waits (the note says for what)
    kvcache_range: tuple | None    # (min, max) per operation
    baseline_ns: float | None = None
    ratio: float | None = None     # baseline / kvcache (higher is better): median of per-repetition pairs
    gbps: float | None = None      # kvcache's bandwidth where data moves
    yardstick: str = ""            # what the yardstick is (memset, streaming memset, memcpy on N threads, ...)
    yardstick_gbps: float | None = None
    yardstick_ratio: float | None = None  # kvcache time / yardstick time (lower is better), paired median
    note: str = ""
    extra: dict = field(default_factory=dict)


def waiting(case: str, why: str) -> Row:
    """A row for a case that cannot run yet: it says what it waits for."""
    return Row(case, None, None, note=f"waiting: {why}")


def _median_range(values):
    return statistics.median(values), (min(values), max(values))


def _paired(a, b) -> float:
    """Median over the repetitions of a[i] / b[i]: two things timed back to back in each
    repetition, so that a slow spell of the machine slows both."""
    return statistics.median(x / y for x, y in zip(a, b))


def _paired_interval(a, b, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """The bootstrap interval of _paired(a, b) at this level: the medians of resamplings of the
    per-repetition ratios, seeded so that the same times give the same interval."""
    ratios = [x / y for x, y in zip(a, b)]
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return medians[cut], medians[resamples - 1 - cut]
