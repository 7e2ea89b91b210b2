"""Least squares small enough to read: the fits behind ``bidir-kv plan --calibration``.

Pure functions over a handful of points (one per sweep point), no numpy. The pull
fit separates per-descriptor from per-byte cost only when the run lets it: within
one deployment every descriptor usually carries the same bytes, and then the two
slopes are the same line (docs/profiles.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bidir_kv.plan.planner import PlanError

__all__ = ["FitError", "PullFit", "fit_pull", "least_squares", "linear_fit"]

# bytes per descriptor varying less than this across points: the slopes are not separable
_SEPARABLE_SPREAD = 0.05


class FitError(PlanError):
    """Too few or degenerate points for the requested fit."""


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Coefficients minimising ``Σ (row · c − y)²``; ``None`` if the normal matrix is singular."""
    k = len(rows[0]) if rows else 0
    if not rows or len(rows) != len(ys) or len(rows) < k:
        return None
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    scale = max(abs(a[i][i]) for i in range(k)) or 1.0
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, k))) / a[i][i]
    return x


def linear_fit(
    xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None
) -> tuple[float, float]:
    """(intercept, slope) by least squares; one distinct x gives a line through the origin.

    ``weights`` scale each point's residual (``1/y`` fits relative errors).
    """
    if not xs or len(xs) != len(ys):
        raise FitError("a fit needs at least one (x, y) pair")
    if len(set(xs)) == 1:
        x = sum(xs) / len(xs)
        y = sum(ys) / len(ys)
        return 0.0, (y / x if x else 0.0)
    w = list(weights) if weights is not None else [1.0] * len(xs)
    coef = least_squares(
        [[wi, wi * x] for x, wi in zip(xs, w, strict=True)],
        [wi * y for y, wi in zip(ys, w, strict=True)],
    )
    assert coef is not None  # two distinct xs: the 2×2 normal matrix is regular
    return coef[0], coef[1]


@dataclass(frozen=True)
class PullFit:
    """``t = fixed_us + per_descriptor_us × descriptors + us_per_byte × bytes`` per transfer."""

    fixed_us: float
    per_descriptor_us: float
    us_per_byte: float
    separable: bool  # False: the descriptor cost is folded into us_per_byte
    note: str


def fit_pull(
    times_us: Sequence[float], descriptors: Sequence[float], nbytes: Sequence[float]
) -> PullFit:
    """Fit one point per sweep point (means per rank-level transfer).

    The three-term fit is kept only if bytes per descriptor vary across points by
    more than 5 % and every coefficient comes out non-negative; otherwise the
    two-term fit on bytes alone, with a note saying why.
    """
    if not times_us or not (len(times_us) == len(descriptors) == len(nbytes)):
        raise FitError("the pull fit needs one (time, descriptors, bytes) triple per point")
    per_desc = [b / d for b, d in zip(nbytes, descriptors, strict=True) if d > 0]
    spread = (max(per_desc) - min(per_desc)) / max(per_desc) if per_desc else 0.0
    if len(times_us) >= 3 and spread > _SEPARABLE_SPREAD:
        rows = [[1.0, d, b] for d, b in zip(descriptors, nbytes, strict=True)]
        coef = least_squares(rows, times_us)
        if coef is not None and min(coef) >= 0:
            return PullFit(
                coef[0],
                coef[1],
                coef[2],
                True,
                f"fixed, per-descriptor and per-byte fitted over {len(times_us)} points "
                f"(bytes per descriptor {min(per_desc):,.0f}-{max(per_desc):,.0f})",
            )
        why = "the three-term fit gave a negative term"
    elif per_desc:
        why = (
            f"bytes per descriptor are ~constant ({min(per_desc):,.0f}-{max(per_desc):,.0f} B)"
            if len(times_us) >= 3
            else f"only {len(times_us)} point(s)"
        )
    else:
        why = "the run reports no descriptors"
    fixed, slope = linear_fit(nbytes, times_us)
    if fixed < 0:  # a negative intercept is noise: refit through the origin
        fixed, slope = 0.0, sum(times_us) / sum(nbytes) if sum(nbytes) else 0.0
    return PullFit(
        fixed,
        0.0,
        max(slope, 0.0),
        False,
        f"per-descriptor cost not separable ({why}): folded into the per-byte cost",
    )
