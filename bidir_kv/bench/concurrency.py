"""``bidir-kv bench --concurrency 1,4,16,...``: the OFF/ON sweep at each number of
concurrent conversations, up to what the topology and the client can carry.

A level ``L`` is a whole ``bench`` run (every leg over every prefix point) with ``L``
clients and ``L`` active conversations (at least ``L`` conversations), written to
``DIR/c<L>/`` as an ordinary result directory; ``DIR/concurrency.json`` lists the
levels run and the levels left out, with why. Levels above the topology's capacity
are left out, not run (:func:`level_limits`): beyond what D's KV pool holds at the
workload's longest context, or beyond ``--max-num-seqs``, more clients only queue;
beyond what the client sustains (``capacity.py``), the client, not the engines, would
set the pace. ``report DIR`` renders each level and the sweep (docs/benchmarking.md
"Concurrency sweep").
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bidir_kv.bench.capacity import measure_capacity
from bidir_kv.engine.profiles import ProfileError, load_profile
from bidir_kv.engine.settings import EngineSettings

__all__ = ["CONCURRENCY_FILE", "LevelLimits", "level_dir", "level_limits", "run_concurrency"]

CONCURRENCY_FILE = "concurrency.json"
# the client must sustain this many times the chunk rate a level's decodes stream at
CLIENT_MARGIN = 2.0


def level_dir(out: Path, level: int) -> Path:
    return out / f"c{level:03d}"


@dataclass(frozen=True)
class LevelLimits:
    """What bounds the number of concurrent conversations; None: not known here."""

    kv_conversations: int | None  # D's KV pool / tokens of one conversation at its end
    max_num_seqs: int | None
    client_streams: int | None  # streams the client sustains at the decode step's pace

    def reason(self, level: int) -> str | None:
        """Why ``level`` is beyond the topology's capacity, or None."""
        if self.kv_conversations is not None and level > self.kv_conversations:
            return (
                f"D's KV pool holds {self.kv_conversations} conversations at their longest "
                "context; more would preempt every step (a memory test, not a concurrency level)"
            )
        if self.max_num_seqs is not None and level > self.max_num_seqs:
            return f"D runs at most {self.max_num_seqs} requests (--max-num-seqs)"
        if self.client_streams is not None and level > self.client_streams:
            return (
                f"the client sustains {self.client_streams} streams at the decode step's pace "
                f"with a {CLIENT_MARGIN:g}x margin (bench --check-client)"
            )
        return None


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in extra engine flags (``--x=V`` or ``--x V``; last wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def level_limits(args: argparse.Namespace, client_chunks_per_s: float | None) -> LevelLimits:
    """The launched emulator topology's limits for the workload of ``args`` (the vllm-cpu
    and ``--url`` topologies: only the client's, their pools are not known here)."""
    if args.url or args.topology != "emulator":
        return LevelLimits(None, None, None)  # the pool and the step time are not known here
    d_args = [*args.engine_arg, *args.decode_engine_arg]
    kv = int(_flag(d_args, "--kv-capacity-tokens") or EngineSettings.default("kv_capacity_tokens"))
    seqs = int(_flag(d_args, "--max-num-seqs") or EngineSettings.default("max_num_seqs"))
    longest = max(args.prefix_tokens) + args.num_turns * (args.input_tokens + args.output_tokens)
    streams = None
    if client_chunks_per_s:
        try:
            profile = load_profile(args.profile)
        except ProfileError:
            profile = None
        for n in range(1, 4097):
            step = profile.decode_step_seconds(n) if profile is not None else 0.0
            if step <= 0 or n / step > client_chunks_per_s / CLIENT_MARGIN:
                streams = n - 1 if step > 0 else None
                break
    return LevelLimits(kv // longest, seqs, streams)


def run_concurrency(args: argparse.Namespace, run_bench: Any) -> int:
    """Run ``run_bench`` once per level that fits; 130 when interrupted, else the worst
    exit status of the levels."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    chunks = None
    if args.client_check:
        cap = measure_capacity(clients=2, log_dir=out / "logs")
        chunks = cap.chunks_per_s
    limits = level_limits(args, chunks)
    doc: dict[str, Any] = {
        "levels": [],
        "skipped": {},
        "limits": asdict(limits),
        "client_chunks_per_s": chunks,
        "argv": sys.argv[1:],
    }
    rc = 0
    for level in sorted(set(args.concurrency)):
        why = limits.reason(level)
        if why is not None:
            print(f"bench --concurrency: level {level} left out: {why}", file=sys.stderr)
            doc["skipped"][str(level)] = why
            _write(out, doc)
            continue
        sub = copy.copy(args)
        sub.concurrency = None
        sub.num_clients = level
        sub.max_active_conversations = level
        sub.num_conversations = max(args.num_conversations, level)
        sub.out = level_dir(out, level)
        sub.client_check = False  # measured once, above
        print(f"== concurrency {level}: {sub.num_conversations} conversations, {level} clients")
        code = run_bench(sub)
        doc["levels"].append({"level": level, "dir": sub.out.name, "exit": code})
        _write(out, doc)
        if code == 130:
            return 130
        rc = max(rc, code)
    if not doc["levels"]:
        print("bench --concurrency: no level fits the topology", file=sys.stderr)
        return 2
    print(f"results: {out} (levels {', '.join(str(x['level']) for x in doc['levels'])})")
    return rc


def _write(out: Path, doc: dict[str, Any]) -> None:
    tmp = out / (CONCURRENCY_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / CONCURRENCY_FILE)
