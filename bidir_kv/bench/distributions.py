"""Seeded numeric distributions written as short strings (``exp:2.5``).

Used for think times and token counts. vLLM's generator uses named
distributions in a JSON file; on the command line one short spec is handier,
and ``Distribution.parse`` names the problem when a spec is wrong.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bidir_kv.errors import ConfigError

__all__ = ["Distribution", "DistributionError"]

_KINDS = {
    "const": 1,
    "uniform": 2,
    "exp": 1,
    "lognormal": 2,
}


class DistributionError(ConfigError):
    """A distribution spec that cannot be parsed; the message says why."""


@dataclass(frozen=True)
class Distribution:
    """``const:V``, ``uniform:A,B``, ``exp:MEAN``, ``lognormal:MEDIAN,SIGMA``."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str | float | int) -> Distribution:
        if isinstance(spec, int | float):
            return cls("const", (float(spec),))
        text = spec.strip()
        if ":" not in text:
            try:
                return cls("const", (float(text),))
            except ValueError:
                raise DistributionError(
                    f"distribution {spec!r}: expected KIND:PARAMS, one of "
                    "const:V, uniform:A,B, exp:MEAN, lognormal:MEDIAN,SIGMA"
                ) from None
        kind, _, rest = text.partition(":")
        kind = kind.strip().lower()
        if kind not in _KINDS:
            raise DistributionError(
                f"distribution {spec!r}: unknown kind {kind!r}; use one of {', '.join(_KINDS)}"
            )
        try:
            params = tuple(float(p) for p in rest.split(",") if p.strip())
        except ValueError:
            raise DistributionError(f"distribution {spec!r}: parameters must be numbers") from None
        if len(params) != _KINDS[kind]:
            raise DistributionError(
                f"distribution {spec!r}: {kind} takes {_KINDS[kind]} parameter(s), "
                f"got {len(params)}"
            )
        if any(p < 0 or math.isnan(p) for p in params):
            raise DistributionError(f"distribution {spec!r}: parameters must be >= 0")
        if kind == "uniform" and params[0] > params[1]:
            raise DistributionError(f"distribution {spec!r}: uniform needs A <= B")
        return cls(kind, params)

    def sample(self, rng: random.Random) -> float:
        p = self.params
        if self.kind == "const":
            return p[0]
        if self.kind == "uniform":
            return rng.uniform(p[0], p[1])
        if self.kind == "exp":
            return rng.expovariate(1.0 / p[0]) if p[0] > 0 else 0.0
        # lognormal: median and sigma of the underlying normal
        if p[0] <= 0:
            return 0.0
        return rng.lognormvariate(math.log(p[0]), p[1])

    def mean(self) -> float:
        p = self.params
        if self.kind == "const":
            return p[0]
        if self.kind == "uniform":
            return (p[0] + p[1]) / 2
        if self.kind == "exp":
            return p[0]
        return p[0] * math.exp(p[1] ** 2 / 2)

    def cdf(self, x: float) -> float:
        """P(X <= x)."""
        p = self.params
        if x < 0:
            return 0.0
        if self.kind == "const":
            return 1.0 if x >= p[0] else 0.0
        if self.kind == "uniform":
            if p[1] == p[0]:
                return 1.0 if x >= p[0] else 0.0
            return min(1.0, max(0.0, (x - p[0]) / (p[1] - p[0])))
        if self.kind == "exp":
            return 1.0 if p[0] == 0 else 1.0 - math.exp(-x / p[0])
        if p[0] <= 0:
            return 1.0
        if x == 0:
            return 0.0
        if p[1] == 0:
            return 1.0 if x >= p[0] else 0.0
        z = (math.log(x) - math.log(p[0])) / (p[1] * math.sqrt(2))
        return 0.5 * (1 + math.erf(z))

    def quantile(self, q: float) -> float:
        """Smallest x with P(X <= x) >= q (bisection; exact for const/uniform/exp)."""
        if not 0 <= q <= 1:
            raise DistributionError(f"quantile: q must be in [0, 1], got {q}")
        p = self.params
        if self.kind == "const":
            return p[0]
        if self.kind == "uniform":
            return p[0] + q * (p[1] - p[0])
        if self.kind == "exp":
            return math.inf if q >= 1 else -p[0] * math.log(1 - q)
        if q >= 1:
            return math.inf
        lo, hi = 0.0, max(1.0, p[0])
        while self.cdf(hi) < q:
            hi *= 2
        for _ in range(200):
            mid = (lo + hi) / 2
            if self.cdf(mid) < q:
                lo = mid
            else:
                hi = mid
        return hi

    def mean_truncated(self, cap: float) -> float:
        """E[min(X, cap)] = integral of the survival function from 0 to cap."""
        if cap <= 0:
            return 0.0
        p = self.params
        if self.kind == "const":
            return min(p[0], cap)
        if self.kind == "exp":
            return 0.0 if p[0] == 0 else p[0] * (1 - math.exp(-cap / p[0]))
        # numeric integration of 1 - F(x) (Simpson, 2000 intervals)
        n = 2000
        h = cap / n
        total = 0.0
        for i in range(n + 1):
            w = 1 if i in (0, n) else (4 if i % 2 else 2)
            total += w * (1.0 - self.cdf(i * h))
        return total * h / 3

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}"
