"""The micro-batch-size time model ``t(b) = a + c * b`` and its fit. Torch-free.

``a`` is a unit's fixed per-call part (``UnitProfile.forward_overhead_s``), ``c`` its
per-sample part; the measured profiler fits it to times at several batch sizes, the analytic
one to priced op counts (``calibrate.priced_times``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_time_model(sizes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit ``t(b) = a + c * b`` with ``a, c >= 0``; returns ``(a, c)``.

    With one size the whole time is per-sample (``a = 0``). When the unconstrained fit has a
    negative coefficient, the best fit with that coefficient fixed at 0 is returned
    (through the origin, or a constant), which is the constrained optimum for two unknowns.
    """
    b = np.asarray(sizes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if b.size != t.size or b.size == 0:
        raise ValueError("need one time per size and at least one size")
    if b.size == 1 or np.ptp(b) == 0:
        return 0.0, float(t.mean() / b.mean()) if b.mean() > 0 else 0.0
    design = np.stack([np.ones_like(b), b], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, t, rcond=None)
    if a >= 0 and c >= 0:
        return float(a), float(c)
    through_origin = (0.0, max(float(b @ t / (b @ b)), 0.0))
    constant = (max(float(t.mean()), 0.0), 0.0)

    def sse(fit: tuple[float, float]) -> float:
        return float(((fit[0] + fit[1] * b - t) ** 2).sum())

    return min(through_origin, constant, key=sse)
