"""Engine fixtures: emulated P/D pairs as real processes on loopback.

``engine_pair`` is a factory (function scope, torn down after the test);
``shared_pair`` is one long-lived bidirectional pair per module (default config),
for the many tests that only need "a working pair" and isolate themselves with
unique prompts and metric deltas. Both take a transport name (``engine_pair(transport=...)``,
``shared_pair`` as an indirect parameter); :func:`transport_names` lists those usable here.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.client import Completion
from bidir_kv.config import KVTransferConfig
from bidir_kv.policy import DEFAULT_DECODER_KV_BLOCKS_TTL, DEFAULT_RECOMPUTE_THRESHOLD
from bidir_kv.protocol import KVTransferParams
from bidir_kv.scrape import MetricsSnapshot, tokens_by_source
from bidir_kv.testing.faults import confirm_faults
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import EngineSpec, TopologySpec
from bidir_kv.topology.local import LocalTopology

__all__ = [
    "EnginePair",
    "engine_pair",
    "kv_config",
    "random_prompt",
    "shared_pair",
    "transport_names",
]


def kv_config(role: str, **extra: Any) -> KVTransferConfig:
    """A bidirectional NixlConnector config; ``extra`` overrides extra-config keys,
    ``kv_load_failure_policy`` goes top level."""
    top: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    if "kv_load_failure_policy" in extra:
        top["kv_load_failure_policy"] = extra.pop("kv_load_failure_policy")
    cfg = {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": DEFAULT_RECOMPUTE_THRESHOLD,
        "decoder_kv_blocks_ttl": DEFAULT_DECODER_KV_BLOCKS_TTL,
        **extra,
    }
    top["kv_connector_extra_config"] = cfg
    return KVTransferConfig.from_dict(top)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """Token ids in the pseudo-word range (never special tokens)."""
    from bidir_kv.engine.model import BYTE_BASE, VOCAB_SIZE

    return [rng.randrange(BYTE_BASE, VOCAB_SIZE) for _ in range(n)]


def transport_names() -> list[str]:
    """``tcp`` always; ``nixl`` when a NIXL agent can be created here."""
    from bidir_kv.engine.transport import nixl_available

    return ["tcp", "nixl"] if nixl_available()[0] else ["tcp"]


@dataclass
class EnginePair:
    """A started 1P1D topology and clients for both engines."""

    topo: LocalTopology
    p: EngineClient
    d: EngineClient
    history: list[Any] = field(default_factory=list)

    def snap(self) -> tuple[MetricsSnapshot, MetricsSnapshot]:
        return self.p.metrics(), self.d.metrics()

    def prefill(self, prompt: list[int], params: KVTransferParams | None) -> Completion:
        """P leg as the upstream proxy sends it: ``max_tokens=1``, non-streaming."""
        return self.p.complete(prompt, 1, params if params is not None else KVTransferParams.miss())

    def turn(
        self,
        prompt: list[int],
        max_tokens: int,
        previous: KVTransferParams | None = None,
        *,
        stream: bool = False,
    ) -> tuple[Completion, Completion | None]:
        """One turn of vLLM's request flow: P (miss or D's previous dict), then D."""
        sent = KVTransferParams.miss() if previous is None else previous.for_prefill_hit()
        pr = self.p.complete(prompt, 1, sent)
        if not pr.ok or pr.params is None:
            return pr, None
        return pr, self.d.complete(prompt, max_tokens, pr.params, stream=stream)

    def state(self, which: str) -> dict[str, int]:
        client = self.p if which == "p" else self.d
        out: dict[str, int] = client.http.get_json("/_emulator/state", timeout=10)
        return out

    def set_faults(self, which: str, **faults: Any) -> dict[str, Any]:
        """Set emulator faults on P or D; the node must report them set (else the test
        fails: ``fault did not take effect``)."""
        client = self.p if which == "p" else self.d
        reply = client.http.post("/_emulator/faults", faults, timeout=10)
        now = reply.raise_for_status().json_object()
        confirm_faults(client.node.name, faults, now)
        return now


def sources(delta: MetricsSnapshot) -> dict[str, int]:
    return tokens_by_source(delta)


def _start_pair(
    run_dir: Path,
    *,
    transport: str = "tcp",
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
    prefill_kv: dict[str, Any] | None = None,
    decode_kv: dict[str, Any] | None = None,
    kv: dict[str, Any] | None = None,
    peer_allowlist: bool = True,
) -> EnginePair:
    pk = {**(kv or {}), **(prefill_kv or {})}
    dk = {**(kv or {}), **(decode_kv or {})}
    pspec = EngineSpec(kv=kv_config("prefill", **pk), transport=transport, **(prefill or {}))
    dspec = EngineSpec(kv=kv_config("decode", **dk), transport=transport, **(decode or {}))
    topo = LocalTopology(
        TopologySpec(prefill=pspec, decode=dspec, routers=0, peer_allowlist=peer_allowlist), run_dir
    )
    topo.__enter__()
    return EnginePair(topo, EngineClient(topo.prefill[0]), EngineClient(topo.decode[0]))


@pytest.fixture
def engine_pair(run_dir: Path) -> Iterator[Callable[..., EnginePair]]:
    """Factory: ``engine_pair(transport=..., kv={...}, prefill={...EngineSpec fields},
    peer_allowlist=False)`` (the last: no allowlist, TopologySpec.peer_allowlist)."""
    started: list[EnginePair] = []

    def make(**kwargs: Any) -> EnginePair:
        sub = run_dir / f"pair-{len(started)}"
        pair = _start_pair(sub, **kwargs)
        started.append(pair)
        return pair

    try:
        yield make
    finally:
        for pair in started:
            with contextlib.suppress(Exception):
                pair.topo.close()


@pytest.fixture(scope="module")
def shared_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnginePair]:
    """One default bidirectional pair per module (transport from ``transport_name`` if set)."""
    transport = getattr(request, "param", None) or "tcp"
    run_dir = tmp_path_factory.mktemp("shared-pair")
    pair = _start_pair(run_dir, transport=transport)
    try:
        yield pair
    finally:
        pair.topo.close()
