"""The P leg: tokenize for the guard, prefill with ``max_tokens=1``, retry as a miss.

P gets the miss dict, or D's cached dict for a hit (non-streaming), and answers
with the dict D needs to pull P's blocks. A hit that fails is retried as a miss
(on the same P, or another one if this one is unreachable): reuse is an
optimisation, so its failure must not become the client's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp

from bidir_kv.protocol import KVTransferParams, ProtocolError, params_from_response
from bidir_kv.router.failures import Cause, Leg, UpstreamFailure, failure_label
from bidir_kv.router.metrics import RouterMetrics
from bidir_kv.router.settings import RouterSettings
from bidir_kv.router.turn import TurnState
from bidir_kv.router.upstreams import Upstream, UpstreamPool

__all__ = ["PrefillLeg", "prompt_ids_of", "pulled_tokens"]

log = logging.getLogger("bidir_kv.router")

_P_LEG_DROP = ("max_completion_tokens", "min_tokens", "stream_options")
_COMPLETION_TOKENIZE_KEYS: tuple[str, ...] = ("add_special_tokens",)
_CHAT_TOKENIZE_KEYS: tuple[str, ...] = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)


class PrefillLeg:
    """Calls to the prefill pool on behalf of one router."""

    def __init__(
        self,
        pool: UpstreamPool,
        session: aiohttp.ClientSession,
        settings: RouterSettings,
        metrics: RouterMetrics,
    ) -> None:
        self.pool = pool
        self.session = session
        self.settings = settings
        self.metrics = metrics

    # ---- /tokenize ------------------------------------------------------------

    async def tokenize(self, turn: TurnState, node: Upstream, timed: bool = True) -> list[int]:
        """P's token ids of this turn's prompt (what the guard compares with D's sequence)."""
        prompt = turn.body.get("prompt")
        if (
            turn.endpoint == "completions"
            and isinstance(prompt, list)
            and all(isinstance(t, int) for t in prompt)
        ):
            return list(prompt)  # the client sent token ids: nothing to ask P
        req = _tokenize_request(turn)
        t = time.perf_counter()
        try:
            async with self.session.post(
                f"{node.url}/tokenize",
                json=req,
                headers=turn.headers,
                timeout=aiohttp.ClientTimeout(total=self.settings.prefill_timeout),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise UpstreamFailure(
                        Cause.HTTP, f"/tokenize returned {resp.status}", resp.status, raw
                    )
        except TimeoutError:  # before OSError: TimeoutError is one
            raise UpstreamFailure(Cause.TIMEOUT, f"/tokenize on {node.id} timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailure(Cause.UNREACHABLE, f"/tokenize on {node.id}: {exc}") from None
        finally:
            if timed:
                turn.upstream += time.perf_counter() - t
        try:
            tokens = json.loads(raw)["tokens"]
            if not all(isinstance(x, int) for x in tokens):
                raise TypeError("non-integer token")
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamFailure(Cause.BAD_RESPONSE, f"/tokenize answer unusable: {exc}") from None
        return list(tokens)

    # ---- the prefill itself -----------------------------------------------------

    async def run_with_fallback(
        self,
        turn: TurnState,
        node: Upstream,
        hit: KVTransferParams | None,
        release: KVTransferParams | None,
    ) -> tuple[Upstream, KVTransferParams | None]:
        """Prefill with the hit (or release) dict; on failure, once more as a miss."""
        first = hit or release or KVTransferParams.miss()
        try:
            return node, await self.run(turn, node, first)
        except UpstreamFailure as exc:
            if exc.unreachable:
                node.mark(False, str(exc))
            if hit is None and release is None and not exc.unreachable:
                raise  # a miss that failed: not caused by reuse, the client sees it
            retry = self.pool.pick(
                None if exc.unreachable else node.id,
                exclude=node if exc.unreachable else None,
                pair=node,  # a P of the same block size fits the chosen D
            )
            if retry is None:
                raise
            self.metrics.fallbacks.labels(failure_label(Leg.PREFILL, exc.cause)).inc()
            if hit is not None or release is not None:
                self.metrics.misses.labels("fallback").inc()
            turn.fell_back = True
            log.warning(
                "[%s] conv=%s: P leg failed on %s (%s); retrying as a miss on %s",
                turn.rid,
                turn.conv,
                node.id,
                exc,
                retry.id,
            )
            return retry, await self.run(turn, retry, KVTransferParams.miss())

    async def run(
        self, turn: TurnState, node: Upstream, params: KVTransferParams
    ) -> KVTransferParams | None:
        """One prefill on ``node``; P's answer dict (``None`` if it sent none)."""
        body = dict(turn.body)
        for k in _P_LEG_DROP:
            body.pop(k, None)
        body["stream"] = False
        body["max_tokens"] = 1
        body["kv_transfer_params"] = params.to_dict()
        if turn.wants_ids and turn.prompt_tokens is None:
            body["return_token_ids"] = True  # P's prompt ids record D's prompt for the guard
        raw = await self._post(turn, node, body)
        try:
            out = json.loads(raw)
            if not isinstance(out, dict):
                return None
            usage = out.get("usage")
            turn.p_usage = usage if isinstance(usage, dict) else None
            if turn.prompt_tokens is None and turn.wants_ids:
                turn.prompt_tokens = prompt_ids_of(out)
            return params_from_response(out)
        except (ValueError, ProtocolError) as exc:
            raise UpstreamFailure(
                Cause.BAD_RESPONSE, f"P {node.id} answer unusable: {exc}"
            ) from None

    async def _post(self, turn: TurnState, node: Upstream, body: dict[str, Any]) -> bytes:
        timeout = self.settings.prefill_timeout
        t = time.perf_counter()
        node.inflight += 1
        outcome = "error"
        try:
            async with self.session.post(
                f"{node.url}/v1/{turn.endpoint}",
                data=json.dumps(body),
                headers=turn.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                raw = await resp.read()
                if resp.status // 100 != 2:
                    raise UpstreamFailure(
                        Cause.HTTP, f"P {node.id} returned HTTP {resp.status}", resp.status, raw
                    )
            outcome = "ok"
        except TimeoutError:  # before OSError: TimeoutError is one
            raise UpstreamFailure(
                Cause.TIMEOUT, f"P {node.id} timed out after {timeout:g}s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamFailure(Cause.UNREACHABLE, f"P {node.id}: {exc}") from None
        finally:
            node.inflight -= 1
            dt = time.perf_counter() - t
            turn.upstream += dt
            self.metrics.prefill_duration.labels(outcome).observe(dt)
        log.info("[%s] Prefill done in %.0fms", turn.rid, dt * 1000)
        return raw


def _tokenize_request(turn: TurnState) -> dict[str, Any]:
    """The ``/tokenize`` body that reproduces this turn's prompt on P."""
    body = turn.body
    if turn.endpoint == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise UpstreamFailure(Cause.UNSUPPORTED, "only single prompts can be verified")
        req: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
        keys = _COMPLETION_TOKENIZE_KEYS
    else:
        req = {"model": body.get("model"), "messages": body.get("messages")}
        keys = _CHAT_TOKENIZE_KEYS
    for k in keys:
        if k in body:
            req[k] = body[k]
    return req


def prompt_ids_of(body: dict[str, Any]) -> list[int] | None:
    """``prompt_token_ids`` of a non-streaming answer (chat: top level; completions: choice)."""
    ids = body.get("prompt_token_ids")
    if ids is None:
        choices = body.get("choices") or []
        if choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
    if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return list(ids)
    return None


def pulled_tokens(
    hit: KVTransferParams, usage: dict[str, Any] | None, p_trims: bool = False
) -> int | None:
    """Tokens P took from D's hit, judged from P's ``usage``: its cached tokens when they
    cover the offered prefix (a pull, or P already had it), else 0 (P skipped the pull:
    below its threshold, declined, failed). With ``p_trims`` (D's whole dict went to a P
    that reads only the prefix D's chain proves) any cached tokens count: P cut the offer.
    ``None``: P reported no ``prompt_tokens_details`` (vLLM without
    ``--enable-prompt-tokens-details``)."""
    details = (usage or {}).get("prompt_tokens_details")
    if not isinstance(details, dict) or not isinstance(details.get("cached_tokens"), int):
        return None
    cached = int(details["cached_tokens"])
    prompt = (usage or {}).get("prompt_tokens")
    offered = hit.num_remote_tokens
    if isinstance(prompt, int):
        offered = min(offered, prompt)
    if p_trims:
        return cached
    return cached if offered > 0 and cached >= offered else 0
