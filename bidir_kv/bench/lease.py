"""``bidir-kv bench lease``: D's memory under the renewable lease against the fixed TTL.

The same multi-turn workload with think-time gaps runs twice on emulated 1P1D +
router: once with the fixed ``decoder_kv_blocks_ttl`` only (today's behaviour: every
finished turn's KV stays on D for the TTL), once with D advertising the renewable
lease (``bidir_kv_lease_seconds``) and clients that keep a conversation alive while
the user is present and close it when done. Each user pauses between turns; during
a pause they are *present* (the client sends a keep-alive every
``--keepalive-every`` s) or *away* (nothing is sent). After the last turn a client
either closes the conversation (``DELETE``) or just leaves.

It prints, per leg, D's held KV token-seconds (the integral over the run of D's used
blocks x block size, sampled from the emulator's ``/_emulator/state``) and the hit
rate (the router's ``cache_hits`` over the turns that had a previous one; P runs
without prefix caching, so a hit is history read from D), side by side
with the lease/fixed ratio. Both legs see the same gaps (one seed). A benchmark, not a
test: numbers depend on the machine; compare within a run.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bidir_kv.client import fetch, get_json, scrape
from bidir_kv.config import KVTransferConfig
from bidir_kv.policy import scaled_cache_ttl, valid_conversation_lease
from bidir_kv.router.settings import UPSTREAM_CACHE_TTL
from bidir_kv.wire.params import LEASE_CONFIG_KEY

__all__ = ["LeaseWorkload", "LegResult", "main", "plan_conversations", "run_leg"]

SAMPLE_PERIOD = 0.1  # seconds between samples of D's used blocks


@dataclass(frozen=True)
class LeaseWorkload:
    """The workload and the two legs' knobs (defaults scaled down to run in ~2 minutes)."""

    conversations: int = 8
    turns: int = 4
    think_mean: float = 3.0  # exponential think time between turns, seconds
    think_max: float = 12.0
    present: float = 0.7  # probability a user stays (sends keep-alives) during a pause
    close: float = 0.5  # probability a client closes the conversation when done
    stagger: float = 0.5  # seconds between conversation starts
    ttl: float = 24.0  # D's decoder_kv_blocks_ttl (both legs; the lease leg's hard cap)
    lease: float = 2.0  # the lease leg's idle lease on D, seconds
    keepalive_every: float = 0.5
    max_tokens: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Pause:
    seconds: float
    present: bool


@dataclass(frozen=True)
class ConversationPlan:
    start: float
    pauses: tuple[Pause, ...]  # one per gap between turns
    closes: bool


def plan_conversations(w: LeaseWorkload) -> list[ConversationPlan]:
    """Every conversation's start, pauses and ending, from the seed (same for both legs)."""
    rng = random.Random(w.seed)
    out = []
    for i in range(w.conversations):
        pauses = tuple(
            Pause(min(w.think_max, rng.expovariate(1 / w.think_mean)), rng.random() < w.present)
            for _ in range(w.turns - 1)
        )
        out.append(ConversationPlan(i * w.stagger, pauses, rng.random() < w.close))
    return out


@dataclass
class LegResult:
    leg: str
    held_token_seconds: float = 0.0
    held_turn_seconds: float = 0.0  # the same integral over D's retained-turn count
    hits: float = 0.0
    reusable_turns: int = 0
    turns: int = 0
    errors: int = 0
    keepalives: int = 0
    closes: int = 0
    lease_expiries: float = 0.0
    seconds: float = 0.0
    misses: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.reusable_turns if self.reusable_turns else 0.0


def _post(url: str, body: dict[str, Any] | None, method: str = "POST") -> tuple[int, Any]:
    """(status, decoded body of a 2xx answer or ``None``)."""
    reply = fetch(url, method=method, json=body, timeout=120)
    return reply.status, reply.json() if reply.ok else None


class _Client(threading.Thread):
    """One user: turns, pauses (keep-alives when present, on the lease leg), ending."""

    def __init__(
        self,
        url: str,
        conv: str,
        plan: ConversationPlan,
        w: LeaseWorkload,
        lease_leg: bool,
        t0: float,
        result: LegResult,
        lock: threading.Lock,
    ) -> None:
        super().__init__(daemon=True)
        self.url, self.conv, self.plan, self.w = url, conv, plan, w
        self.lease_leg, self.t0, self.result, self.lock = lease_leg, t0, result, lock

    def run(self) -> None:
        time.sleep(max(0.0, self.t0 + self.plan.start - time.monotonic()))
        messages: list[dict[str, str]] = []
        for turn in range(self.w.turns):
            text = (
                f"Conversation {self.conv}, turn {turn}: tell me about rivers, "
                "castles and the dragons that guard them. "
            ) * 3
            messages.append({"role": "user", "content": text})
            status, obj = _post(
                self.url + "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": messages,
                    "max_tokens": self.w.max_tokens,
                    "temperature": 0,
                    "stream": False,
                    "conversation_id": self.conv,
                },
            )
            with self.lock:
                self.result.turns += 1
                self.result.errors += status != 200
            answer = obj["choices"][0]["message"]["content"] if status == 200 and obj else ""
            messages.append({"role": "assistant", "content": answer or ""})
            if turn < len(self.plan.pauses):
                self._pause(self.plan.pauses[turn])
        if self.lease_leg and self.plan.closes:
            _post(f"{self.url}/v1/conversations/{self.conv}", None, method="DELETE")
            with self.lock:
                self.result.closes += 1

    def _pause(self, pause: Pause) -> None:
        end = time.monotonic() + pause.seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.w.keepalive_every))
            if self.lease_leg and pause.present and end - time.monotonic() > 0:
                _post(f"{self.url}/v1/conversations/{self.conv}/keepalive", None)
                with self.lock:
                    self.result.keepalives += 1


def _d_state(d_url: str) -> tuple[int, int]:
    """(used blocks, retained turns) on D right now."""
    st = get_json(d_url + "/_emulator/state")
    return int(st["usable_blocks"]) - int(st["free_blocks"]), int(st["retained"])


def _integrate(
    d_url: str, block_size: int, stop: threading.Event, result: LegResult, grace: float
) -> None:
    """Integrate D's used blocks until D holds nothing after ``stop`` (at most ``grace``
    seconds after it: a block D never frees would otherwise keep it going)."""
    last = time.monotonic()
    stopped_at: float | None = None
    while True:
        used, retained = _d_state(d_url)
        now = time.monotonic()
        result.held_token_seconds += used * block_size * (now - last)
        result.held_turn_seconds += retained * (now - last)
        last = now
        if stop.is_set():
            stopped_at = now if stopped_at is None else stopped_at
            if (used == 0 and retained == 0) or now - stopped_at > grace:
                return
        time.sleep(SAMPLE_PERIOD)


def _topology_spec(w: LeaseWorkload, lease_leg: bool) -> Any:
    from bidir_kv.topology.base import EngineSpec, RouterSpec, TopologySpec

    def kv(role: str, **extra: Any) -> KVTransferConfig:
        return KVTransferConfig.from_dict(
            {
                "kv_connector": "NixlConnector",
                "kv_buffer_device": "cpu",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": True,
                    "decoder_kv_blocks_ttl": w.ttl,
                    **extra,
                },
            }
        )

    d_extra = {LEASE_CONFIG_KEY: w.lease} if lease_leg else {}
    return TopologySpec(
        # P without prefix caching: every hit is history read from D (P's own cache
        # would otherwise cover it and the hit rate would say nothing about D's KV)
        prefill=EngineSpec(kv=kv("prefill"), transport="tcp", enable_prefix_caching=False),
        decode=EngineSpec(kv=kv("decode", **d_extra), transport="tcp"),
        router=RouterSpec(
            cache_ttl=scaled_cache_ttl(w.ttl, UPSTREAM_CACHE_TTL),
            extra_args=("--lease-sweep-interval", "0.2", "--log-level", "warning"),
        ),
    )


def run_leg(w: LeaseWorkload, lease_leg: bool, run_dir: Path) -> LegResult:
    """One leg on a fresh emulated 1P1D + router; sampling ends once D holds nothing
    (the fixed leg: D's TTL after the last turn)."""
    from bidir_kv.topology.local import LocalTopology

    result = LegResult("lease" if lease_leg else "fixed TTL")
    spec = _topology_spec(w, lease_leg)
    with LocalTopology(spec, run_dir / result.leg.replace(" ", "-")) as topo:
        d_url, url = topo.decode[0].url, topo.router_url
        stop, lock = threading.Event(), threading.Lock()
        sampler = threading.Thread(
            target=_integrate,
            daemon=True,
            args=(d_url, spec.decode.block_size, stop, result, w.ttl + 10),
        )
        t0 = time.monotonic()
        sampler.start()
        clients = [
            _Client(url, f"c{i}", p, w, lease_leg, t0, result, lock)
            for i, p in enumerate(plan_conversations(w))
        ]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        stop.set()
        sampler.join()
        result.seconds = time.monotonic() - t0
        snap = scrape(url)
        result.hits = snap.value("bidir_kv_router_cache_hits_total")
        result.lease_expiries = snap.value("bidir_kv_router_lease_expiries_total")
        result.misses = {
            r: snap.value("bidir_kv_router_cache_misses_total", reason=r)
            for r in ("not_found", "stale", "guard", "not_pulled")
        }
    result.reusable_turns = w.conversations * (w.turns - 1)
    return result


def render(w: LeaseWorkload, fixed: LegResult, lease: LegResult) -> str:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    rows = [
        (
            "held KV token-seconds on D",
            f"{fixed.held_token_seconds:,.0f}",
            f"{lease.held_token_seconds:,.0f}",
            ratio(lease.held_token_seconds, fixed.held_token_seconds),
        ),
        (
            "held turn-seconds on D",
            f"{fixed.held_turn_seconds:,.1f}",
            f"{lease.held_turn_seconds:,.1f}",
            ratio(lease.held_turn_seconds, fixed.held_turn_seconds),
        ),
        (
            "hit rate",
            f"{fixed.hit_rate:.0%} ({fixed.hits:.0f}/{fixed.reusable_turns})",
            f"{lease.hit_rate:.0%} ({lease.hits:.0f}/{lease.reusable_turns})",
            ratio(lease.hit_rate, fixed.hit_rate),
        ),
        (
            "keep-alives / closes / lease expiries",
            "-",
            f"{lease.keepalives} / {lease.closes} / {lease.lease_expiries:.0f}",
            "",
        ),
        ("errors", str(fixed.errors), str(lease.errors), ""),
        ("leg wall time, s", f"{fixed.seconds:.1f}", f"{lease.seconds:.1f}", ""),
    ]
    head = (
        f"{w.conversations} conversations x {w.turns} turns, think ~Exp({w.think_mean:g} s) "
        f"<= {w.think_max:g} s, present {w.present:.0%}, close {w.close:.0%}; D TTL "
        f"{w.ttl:g} s, lease {w.lease:g} s, keep-alive every {w.keepalive_every:g} s"
    )
    lines = [head, "", "| | fixed TTL | lease | lease / fixed |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bidir-kv bench lease", description=__doc__.split("\n")[0])
    d = LeaseWorkload()
    for name, kind in (
        ("conversations", int),
        ("turns", int),
        ("think_mean", float),
        ("think_max", float),
        ("present", float),
        ("close", float),
        ("stagger", float),
        ("ttl", float),
        ("lease", float),
        ("keepalive_every", float),
        ("max_tokens", int),
        ("seed", int),
    ):
        ap.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(d, name),
            help=f"(default {getattr(d, name)})",
        )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("out/bench-lease"),
        help="run directory: node logs and result.json (default out/bench-lease)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    w = LeaseWorkload(**{k: v for k, v in vars(args).items() if k != "out"})
    if w.turns < 2 or w.conversations < 1 or not valid_conversation_lease(w.lease):
        print(
            "bidir-kv bench lease: need --turns >= 2, --conversations >= 1 and a positive --lease",
            flush=True,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    fixed = run_leg(w, False, args.out)
    lease = run_leg(w, True, args.out)
    table = render(w, fixed, lease)
    print(table)
    (args.out / "result.json").write_text(
        json.dumps(
            {"workload": asdict(w), "legs": [asdict(fixed), asdict(lease)], "table": table},
            indent=1,
        )
    )
    return 0
