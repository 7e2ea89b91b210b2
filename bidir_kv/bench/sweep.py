"""Running ``bidir-kv bench``: every leg over every sweep point, into one result directory.

A leg is either launched here (``--topology``) or a running deployment
(``--url``). The manifest is rewritten after every step, so a Ctrl-C, a
SIGTERM or a failed node leaves a readable partial result and the PIDs of
every node this run started.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.bench.capacity import client_capacity
from bidir_kv.bench.interrupt import Interrupt, run_point_interruptible, terminate
from bidir_kv.bench.memory import DEFAULT_INTERVAL_S
from bidir_kv.bench.overhead import load_now, node_cpu, point_overhead
from bidir_kv.bench.progress import Progress
from bidir_kv.bench.reuse import ChatTokenizer, fill_reusable
from bidir_kv.bench.runner import (
    ConversationState,
    HttpTokenCounter,
    RunOptions,
    metrics_delta,
    snapshot_nodes,
    write_point,
)
from bidir_kv.bench.split import log_offsets
from bidir_kv.bench.topo import (
    STOCK,
    LegSetup,
    leg_connector,
    node_urls,
    plan_legs,
    start_leg,
)
from bidir_kv.bench.workload import (
    Conversation,
    TokenCounter,
    WorkloadSpec,
    build_conversations,
    count_words,
)
from bidir_kv.client import ClientError

__all__ = ["parse_metrics_urls", "run_bench", "write_manifest"]


def write_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    """Atomic write: a reader never sees a half-written manifest."""
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(out / "manifest.json")


def run_bench(args: argparse.Namespace) -> int:
    """Run the sweep ``args`` describe; 0 when complete, 130 when interrupted."""
    legs = _legs(args)
    specs = _specs(args)
    out: Path = args.out or Path("out") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(args, legs, specs)
    write_manifest(out, manifest)
    total = len(legs) * sum(s.num_conversations * s.num_turns for s in specs)
    sweep = _Sweep(args, specs, out, manifest, Progress(total, args.progress))
    interrupted = sweep.run(legs)
    if args.client_check and not interrupted:
        manifest["client_capacity"] = client_capacity(manifest, args.num_clients, out)
        write_manifest(out, manifest)
    if len(_connectors(args)) > 1:
        _print_connectors(out)
    print(f"results: {out}" + ("  (partial: interrupted)" if interrupted else ""))
    return 130 if interrupted else 0


def _print_connectors(out: Path) -> None:
    """The connectors side by side (``bidir-kv report DIR`` prints it too)."""
    from bidir_kv.bench.compare import connector_table
    from bidir_kv.bench.results import ResultError, load_result
    from bidir_kv.bench.summary import summarize_result

    try:
        table = connector_table(summarize_result(load_result(out)))
    except (ResultError, ValueError, OSError) as exc:
        print(f"warning: no connector table: {exc}", file=sys.stderr)
        return
    if table:
        print(table)


def _connectors(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(getattr(args, "connector", None) or (STOCK,))


def _legs(args: argparse.Namespace) -> list[str]:
    """The session's legs (``LegError`` names the flag at fault)."""
    features = [x.strip() for x in args.legs.split(",") if x.strip()]
    legs = plan_legs(features, _connectors(args), args.topology, external=bool(args.url))
    if args.url and len(legs) != 1:
        raise SystemExit("bidir-kv bench: with --url run one leg per invocation (--legs on)")
    return legs


def _specs(args: argparse.Namespace) -> list[WorkloadSpec]:
    beyond_gap = args.beyond_ttl_gap
    if beyond_gap is None:
        beyond_gap = 1.1 * args.decoder_kv_blocks_ttl + 1.0
    return [
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
            history=getattr(args, "history", "verbatim"),
        )
        for p in args.prefix_tokens
    ]


def _leg_setup(args: argparse.Namespace, out: Path) -> LegSetup:
    vllm_cpu = args.topology == "vllm-cpu"
    router_args = tuple(args.router_arg)
    if vllm_cpu and not any(a.startswith("--prefill-timeout") for a in args.router_arg):
        # real vLLM on a small shared CPU can take tens of seconds per long prefill
        router_args += ("--prefill-timeout", "600")
    return LegSetup(
        topology=args.topology,
        profile=args.profile,
        model=args.model,
        block_size=args.block_size,
        kv_recompute_threshold=args.kv_recompute_threshold,
        decoder_kv_blocks_ttl=args.decoder_kv_blocks_ttl,
        kv_load_failure_policy=args.kv_load_failure_policy,
        decode_stream=args.decode_stream or ("never" if vllm_cpu else LegSetup().decode_stream),
        transport=args.transport,
        router_args=router_args,
        engine_args=tuple(getattr(args, "engine_arg", None) or ()),
        prefill_engine_args=tuple(getattr(args, "prefill_engine_arg", None) or ()),
        decode_engine_args=tuple(getattr(args, "decode_engine_arg", None) or ()),
        prefill_prefix_caching=bool(getattr(args, "prefill_prefix_caching", False)),
        retention_budget=getattr(args, "retention_budget", None),
        log_dir=out / "logs",
        connector=_connectors(args)[0],
    )


def _manifest(
    args: argparse.Namespace, legs: Sequence[str], specs: Sequence[WorkloadSpec]
) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "tool": "bidir-kv bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "topology": "external" if args.url else args.topology,
        "profile": None if args.url else args.profile,
        "model": args.model,
        "legs": list(legs),
        # the reference connector (the one ``off`` and ``on`` ran with), then each leg's;
        # unknown for --url (the deployment runs whatever it was started with)
        "connector": None if args.url else _connectors(args)[0],
        "leg_connectors": {}
        if args.url
        else {leg: leg_connector(leg, _connectors(args)[0]) for leg in legs},
        "points": args.prefix_tokens,
        "workload": {**asdict(specs[0]), "think_time": str(args.think_time)},
        "num_clients": args.num_clients,
        "max_active_conversations": args.max_active_conversations,
        "send_conversation_id": args.send_conversation_id,
        "return_token_ids": getattr(args, "return_token_ids", True),
        "engines": {
            "kv_recompute_threshold": args.kv_recompute_threshold,
            "decoder_kv_blocks_ttl": args.decoder_kv_blocks_ttl,
            "kv_load_failure_policy": args.kv_load_failure_policy,
            "block_size": args.block_size,
            "transport": args.transport,
            "router_args": args.router_arg,
            "engine_args": getattr(args, "engine_arg", None) or [],
            "prefill_engine_args": getattr(args, "prefill_engine_arg", None) or [],
            "decode_engine_args": getattr(args, "decode_engine_arg", None) or [],
            "retention_budget": getattr(args, "retention_budget", None),
            "decode_stream": None
            if args.url
            else (args.decode_stream or ("never" if args.topology == "vllm-cpu" else "always")),
            "prefix_caching": {
                "prefill": bool(getattr(args, "prefill_prefix_caching", False)),
                "decode": True,
            },
        },
        "complete": False,
        "runs": {},
    }
    manifest["workload"].pop("prefix_tokens", None)
    return manifest


@dataclass
class _Sweep:
    """One invocation's state: the arguments, the manifest, the conversations built so far."""

    args: argparse.Namespace
    specs: list[WorkloadSpec]
    out: Path
    manifest: dict[str, Any]
    progress: Progress
    intr: Interrupt = field(default_factory=Interrupt)
    _conversations: dict[int, list[Conversation]] = field(default_factory=dict)
    _tokenize_url: str | None = None  # the leg's engine with /tokenize (tokens reusable)

    def run(self, legs: Sequence[str]) -> bool:
        """Run every leg; returns whether the run was interrupted. Restores signal handlers."""
        previous_handler = signal.getsignal(signal.SIGINT)
        previous_term = signal.getsignal(signal.SIGTERM)
        self.intr.install()
        # SIGTERM (timeout, CI cancel) must still stop every node: unwind like a hard Ctrl-C
        signal.signal(signal.SIGTERM, terminate)
        interrupted = False
        try:
            if self.args.url:
                interrupted = not self._external_leg(legs[0])
            else:
                interrupted = not self._launched_legs(legs)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signal.signal(signal.SIGINT, previous_handler)
            signal.signal(signal.SIGTERM, previous_term)
            interrupted = interrupted or self.intr.requested
            self.progress.close()
            self.manifest["complete"] = not interrupted
            self.manifest["interrupted"] = interrupted
            write_manifest(self.out, self.manifest)
        return interrupted

    def _external_leg(self, leg: str) -> bool:
        args = self.args
        nodes = dict(parse_metrics_urls(args.metrics_url))
        nodes.setdefault("router0", args.url)
        tok_url = args.tokenize_url or nodes.get("prefill0") or args.url
        counter: TokenCounter = HttpTokenCounter(tok_url, args.model)
        if not HttpTokenCounter(tok_url, args.model).available():
            print(
                f"warning: no /tokenize at {tok_url}; prompt lengths are counted in "
                "words, not tokens, and tokens reusable are not reported",
                file=sys.stderr,
            )
            counter = count_words
        else:
            self._tokenize_url = tok_url
        return self._leg(leg, args.url, nodes, counter)

    def _launched_legs(self, legs: Sequence[str]) -> bool:
        setup = _leg_setup(self.args, self.out)
        for leg in legs:
            self.progress.describe(f"{leg.upper()}: starting {self.args.topology} 1P1D + router")
            with start_leg(leg, setup) as topo:
                self.manifest.setdefault("nodes", {})[leg] = {
                    n.name: {
                        "role": n.role,
                        "url": n.url,
                        "log": n.log_path,
                        "pid": n.info.get("pid"),
                    }
                    for n in topo.nodes()
                }
                write_manifest(self.out, self.manifest)  # which PIDs are ours, should we die
                counter = HttpTokenCounter(topo.prefill[0].url, self.args.model)
                self._tokenize_url = topo.prefill[0].url
                ok = not self.intr.requested and self._leg(
                    leg, topo.router_url, node_urls(topo), counter
                )
            if not ok or self.intr.requested:
                return False
        return True

    def _leg(
        self, leg: str, router_url: str, nodes: Mapping[str, str], counter: TokenCounter
    ) -> bool:
        """Every sweep point of one leg; False when interrupted."""
        args = self.args
        opts = RunOptions(
            url=router_url,
            model=args.model,
            num_clients=args.num_clients,
            max_active_conversations=args.max_active_conversations,
            send_conversation_id=args.send_conversation_id,
            request_timeout_s=args.request_timeout_sec,
            # D only: a scrape costs an emulated node its event loop's time, and P's CPU
            # per request is what the headline judges (docs/benchmarking.md)
            memory_urls={n: u for n, u in nodes.items() if n.startswith("decode")},
            memory_interval_s=getattr(args, "memory_interval", DEFAULT_INTERVAL_S),
            token_ids=getattr(args, "return_token_ids", True),
        )
        for i, spec in enumerate(self.specs):
            if self.intr.requested:
                return False
            if i and args.point_sleep > 0:
                wake = time.monotonic() + args.point_sleep
                while not self.intr.requested and time.monotonic() < wake:
                    time.sleep(min(0.2, wake - time.monotonic()))
            self.progress.describe(f"{leg.upper()} prefix {spec.prefix_tokens}: preparing prompts")
            convs = self._conversations_for(spec, counter)
            if self.intr.requested:
                return False
            if not self._point(leg, spec, convs, opts, nodes):
                return False
        return True

    def _reusable(self, states: Mapping[str, ConversationState]) -> None:
        """Tokens reusable per turn (bench/reuse.py); a warning, never a failed point,
        when the engine cannot tokenize chat messages."""
        if self._tokenize_url is None or not getattr(self.args, "return_token_ids", True):
            return
        tokenize = ChatTokenizer(self._tokenize_url, self.args.model)
        try:
            fill_reusable(
                ((s.messages, s.sent) for s in states.values()), tokenize, self.args.block_size
            )
        except (ClientError, RuntimeError) as exc:
            print(
                f"warning: tokens reusable not computed ({_reusable_error(exc)})",
                file=sys.stderr,
            )

    def _pids(self, leg: str) -> dict[str, int | None]:
        """PIDs of the nodes this run started for ``leg`` (none for ``--url``)."""
        nodes = (self.manifest.get("nodes") or {}).get(leg) or {}
        return {name: n.get("pid") for name, n in nodes.items()}

    def _conversations_for(self, spec: WorkloadSpec, counter: TokenCounter) -> list[Conversation]:
        if spec.prefix_tokens not in self._conversations:
            self._conversations[spec.prefix_tokens] = build_conversations(spec, counter)
        return self._conversations[spec.prefix_tokens]

    def _point(
        self,
        leg: str,
        spec: WorkloadSpec,
        convs: Sequence[Conversation],
        opts: RunOptions,
        nodes: Mapping[str, str],
    ) -> bool:
        """Run one point and write its files; False when it was interrupted."""
        self.progress.describe(f"{leg.upper()} prefix {spec.prefix_tokens}")
        pids = self._pids(leg)
        before = snapshot_nodes(nodes)
        cpu0, load0 = node_cpu(pids), load_now()
        logs0 = log_offsets((self.manifest.get("nodes") or {}).get(leg) or {})
        states: dict[str, ConversationState] = {}
        result = run_point_interruptible(
            convs, opts, leg, self.progress.advance, self.intr, states=states
        )
        cpu1, load1 = node_cpu(pids), load_now()
        logs1 = log_offsets((self.manifest.get("nodes") or {}).get(leg) or {})
        after = snapshot_nodes(nodes)
        self._reusable(states)  # after the snapshot: its /tokenize calls are not the point's
        write_point(self.out, leg, spec.prefix_tokens, result, metrics_delta(before, after))
        self.manifest["runs"].setdefault(leg, {})[str(spec.prefix_tokens)] = {
            "duration_s": round(result.duration_s, 3),
            "requests": len(result.records),
            "errors": result.errors,
            "chunks": sum(r.output_num_chunks for r in result.records),
            "interrupted": result.interrupted,
        }
        entry = self.manifest["runs"][leg][str(spec.prefix_tokens)]
        if pids:
            entry["overhead"] = point_overhead(
                cpu0, cpu1, load0, load1, result.duration_s, len(result.records)
            )
        entry["router_log"] = {n: [logs0[n], logs1[n]] for n in logs1 if n in logs0}
        write_manifest(self.out, self.manifest)
        if result.errors:
            first = next(r for r in result.records if not r.ok)
            print(
                f"warning: {leg} prefix {spec.prefix_tokens}: {result.errors} failed "
                f"requests (first: {first.error})",
                file=sys.stderr,
            )
        return not result.interrupted


def _reusable_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def parse_metrics_urls(items: Sequence[str], prog: str = "bidir-kv bench") -> list[tuple[str, str]]:
    """``--metrics-url ROLE=URL`` items as ``(role<n>, url)``, numbered per role."""
    out = []
    counts: dict[str, int] = {}
    for item in items:
        role, sep, url = item.partition("=")
        if not sep or role not in ("prefill", "decode", "router"):
            raise SystemExit(
                f"{prog}: --metrics-url {item!r}: expected prefill=URL, decode=URL or router=URL"
            )
        n = counts.get(role, 0)
        counts[role] = n + 1
        out.append((f"{role}{n}", url))
    return out
