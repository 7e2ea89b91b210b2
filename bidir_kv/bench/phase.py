"""Whether two closed-loop clients' turns met: the phase state of a point.

With two clients and fixed-length turns, a point settles into one of two states and
stays there (docs/benchmarking.md, "Three idle runs"): *staggered*, one client's
prefill starting as the other's ends, or *overlapped*, the two prefills sharing P's
steps every turn and both slowed. The headline's TTFT depends on which, so the report
says how many measured turns overlapped another client's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from bidir_kv.bench.stats import RequestRecord

__all__ = ["OVERLAP_SHARE", "overlapped_turns"]

# a turn counts as overlapped when another client's time to first token covers more than
# this share of its own (the staggered state's edges touch by a few %, the overlapped
# state's by half or more)
OVERLAP_SHARE = 0.25


def overlapped_turns(records: Sequence[RequestRecord], min_turn: int) -> tuple[int, int]:
    """(measured turns whose time to first token overlapped another client's by more than
    :data:`OVERLAP_SHARE` of it, measured turns). Measured: ``ok`` and ``turn >=
    min_turn``; every ``ok`` request of any turn can be the one overlapping."""
    spans = sorted(
        (r.start_time_ms, r.start_time_ms + r.ttft_ms, r.client_id) for r in records if r.ok
    )
    starts = [s for s, _, _ in spans]
    longest = max((e - s for s, e, _ in spans), default=0.0)
    measured = [r for r in records if r.ok and r.turn >= min_turn]
    hits = 0
    for r in measured:
        a, b = r.start_time_ms, r.start_time_ms + r.ttft_ms
        lo = bisect.bisect_left(starts, a - longest)
        hi = bisect.bisect_left(starts, b)
        shared = max(
            (min(b, e) - max(a, s) for s, e, c in spans[lo:hi] if c != r.client_id), default=0.0
        )
        if shared > OVERLAP_SHARE * (b - a):
            hits += 1
    return hits, len(measured)
