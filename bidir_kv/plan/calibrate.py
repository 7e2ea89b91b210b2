"""A cost model measured by ``bench``: the planner's terms fitted to a result directory.

The same terms as a derived profile (docs/profiles.md §6), from the ``/metrics``
deltas ``bench`` records per point:

* recompute µs/token and a per-request fixed part: OFF leg, the router's prefill
  histogram (mean per request) against the tokens P computed per request;
* pull fixed, per descriptor and per byte: ON leg, P's ``vllm:nixl_xfer_time_seconds``
  against ``vllm:nixl_num_descriptors`` and ``vllm:nixl_bytes_transferred`` (means per
  rank-level transfer, bidir_kv.plan.fit);
* step granularity: what the ON leg's router prefill holds beyond the per-request
  part, the uncached tail and the transfers, per pull against tokens per pull: the
  intercept is half a step (``step_us``), the slope P's own work per pulled token
  (``pull_after_us_per_token``);
* contention (bidir_kv.plan.contention): with several clients on one P, the wait
  for each other's compute, replayed from the run's own arrivals; both fits above
  are made on the prefill less that wait, so the per-request terms stay per request.

* attention: when the model's shape is known, the context term is the matmul term
  times the shape's FLOP ratio (``FitInput.ctx_ratio``; assumption: attention runs at
  the matmuls' rate), so the OFF fit stays two-parameter;
* D's part of TTFT: TTFT less the router prefill per leg and point, against the
  prompt tokens (fixed + per token), when the input has TTFT means.

One fit, two inputs: :func:`fit` works on a :class:`FitInput`; :func:`fit_input`
builds one from a ``bench`` result directory, :mod:`bidir_kv.plan.published` from
a published table. ``check_rows`` puts the calibration next to its own run, point by
point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bidir_kv.bench.results import LegPoint, ResultDir
from bidir_kv.bench.summary import summarize_result
from bidir_kv.plan.contention import Arrival, arrivals, closed_loop_wait_us, mean_wait_us
from bidir_kv.plan.fit import PullFit, fit_pull, linear_fit
from bidir_kv.plan.planner import DEFAULT_BLOCK_SIZE, CostModel, PlanError
from bidir_kv.plan.tail import Tail, prefill_tail

__all__ = [
    "CheckRow",
    "FitInput",
    "OffInput",
    "OnInput",
    "TtftInput",
    "calibrate",
    "check_rows",
    "fit",
    "fit_input",
    "linear_fit",
    "residuals",
]


@dataclass(frozen=True)
class OffInput:
    """One OFF point: P's mean prefill per request and the tokens it computed for it."""

    point: int
    prefill_us: float
    computed_per_request: float
    arrivals: tuple[Arrival, ...] = ()  # the point's requests (contention), if known


@dataclass(frozen=True)
class OnInput:
    """One ON point per request: the prefill, the pulls and P's computed tail."""

    point: int
    prefill_us: float
    computed_per_request: float
    pulls_per_request: float
    tokens_per_pull: float
    xfer_us: float  # mean per rank-level transfer
    xfer_bytes: float  # mean per rank-level transfer
    xfer_descriptors: float  # mean per rank-level transfer
    xfer_count: float  # rank-level transfers of the point (weights the per-token totals)
    tokens_external: float  # tokens P pulled over the point (TP ranks folded)
    arrivals: tuple[Arrival, ...] = ()


@dataclass(frozen=True)
class TtftInput:
    """One leg and point: mean TTFT and mean router prefill (µs), mean prompt tokens."""

    point: int
    leg: str
    prompt_tokens: float
    ttft_us: float
    prefill_us: float


@dataclass(frozen=True)
class FitInput:
    """What the fit needs, whatever measured it (a bench run, a published table)."""

    source: str  # for the notes
    off: tuple[OffInput, ...]
    on: tuple[OnInput, ...]
    ttft: tuple[TtftInput, ...] = ()
    tp: int = 1
    ctx_ratio: float = 0.0  # attention µs/token per 1k context per matmul µs/token
    num_clients: int = 1
    # without arrivals (a published table): per client and turn, the time outside P's
    # prefill (the answer's decode); > 0 estimates the clients' waits for each other
    # (contention.closed_loop_wait_us)
    rest_us: float = 0.0

    def closed_loop(self) -> bool:
        return self.num_clients > 1 and self.rest_us > 0


@dataclass(frozen=True)
class CheckRow:
    """Measured vs predicted router prefill per request (ms) at one point."""

    point: int
    off_ms: float | None
    off_pred_ms: float | None
    on_ms: float | None
    on_pred_ms: float | None
    off_wait_ms: float = 0.0  # of the prediction: contention (waiting for others' compute)
    on_wait_ms: float = 0.0
    off_tail: Tail | None = None  # the few requests far beyond the median (plan.tail)
    on_tail: Tail | None = None

    @staticmethod
    def error(measured: float | None, predicted: float | None) -> float | None:
        """(predicted − measured) / measured, or None."""
        if not measured or predicted is None:
            return None
        return (predicted - measured) / measured


def _tp(result: ResultDir) -> int:
    engines = result.manifest.get("engines") or {}
    return max(1, int(engines.get("tensor_parallel_size") or 1))


def _usable(result: ResultDir) -> tuple[list[LegPoint], list[LegPoint]]:
    rows = summarize_result(result, min_turn=1).rows
    # points with failed requests are left out: their timings are not the engine's
    off = [r for r in rows if r.leg == "off" and r.prefill_ms and r.prefill_count and not r.errors]
    on = [r for r in rows if r.leg == "on" and r.xfer_count and r.tokens_external and not r.errors]
    if not off:
        raise PlanError(
            f"{result.path}: no OFF points with a router prefill histogram; cannot fit recompute"
        )
    if not on:
        raise PlanError(f"{result.path}: no ON points with KV transfers; cannot fit pull costs")
    return off, on


def _arrivals(result: ResultDir, r: LegPoint) -> tuple[Arrival, ...]:
    engines = result.manifest.get("engines") or {}
    records = result.points.get((r.leg, r.point), ([], {}))[0]
    return tuple(
        arrivals(
            records,
            computed_total=r.tokens_local_compute,
            pulled_total=r.tokens_external,
            block_size=int(engines.get("block_size") or DEFAULT_BLOCK_SIZE),
            threshold=int(engines.get("kv_recompute_threshold") or 0),
        )
    )


def _on_point(result: ResultDir, r: LegPoint, tp: int) -> OnInput:
    pulls = r.xfer_count / tp
    requests = r.prefill_count or pulls
    return OnInput(
        point=r.point,
        prefill_us=(r.prefill_ms or 0.0) * 1e3,
        computed_per_request=r.tokens_local_compute / requests,
        pulls_per_request=pulls / requests,
        tokens_per_pull=r.tokens_external / pulls,
        xfer_us=(r.xfer_ms_per_transfer or 0.0) * 1e3,
        xfer_bytes=(r.mb_per_transfer or 0.0) * 2**20,
        xfer_descriptors=r.descriptors_per_transfer or 0.0,
        xfer_count=r.xfer_count,
        tokens_external=r.tokens_external,
        arrivals=_arrivals(result, r),
    )


def fit_input(result: ResultDir) -> FitInput:
    """The fit's input from a ``bench`` result directory (every turn, per point)."""
    off, on = _usable(result)
    tp = _tp(result)
    ttft = tuple(
        TtftInput(r.point, r.leg, r.input_tokens_mean, r.ttft_mean * 1e3, r.prefill_ms * 1e3)
        for r in summarize_result(result, min_turn=1).rows
        # the reference legs only: an ON leg of another connector (on+bidir-kv) is a
        # comparison, not more of the same cost model
        if r.leg in ("off", "on")
        and r.prefill_ms
        and r.ttft_n
        and r.input_tokens_mean
        and not r.errors
    )
    return FitInput(
        source=f"calibrated from {result.path}",
        off=tuple(
            OffInput(
                r.point,
                (r.prefill_ms or 0.0) * 1e3,
                r.tokens_local_compute / r.prefill_count,
                _arrivals(result, r),
            )
            for r in off
        ),
        on=tuple(_on_point(result, r, tp) for r in on),
        ttft=ttft,
        tp=tp,
        num_clients=int(result.manifest.get("num_clients", 1) or 1),
    )


def _fit_transfers(on: Sequence[OnInput]) -> PullFit:
    return fit_pull(
        [p.xfer_us for p in on], [p.xfer_descriptors for p in on], [p.xfer_bytes for p in on]
    )


def _line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope), weighted; a negative intercept is noise: through the origin."""
    fixed, slope = linear_fit(xs, ys, ws)
    if fixed < 0:
        num = sum(w * w * x * y for x, y, w in zip(xs, ys, ws, strict=True))
        return 0.0, num / sum(w * w * x * x for x, w in zip(xs, ws, strict=True))
    return fixed, slope


def _relative(ys: Sequence[float]) -> list[float]:
    """Weights 1/y: the fits minimise relative error (assumption: a shared machine's noise
    stretches a whole request, so it is proportional to the time, docs/profiles.md §6)."""
    return [1.0 / y if y > 0 else 0.0 for y in ys]


def _effective(tokens: float, ctx_ratio: float) -> float:
    """Tokens computed from context 0, weighted by the attention term: recompute(n) /
    the matmul µs/token (``n × (1 + ratio × n/2 / 1000)``)."""
    return tokens * (1 + ctx_ratio * tokens / 2000)


def _fit_recompute(
    xs: Sequence[float], ys: Sequence[float], arrs: Sequence[Sequence[Arrival]]
) -> tuple[float, float]:
    """(per-request µs, µs/token) of the OFF prefill less the contention wait it implies.

    The wait grows with the slope (more work per request, longer queues), so the
    slope is searched: for each candidate the intercept is the least-squares one
    of the prefill less the wait, and the candidate with the least squared error
    wins. One client (no overlap at the plain fit's slope) is the plain fit.
    """
    ws = _relative(ys)
    fixed0, slope0 = _line(xs, ys, ws)
    if slope0 <= 0 or not any(mean_wait_us(a, slope0) for a in arrs):
        return fixed0, slope0
    w2 = [w * w for w in ws]

    def sse(b: float) -> tuple[float, float]:
        rest = [y - mean_wait_us(a, b) - b * x for x, y, a in zip(xs, ys, arrs, strict=True)]
        fixed = max(0.0, sum(r * v for r, v in zip(rest, w2, strict=True)) / sum(w2))
        return sum((r - fixed) ** 2 * v for r, v in zip(rest, w2, strict=True)), fixed

    grid = [slope0 * k / 100 for k in range(1, 201)]
    best = min(grid, key=lambda b: sse(b)[0])
    lo, hi = best - slope0 / 100, best + slope0 / 100
    for _ in range(40):  # golden section inside the best grid cell
        m1, m2 = hi - (hi - lo) * 0.618, lo + (hi - lo) * 0.618
        lo, hi = (lo, m2) if sse(m1)[0] <= sse(m2)[0] else (m1, hi)
    slope = (lo + hi) / 2
    return sse(slope)[1], slope


def _fit_decode_part(ttft: Sequence[TtftInput]) -> tuple[float, float]:
    """(fixed µs, µs per prompt token) of TTFT less the router prefill, both legs."""
    if not ttft:
        return 0.0, 0.0
    xs = [t.prompt_tokens for t in ttft]
    ys = [t.ttft_us - t.prefill_us for t in ttft]
    fixed, slope = _line(xs, ys, _relative([t.ttft_us for t in ttft]))
    if slope < 0:  # D's part does not grow with the prompt: its mean, as a fixed part
        return max(0.0, sum(ys) / len(ys)), 0.0
    return fixed, slope


def _fit_closed_loop(
    xs: Sequence[float], ys: Sequence[float], inp: FitInput
) -> tuple[float, float]:
    """(per-request µs, µs/token) of the OFF prefill less the clients' estimated wait
    for each other (no arrivals): the wait depends on the terms, so fit, estimate,
    refit until it settles."""
    ws = _relative(ys)
    fixed, slope = _line(xs, ys, ws)
    for _ in range(50):
        rest = [
            y - closed_loop_wait_us(fixed + slope * x, inp.rest_us, inp.num_clients)
            for x, y in zip(xs, ys, strict=True)
        ]
        fixed, slope = _line(xs, rest, ws)
    return fixed, slope


def _off_wait_us(inp: FitInput, cost: CostModel, p: OffInput) -> float:
    """An OFF point's wait for the other clients' compute: replayed, or estimated."""
    if p.arrivals or not inp.closed_loop():
        return mean_wait_us(p.arrivals, cost.recompute_us_per_token)
    service = cost.prefill_fixed_us + cost.recompute_us(p.computed_per_request)
    return closed_loop_wait_us(service, inp.rest_us, inp.num_clients)


def calibrate(result: ResultDir, kv_bytes_per_token: float | None = None) -> CostModel:
    """Fit the cost terms to a ``bench`` result directory (``plan --calibration DIR``)."""
    return fit(fit_input(result), kv_bytes_per_token)


def fit(inp: FitInput, kv_bytes_per_token: float | None = None) -> CostModel:
    """The cost terms from measured points: the one fit behind every calibration."""
    if not inp.off:
        raise PlanError(f"{inp.source}: no OFF points; cannot fit recompute")
    if not inp.on:
        raise PlanError(f"{inp.source}: no ON points with KV transfers; cannot fit pull costs")
    tp = inp.tp
    ratio = inp.ctx_ratio
    xs = [_effective(p.computed_per_request, ratio) for p in inp.off]
    ys = [p.prefill_us for p in inp.off]
    off_arrs = [p.arrivals for p in inp.off]
    if inp.closed_loop() and not any(off_arrs):
        fixed_req, recompute = _fit_closed_loop(xs, ys, inp)
    else:
        fixed_req, recompute = _fit_recompute(xs, ys, off_arrs)
    if recompute <= 0:
        raise PlanError(
            f"{inp.source}: OFF prefill time did not grow with the tokens P computed "
            f"(slope {recompute:.3g} µs/token); the run is too small or too noisy to calibrate"
        )
    pull = _fit_transfers(inp.on)
    total_tokens = sum(p.tokens_external for p in inp.on)
    total_bytes = sum(p.xfer_bytes * p.xfer_count for p in inp.on)
    total_descs = sum(p.xfer_descriptors * p.xfer_count for p in inp.on)
    measured_bpt = total_bytes / total_tokens
    d_fixed, d_per_token = _fit_decode_part(inp.ttft)
    cost = CostModel(
        recompute_us_per_token=recompute,
        recompute_us_per_token_ctx=recompute * ratio,
        xfer_us_per_token=pull.us_per_byte * measured_bpt / tp,
        pull_overhead_us=pull.fixed_us,
        kv_bytes_per_token=measured_bpt if kv_bytes_per_token is None else kv_bytes_per_token,
        source="calibration",
        xfer_us_per_descriptor=pull.per_descriptor_us,
        descriptors_per_token=total_descs / (total_tokens * tp) if pull.separable else 0.0,
        prefill_fixed_us=fixed_req,
        decode_ttft_fixed_us=d_fixed,
        decode_ttft_us_per_token=d_per_token,
    )
    points = list(inp.on)
    step, after = _residual_fit(cost, points, fitted_pull=False, inp=inp)
    # the wait depends on when a pulled request reaches P's compute: once more with the pull
    for _ in range(20 if inp.closed_loop() else 1):  # closed loop: the wait grows with P's work
        step, after = _residual_fit(
            replace(cost, step_us=step, pull_after_us_per_token=after),
            points,
            fitted_pull=True,
            inp=inp,
        )
    waits = [
        _off_wait_us(inp, replace(cost, recompute_us_per_token=recompute), p) / 1e3 for p in inp.off
    ]
    notes = (
        f"{inp.source}: {len(inp.off)} OFF and {len(inp.on)} ON points",
        f"recompute fit over {', '.join(f'{p.computed_per_request:.0f}' for p in inp.off)} "
        "tokens/request"
        + (
            " (through the origin)"
            if fixed_req == 0
            else f" (+ {fixed_req / 1e3:.2f} ms per request)"
        )
        + (f"; attention term {ratio:.4f} × the matmul term per 1k context" if ratio else ""),
        f"pull: {pull.note}",
        f"beyond the transfer histogram, per pull: {step / 2 / 1e3:.2f} ms (half a step: the "
        f"completion is seen at step granularity) + {after:.3f} µs per pulled token",
        f"contention ({inp.num_clients} client(s) on one P, first come first served, "
        + (
            f"estimated for closed loops of {inp.rest_us / 1e3:.0f} ms outside P"
            if inp.closed_loop() and not any(off_arrs)
            else "replayed"
        )
        + f"): OFF wait {', '.join(f'{w:.1f}' for w in waits)} ms/request",
        *(
            (
                f"D's part of TTFT (TTFT less the prefill, {len(inp.ttft)} leg points): "
                f"{d_fixed / 1e3:.2f} ms + {d_per_token:.3f} µs per prompt token",
            )
            if inp.ttft
            else ()
        ),
    )
    return replace(cost, step_us=step, pull_after_us_per_token=after, notes=notes, sources=notes)


def _on_wait_us(
    cost: CostModel, p: OnInput, measured_pull: bool = False, inp: FitInput | None = None
) -> float:
    """The point's contention wait; a pulled request reaches P's compute after its pull.

    Without arrivals and with ``inp`` a closed loop, estimated: P's compute for the
    request (its fixed part, the tail, its work on the pulled tokens; not the READ)
    against the rest of the client's turn (the READ, the answer)."""
    per_pull = p.xfer_us if measured_pull else cost.pull_us(p.tokens_per_pull)
    if not p.arrivals and inp is not None and inp.closed_loop():
        pulled = p.pulls_per_request * p.tokens_per_pull
        service = (
            cost.prefill_fixed_us
            + _on_recompute_us(cost, p)
            + pulled * cost.pull_after_us_per_token
        )
        rest = inp.rest_us + p.pulls_per_request * per_pull
        return closed_loop_wait_us(service, rest, inp.num_clients)
    return mean_wait_us(p.arrivals, cost.recompute_us_per_token, per_pull, p.pulls_per_request)


def _residual_fit(
    cost: CostModel, points: Sequence[OnInput], *, fitted_pull: bool, inp: FitInput | None = None
) -> tuple[float, float]:
    """(step_us, µs per pulled token) of what the ON prefill holds beyond the model so far.

    Per pull: the residual (against the measured transfer time, less the
    contention wait) over tokens per pull; the intercept is half a step (the
    completion seen at step granularity), the slope P's own work per pulled
    token. Negative parts are noise and dropped. ``fitted_pull``: the wait is
    replayed with ``cost``'s whole pull (second pass), else with the transfer only.
    """
    xs, ys, ws = [], [], []
    for p in points:
        if p.pulls_per_request <= 0 or not p.prefill_us:
            continue
        # relative to the point's prefill, as the OFF fit (a residual per pull)
        ws.append(p.pulls_per_request / p.prefill_us)
        # against the measured transfer time, so a pull-fit error does not leak in here
        transfers = p.pulls_per_request * p.xfer_us
        rest = cost.prefill_fixed_us + _on_recompute_us(cost, p)
        rest += _on_wait_us(cost, p, measured_pull=not fitted_pull, inp=inp)
        xs.append(p.tokens_per_pull)
        ys.append((p.prefill_us - rest - transfers) / p.pulls_per_request)
    if not xs:
        return 0.0, 0.0
    w2 = [w * w for w in ws]
    mean = sum(y * v for y, v in zip(ys, w2, strict=True)) / sum(w2)
    if len(set(xs)) == 1:
        return max(0.0, 2 * mean), 0.0
    half_step, per_token = linear_fit(xs, ys, ws)
    if per_token < 0:
        return max(0.0, 2 * mean), 0.0
    if half_step < 0:  # through the origin; a run faster than the model gives no term
        return 0.0, max(0.0, _line(xs, ys, ws)[1])
    return 2 * half_step, per_token


def _on_recompute_us(cost: CostModel, p: OnInput) -> float:
    """P's computed tail, after the context it pulled."""
    return cost.recompute_us(p.computed_per_request, p.pulls_per_request * p.tokens_per_pull)


def _on_prefill_us(cost: CostModel, p: OnInput) -> float:
    return (
        cost.prefill_fixed_us
        + _on_recompute_us(cost, p)
        + p.pulls_per_request * cost.pull_us(p.tokens_per_pull)
    )


@dataclass(frozen=True)
class Residual:
    """One measured figure next to what the fitted terms give for it (µs)."""

    point: int
    figure: str  # "prefill OFF", "prefill ON", "KV transfer", "TTFT OFF", "TTFT ON"
    measured_us: float
    fitted_us: float

    @property
    def error(self) -> float:
        return (self.fitted_us - self.measured_us) / self.measured_us if self.measured_us else 0.0


def residuals(inp: FitInput, cost: CostModel) -> list[Residual]:
    """Every figure of ``inp`` against ``cost``, the clients' wait for each other
    included (replayed from arrivals, or estimated for closed loops)."""
    out: list[Residual] = []
    for p in inp.off:
        pred = cost.prefill_fixed_us + cost.recompute_us(p.computed_per_request)
        pred += _off_wait_us(inp, cost, p)
        out.append(Residual(p.point, "prefill OFF", p.prefill_us, pred))
    for q in inp.on:
        pred = _on_prefill_us(cost, q) + _on_wait_us(cost, q, inp=inp)
        out.append(Residual(q.point, "prefill ON", q.prefill_us, pred))
        wire = cost.pull_overhead_us + q.tokens_per_pull * (
            cost.xfer_us_per_token + cost.descriptors_per_token * cost.xfer_us_per_descriptor
        )
        out.append(Residual(q.point, "KV transfer", q.xfer_us, wire))
    for t in inp.ttft:
        part = cost.decode_ttft_us(t.prompt_tokens)
        out.append(Residual(t.point, f"TTFT {t.leg.upper()}", t.ttft_us, t.prefill_us + part))
    return out


def check_rows(result: ResultDir, cost: CostModel) -> list[CheckRow]:
    """Per point: the run's router prefill per request next to what ``cost`` predicts.

    The prediction includes the contention wait replayed from the point's own
    arrivals (``*_wait_ms``), so a run with several clients is checked as run.
    """
    rows = summarize_result(result, min_turn=1)
    tp = _tp(result)
    out = []
    for point in result.prefix_points:
        off, on = rows.get("off", point), rows.get("on", point)
        off_pred = on_pred = None
        off_wait = on_wait = 0.0
        if off and off.prefill_count:
            per_req = off.tokens_local_compute / off.prefill_count
            off_wait = mean_wait_us(_arrivals(result, off), cost.recompute_us_per_token) / 1e3
            off_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3 + off_wait
        if on and on.prefill_count:
            if on.xfer_count and on.tokens_external:
                p = _on_point(result, on, tp)
                on_wait = _on_wait_us(cost, p) / 1e3
                on_pred = _on_prefill_us(cost, p) / 1e3 + on_wait
            else:
                per_req = on.tokens_local_compute / on.prefill_count
                on_wait = mean_wait_us(_arrivals(result, on), cost.recompute_us_per_token) / 1e3
                on_pred = (cost.prefill_fixed_us + cost.recompute_us(per_req)) / 1e3 + on_wait
        out.append(
            CheckRow(
                point,
                off.prefill_ms if off else None,
                off_pred,
                on.prefill_ms if on else None,
                on_pred,
                off_wait,
                on_wait,
                _tail(result, "off", point),
                _tail(result, "on", point),
            )
        )
    return out


def _tail(result: ResultDir, leg: str, point: int) -> Tail | None:
    found = result.points.get((leg, point))
    return prefill_tail(found[1]) if found else None
