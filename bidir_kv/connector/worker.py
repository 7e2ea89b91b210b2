"""The worker side: vLLM's NIXL pull worker, except that a peer whose read failed is
handshaken again.

vLLM 0.32 keeps a remote engine's NIXL agent until that engine id is replaced at its
address or its metadata is gone locally. A peer restarted with the same engine id (a
deploy, a crash and restart) matches neither: the reader keeps the dead agent and every
later read from that peer fails (docs/connector.md §3.4). Here a failed read marks the
engine invalid, and vLLM's own invalid-peer path does the rest: it releases the engine
once its reads drain (a repeat within its backoff waits longer), and the next read
handshakes afresh. A declined read is not a failure here (vLLM records it as an
expiry), so it does not invalidate the engine.
"""

from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

__all__ = ["BidirKVWorker"]


class BidirKVWorker(NixlPullConnectorWorker):
    """Adds behaviour only, no state: :class:`~bidir_kv.connector.nixl.BidirKVConnector`
    re-classes the worker vLLM built rather than build a second NIXL agent."""

    def _cleanup_remote_engines(self) -> None:
        now = time.perf_counter()
        for engine_id in self._failed_remote_engines - self._invalid_remote_engines:
            if engine_id in self._remote_agents:
                self._mark_remote_engine_invalid(engine_id, now)
        super()._cleanup_remote_engines()
