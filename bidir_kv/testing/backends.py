"""The P/D backends the conformance scenarios run against, behind one handle.

``emulator`` (our ``bidir-kv engine`` processes), ``vllm-cpu`` (real ``vllm serve``
with NixlConnector, see ``bidir_kv.topology.vllm_cpu``), ``vllm-cpu+bidir-kv`` (the
same with our connector, ``bidir_kv.connector``, on P and D) and ``external`` (URLs) all
look the same to a scenario: a :class:`PDBackend` with a P client, a D client, the
configuration the scenario must know (block size, threshold, D's TTL, emulated
vLLM version), a way to get a non-disaggregated reference output, and the servers
beside the main pair: a P *variant* (other failure policy, feature off, no prefix cache)
or a pair of another configuration, each started once and shared
(:mod:`bidir_kv.testing.pairs`).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bidir_kv.client import Completion
from bidir_kv.config import KVTransferConfig
from bidir_kv.policy import (
    DEFAULT_KV_LEASE_DURATION,
    DEFAULT_RECOMPUTE_THRESHOLD,
)
from bidir_kv.protocol import KVTransferParams
from bidir_kv.testing.families import FAMILIES
from bidir_kv.testing.features import family_of, metric_families
from bidir_kv.testing.pairs import PairConfig, PairPool, PrefillConfig, SharedPair, kv_items
from bidir_kv.testing.pd_client import EngineClient
from bidir_kv.topology.base import (
    BackendUnavailable,
    Topology,
)
from bidir_kv.topology.vllm_source import OPTIONAL_PARAM_FIELDS

__all__ = [
    "BACKEND_CONFIG",
    "CONNECTOR_BACKEND",
    "BackendConfig",
    "PDBackend",
    "PromptFactory",
    "VariantPair",
]

CONNECTOR_BACKEND = "vllm-cpu+bidir-kv"  # real vLLM with kv_connector_module_path below

# Token ids that are ordinary tokens in both the tiny vLLM model (vocab 1024, ids
# 0-4 special) and the emulator's model (BYTE_BASE 5, vocab 1024).
TOKEN_LO, TOKEN_HI = 5, 1000


@dataclass(frozen=True)
class BackendConfig:
    """What every local backend is started with, so scenarios can rely on it."""

    block_size: int = 128  # vLLM's CPU block size; the emulator is told the same
    threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    decoder_ttl: float = 60.0  # short for the TTL scenario, long enough for a loaded CI box
    lease: int = DEFAULT_KV_LEASE_DURATION
    failure_policy: str = "fail"
    max_model_len: int = 4096
    # kv_connector_module_path: None runs vLLM's own NixlConnector
    connector_module: str | None = None

    def kv(self, role: str, engine_id: str, **extra: Any) -> KVTransferConfig:
        top: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
            "kv_load_failure_policy": extra.pop("kv_load_failure_policy", self.failure_policy),
        }
        if self.connector_module is not None:
            top["kv_connector_module_path"] = self.connector_module
        cfg: dict[str, Any] = {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": self.threshold,
            "decoder_kv_blocks_ttl": self.decoder_ttl,
            "kv_lease_duration": self.lease,
            **extra,
        }
        top["kv_connector_extra_config"] = cfg
        return KVTransferConfig.from_dict(top)


BACKEND_CONFIG = BackendConfig()
# The emulator answers in milliseconds, so its TTL can be short: the TTL scenarios wait
# about one TTL each, and real vLLM's 60 s is sized for its slow turns on 2 cores.
EMULATOR_CONFIG = replace(BACKEND_CONFIG, decoder_ttl=20.0)


class PromptFactory:
    """Token-id prompts that never share a first block with another test's prompts.

    Seeded from the test id, so a scenario sends the same prompts to every backend
    (their outputs can be compared), and a per-factory counter keeps prompts of one
    test distinct. Prefix-cache state therefore never leaks between tests.
    """

    _serial = itertools.count()

    def __init__(self, seed_text: str) -> None:
        self.rng = random.Random(seed_text)
        self.tag = next(self._serial)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]

    def prompt(self, n: int) -> list[int]:
        """A fresh prompt of ``n`` tokens (its first tokens are unique to this call)."""
        return self.tokens(n)


VariantPair = SharedPair  # the name scenarios knew a pair of their own by


@dataclass
class PDBackend:
    """A started 1P1D backend as the scenarios see it."""

    name: str
    topology: Topology
    prefill: EngineClient
    decode: EngineClient
    config: BackendConfig
    version: str  # vLLM version the backend behaves as ("0.32" or "0.33"), for reports
    same_clock: bool  # engines stamp expiry on this machine's CLOCK_MONOTONIC
    description: dict[str, Any] = field(default_factory=dict)
    # the vLLM release (vllm-cpu: the environment's; the emulator: the one it emulates;
    # external: as declared), keying expectations only (bidir_kv.testing.exemptions)
    release: str | None = None
    family: str = "dense"  # the model family (bidir_kv.testing.families)
    # the optional kv_transfer_params fields (OPTIONAL_PARAM_FIELDS) this backend's
    # params carry: the emulated or declared shape; None for a vLLM release, whose own
    # set is whatever it emits (bounded by OPTIONAL_PARAM_FIELDS)
    param_fields: frozenset[str] | None = frozenset(OPTIONAL_PARAM_FIELDS[:-1])
    registration_generation: bool = False  # vLLM: read from its connector's source
    # vLLM's CPU platform forces async scheduling off (read from its source)
    cpu_forces_sync_scheduling: bool = False
    # the servers beside the main pair, shared per configuration (None: external)
    pairs: PairPool | None = None
    _reference: EngineClient | None = None
    run_dir: Path = Path("out/conformance")
    # keys this backend's connector adds to P's and to D's params (docs/connector.md):
    # our fence (a reader's advert on P's dict, D's word on D's) and D's token chain
    p_params_extension: frozenset[str] = frozenset()
    d_params_extension: frozenset[str] = frozenset()
    _streams: bool | None = None
    _families: set[str] | None = None

    # ---- facts scenarios branch on ------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def threshold(self) -> int:
        return self.config.threshold

    @property
    def streams_params(self) -> bool:
        """Whether D puts its params on the terminal chunk of a stream (vLLM PR #40186),
        found by a probe turn on first use (:meth:`_probe_stream`)."""
        if self._streams is None:
            self._streams = self._probe_stream()
        return self._streams

    @property
    def kv_groups(self) -> int:
        """KV cache groups of the backend's model (lists of block ids in its params)."""
        return FAMILIES[self.family].kv_groups

    @property
    def has_registration_generation(self) -> bool:
        """``remote_registration_generation`` in the params (connector version 15)."""
        if self.param_fields is None:
            return self.registration_generation
        return "remote_registration_generation" in self.param_fields

    def exposes(self, metric: str) -> bool:
        """Whether P and D both export ``metric`` (a sample or family name) on
        ``/metrics``; names read once per backend (bidir_kv.testing.features)."""
        if self._families is None:
            if self.pairs is not None:
                self.pairs.use_main()  # read below without the clients' own check
            found = [
                metric_families(c.http.get("/metrics").text) for c in (self.prefill, self.decode)
            ]
            self._families = set.intersection(*found)
        return family_of(metric) in self._families

    def _probe_stream(self) -> bool:
        """One short P/D turn with a streamed D leg: did D's params come with it?"""
        prompt = PromptFactory(f"features-probe|{self.name}").prompt(self.block_size // 2 + 3)
        p = self.prefill.complete(prompt, 1, KVTransferParams.miss()).raise_for_status()
        if p.params is None:
            raise AssertionError("P returned no kv_transfer_params to the stream probe")
        return self.decode.complete(prompt, 2, p.params, stream=True).params is not None

    # ---- reference output ---------------------------------------------------------

    def reference(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        """Greedy output of a non-disaggregated run that reuses no cached KV at all.

        Runs on P without ``kv_transfer_params`` and with a fresh ``cache_salt`` (so
        no prefix-cache block, possibly filled from a pull, can be reused), unless a
        dedicated reference server is configured.
        """
        if self._reference is not None:
            return self._reference.complete(prompt, max_tokens).raise_for_status()
        salt = f"ref-{time.time_ns()}-{random.random()}"
        return self.prefill.complete(
            prompt, max_tokens, extra={"cache_salt": salt}
        ).raise_for_status()

    # ---- variants (bidir_kv/testing/pairs.py) --------------------------------------

    def _pool(self) -> PairPool:
        if self.pairs is None:
            raise BackendUnavailable(f"the {self.name} backend cannot start servers")
        return self.pairs

    @contextlib.contextmanager
    def prefill_variant(
        self, name: str, *, extra_args: Sequence[str] = (), **kv_extra: Any
    ) -> Iterator[EngineClient]:
        """A P configured differently, beside the main D: ``kv_extra`` are
        ``kv_connector_extra_config`` keys plus the top-level ``kv_load_failure_policy``;
        ``enable_prefix_caching=False`` turns P's prefix cache off (the AWS blog's
        setting); ``extra_args`` are more server arguments. Shared: the first scenario
        asking for this configuration starts it (engine id ``prefill-<name>``), later
        ones get the same server. On vllm-cpu the
        main P is paused while the variant is used (one core per server) and runs again
        when the scenario uses ``pd.prefill`` (or :meth:`reference`)."""
        prefix = bool(kv_extra.pop("enable_prefix_caching", True))
        config = PrefillConfig(kv_items(kv_extra), prefix, tuple(extra_args))
        yield self._pool().prefill(config, name)

    def pair(self, config: PairConfig) -> SharedPair:
        """The running pair of ``config``, shared with every scenario asking for the same
        configuration (started on first use). Leave it as you found it: release what D
        retains for you, or put its dicts in ``pair.held`` (the next :meth:`SharedPair.drain`
        releases them)."""
        return self._pool().pair(config)

    @contextlib.contextmanager
    def pair_variant(
        self,
        name: str,
        *,
        decode_blocks: int,
        max_model_len: int,
        prefill_kv: dict[str, Any] | None = None,
        decode_kv: dict[str, Any] | None = None,
        emulator_args: Sequence[str] = (),
        decode_prefix_caching: bool = True,
    ) -> Iterator[SharedPair]:
        """A fresh P and D of their own, nobody else's, stopped on exit: for a scenario
        that leaves the pair in a state no other may see (say why where you call it).
        Otherwise use :meth:`pair`. ``name`` says what it is for, in the logs."""
        config = PairConfig(
            decode_blocks,
            max_model_len,
            kv_items(prefill_kv),
            kv_items(decode_kv),
            tuple(emulator_args),
            decode_prefix_caching,
        )
        with self._pool().fresh(config) as pair:
            yield pair

    def close(self) -> None:
        try:
            if self.pairs is not None:
                self.pairs.close()
        finally:
            self.topology.close()


def first_params(resp: Completion) -> KVTransferParams:
    """The params of a successful response, or an assertion naming what came back."""
    resp.raise_for_status()
    if resp.params is None:
        raise AssertionError(
            f"response carried no kv_transfer_params (key present: {resp.params_present})"
        )
    return resp.params
