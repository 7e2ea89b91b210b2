"""vLLM's own multi-turn benchmark, unmodified, through ``bidir-kv proxy`` on an emulated
1P1D, without ``--send-conversation-id`` (history identity gives it hits) and with it
(the id path): every later turn pulls either way.

The benchmark (``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` of vLLM 0.32.0's
source distribution) is not ours and not committed: ``ci/provision.d/vllm-mt-bench.sh``
caches it with pandas, its one dependency the project's venv lacks. It sends each turn as
a chat client does (the whole history, with the model's earlier answers) and no id of any
kind. Its tokenizer is the project's tiny tokenizer. Hits are counted twice (the router's
counter and the tokens P took from D) and every answer is compared with the same
benchmark run against one engine alone (no transfer).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import scrape
from bidir_kv.paths import REPO_ROOT
from bidir_kv.testing.gating import skip_or_fail
from bidir_kv.testing.router import RouterProcess, emulated_router_topology, start_router_process
from bidir_kv.topology.vllm_cpu import cache_root

BENCH = "benchmark_serving_multi_turn.py"
PULLED = "vllm:prompt_tokens_by_source_total"
CONVERSATIONS, TURNS = 8, 5

# The benchmark imports one helper from vLLM's package, for logging its arguments with
# secrets hidden. This is our stand-in, written beside it at run time: the arguments as a
# dict, the named fields that are set replaced by a marker.
SHIM = """\
def redact_sensitive_namespace(namespace, fields):
    return {k: ("<redacted>" if k in fields and v else v) for k, v in vars(namespace).items()}
"""


def bench_dir() -> Path:
    explicit = os.environ.get("BIDIR_KV_VLLM_MT_BENCH")
    return Path(explicit) if explicit else cache_root() / "vllm-mt-bench"


@pytest.fixture(scope="module")
def bench(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cached benchmark with its ``vllm`` stand-in on its path (skip/fail if absent)."""
    where = bench_dir()
    if not (where / BENCH).is_file() or not (where / "deps" / "pandas").is_dir():
        skip_or_fail(
            request.config,
            "integration",
            f"vLLM's multi-turn benchmark not cached at {where} (ci/provision.d/vllm-mt-bench.sh)",
        )
    shim = tmp_path_factory.mktemp("vllm-shim")
    pkg = shim / "vllm" / "benchmarks" / "lib"
    pkg.mkdir(parents=True)
    for d in (shim / "vllm", shim / "vllm" / "benchmarks", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "utils.py").write_text(SHIM)
    return shim


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny HF tokenizer: ``make tokenizer``'s, else built here (a second)."""
    made = Path(os.environ.get("BIDIR_KV_TINY_TOKENIZER") or cache_root() / "tiny-tokenizer")
    if (made / "tokenizer.json").is_file():
        return made
    out = tmp_path_factory.mktemp("tokenizer") / "tiny"
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "fixtures/tiny_model.py"),
            "--tokenizer-only",
            "--out",
            str(out),
        ],
        check=True,
        timeout=120,
    )
    return out


@pytest.fixture(scope="module")
def topo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # P without prefix caching: every token it takes from D shows up as external_kv_transfer
    with emulated_router_topology(
        request.config,
        tmp_path_factory.mktemp("router-mt"),
        prefix_caching_on_p=False,
        engine_args=("--kv-guard", "off"),
    ) as t:
        yield t


def dataset(path: Path) -> Path:
    """Conversations in the benchmark's input format (ShareGPT-like, OpenAI roles)."""
    rng = random.Random("vllm-multi-turn")
    words = [
        "dragons",
        "castles",
        "rivers",
        "knights",
        "forests",
        "storms",
        "ships",
        "lanterns",
        "maps",
        "towers",
    ]
    convs = []
    for c in range(CONVERSATIONS):
        msgs = []
        for t in range(TURNS):
            n = 60 if t == 0 else 12
            msgs.append(
                {
                    "role": "user",
                    "content": f"Conversation {c}, question {t}: "
                    + " ".join(rng.choice(words) for _ in range(n)),
                }
            )
            msgs.append(
                {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(10))}
            )
        convs.append({"id": f"c{c}", "messages": msgs})
    path.write_text(json.dumps(convs))
    return path


def run_bench(
    bench: Path, tokenizer: Path, url: str, data: Path, out: Path, send_ids: bool = False
) -> list[Any]:
    """One benchmark run, as its README runs it, with or without
    ``--send-conversation-id``."""
    where = bench_dir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(where / "deps"), str(bench), str(where)]),
    }
    argv = [
        sys.executable,
        str(where / BENCH),
        "--input-file",
        str(data),
        "--model",
        str(tokenizer),
        "--served-model-name",
        "tiny",
        "--url",
        url,
        "--num-clients",
        "2",
        "--max-active-conversations",
        "4",
        "--seed",
        "1",
        "--no-early-stop",
        "--output-file",
        str(out),
    ]
    if send_ids:
        argv.append("--send-conversation-id")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    (out.parent / f"{out.stem}.log").write_text(r.stdout + r.stderr)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return list(json.loads(out.read_text()))


def answers(conversations: list[Any]) -> dict[tuple[str, int], str]:
    return {
        (c["id"], i): m["content"]
        for c in conversations
        for i, m in enumerate(c["messages"])
        if m["role"] == "assistant"
    }


@pytest.mark.parametrize(
    ("store", "send_ids"),
    [("memory", False), ("redis", False), ("memory", True), ("redis", True)],
    ids=["memory", "redis", "memory-ids", "redis-ids"],
)
def test_vllm_benchmark_later_turns_all_pull(
    request: pytest.FixtureRequest,
    bench: Path,
    tokenizer: Path,
    topo: Any,
    run_dir: Path,
    store: str,
    send_ids: bool,
) -> None:
    extra: tuple[str, ...] = ()
    if store == "redis":
        redis = request.getfixturevalue("redis_server")
        extra = ("--store", redis.url)
    router: RouterProcess = start_router_process(
        run_dir,
        [(n.host, n.port) for n in topo.prefill],
        [(n.host, n.port) for n in topo.decode],
        extra=("--health-interval", "0.5", *extra),
    )
    try:
        data = dataset(run_dir / "conversations.json")
        reference = run_bench(
            bench, tokenizer, topo.prefill[0].url, data, run_dir / "reference.json"
        )
        p0, r0 = scrape(topo.prefill[0].url), scrape(router.url)
        routed = run_bench(
            bench, tokenizer, router.url, data, run_dir / "routed.json", send_ids=send_ids
        )
        dp, dr = scrape(topo.prefill[0].url) - p0, scrape(router.url) - r0
    finally:
        router.proc.stop()

    requests = dr.value("bidir_kv_router_requests_total", endpoint="chat/completions")
    # a first turn misses: with no id it has no history yet (no_history), with an id its
    # id names no entry yet (not_found); a later turn that missed would push this count
    # above the number of conversations
    first = "not_found" if send_ids else "no_history"
    first_turns = dr.value("bidir_kv_router_cache_misses_total", reason=first)
    later = requests - first_turns
    hits = dr.value("bidir_kv_router_cache_hits_total")
    assert len(routed) <= first_turns <= CONVERSATIONS, (requests, first_turns)
    assert later >= 3 * len(routed), (requests, first_turns)
    assert hits >= 0.99 * later, f"{hits} hits on {later} turns >= 2"
    # the router's count agrees with what P took from D
    took = dp.value(PULLED, source="external_kv_transfer")
    assert took > 0 and took == dr.value("bidir_kv_router_cache_hit_tokens_total")

    want, got = answers(reference), answers(routed)
    compared = set(want) & set(got)
    print(
        f"{store}{' --send-conversation-id' if send_ids else ''}: {requests:g} requests, "
        f"{hits:g} hits of {later:g} turns >= 2, "
        f"{took:g} tokens pulled, {len(compared)} answers compared"
    )
    # the benchmark writes only the conversations that finished (its clients stop once
    # they run out of conversations, e.g. 6 of 8), and which ones finish depends on
    # timing: every answer of every conversation both runs finished is compared
    both = {cid for cid, _ in want} & {cid for cid, _ in got}
    assert both, "no conversation finished in both the reference and the routed run"
    assert len(compared) == len(both) * TURNS, (len(compared), sorted(both))
    wrong = [k for k in sorted(compared) if want[k] != got[k]]
    assert wrong == [], f"answers differ from the reference engine's: {wrong}"
