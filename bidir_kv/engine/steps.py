"""The step loop: admission, one compute resource, sampling, emitting and finishing.

Scheduled as vLLM V1 schedules (docs/engine.md "Scheduling"): one step spends a
token budget (``max_num_batched_tokens``) on the running requests in order, decode
tokens and prefill chunks alike, and takes as long as the cost profile says. With
chunked prefill off a prefill runs whole or waits for a step with room. A pull's
completion is seen at the next step boundary (as vLLM's scheduler sees a
connector's ``finished_recving`` only with a step's output), and the rest of that
prefill is computed in a later step. Admission takes the local prefix-cache hit
and the blocks of the tokens it computes now; a decoding request takes a block
each time its sequence crosses into a new one, and when none is free the latest
running request is preempted and recomputed later (vLLM V1's recompute preemption,
docs/engine.md "Memory"). The reader decides whether the request pulls first, the
owner what happens to its blocks when it finishes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable

from bidir_kv.engine.chains import ChainMemo
from bidir_kv.engine.compute import ModelRunner
from bidir_kv.engine.kvcache import BlockManager, NoFreeBlocks
from bidir_kv.engine.metrics import EngineMetrics
from bidir_kv.engine.model import EOS, VOCAB_SIZE, WORD_BASE
from bidir_kv.engine.owner import HandleOwner
from bidir_kv.engine.reader import PullReader
from bidir_kv.engine.request import Request, RequestError
from bidir_kv.engine.sampling import Vocab
from bidir_kv.engine.settings import EngineSettings
from bidir_kv.policy import blocks_for_tokens, max_prefix_hit_blocks

__all__ = ["StepLoop"]

logger = logging.getLogger("bidir_kv.engine")
# a step that starts at most this late after the previous one's modelled end continues
# its timeline (the loop's own wake-up and emitting made it late); a later start (a pause
# of the process) is not made up
_CATCH_UP_S = 0.005
_BUILTIN_VOCAB = Vocab(range(WORD_BASE, VOCAB_SIZE), EOS)


class StepLoop:
    """Waiting and running requests, driven by one asyncio task (:meth:`run`)."""

    def __init__(
        self,
        settings: EngineSettings,
        blocks: BlockManager,
        runner: ModelRunner,
        metrics: EngineMetrics,
        *,
        reader: PullReader,
        owner: HandleOwner,
    ) -> None:
        self.settings = settings
        self.blocks = blocks
        self.runner = runner
        self.metrics = metrics
        self.reader = reader
        self.owner = owner
        self.faults = settings.faults
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wake = asyncio.Event()
        self.requests_seen = 0
        self.num_steps = 0  # steps that computed tokens (vllm:iteration_tokens_total count)
        self._received: list[Callable[[], None]] = []  # pulls over, taken at the next step
        self.heartbeat = time.perf_counter()  # last time the loop made progress
        self.chains = ChainMemo(settings.block_size)  # prompt chains reuse earlier turns'
        # modelled end of the last step; None: the engine went idle since (the next step's
        # timeline starts when it does)
        self._step_end: float | None = None

    # ---- submission ----------------------------------------------------------------

    def new_request_id(self, prefix: str, base: str | None) -> str:
        return f"{prefix}-{base or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}"

    def submit(self, req: Request) -> Request:
        """Validate and queue a request (raises :class:`RequestError` for a 400)."""
        self.requests_seen += 1
        if self.faults.exit_on_request and self.requests_seen >= self.faults.exit_on_request:
            logger.error("fault exit_on_request=%d: exiting", self.faults.exit_on_request)
            os._exit(3)
        n = req.prompt_len
        max_len = self.settings.max_model_len
        if n == 0:
            raise RequestError(400, "The prompt is empty; at least one token is required.")
        if n + req.max_tokens > max_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_len} tokens. "
                f"However, you requested {n + req.max_tokens} tokens ({n} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )
        need = self._all_groups(blocks_for_tokens(req.max_kv_slots, self.settings.block_size))
        if need > self.blocks.num_usable_blocks:
            raise RequestError(
                400,
                f"request needs {need} KV blocks but the engine holds only "
                f"{self.blocks.num_usable_blocks} (--kv-capacity-tokens)",
            )
        req.tokens = list(req.prompt)
        req.block_chain = self.chains.chain(req.prompt, req.chain_root)
        self.waiting.append(req)
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))
        self.wake.set()
        return req

    def abort(self, req: Request) -> None:
        """The client went away: finish as ``abort`` (no retention, no params)."""
        if req.state == "finished":
            return
        if req.state == "remote":
            req.abort_pending = True  # the READ still targets its blocks; finish after it
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, "abort")

    def expire_waiting(self, now: float) -> int:
        """Fail requests queued longer than ``max_waiting_seconds`` with HTTP 503."""
        bound = self.settings.max_waiting_seconds
        if bound <= 0 or not self.waiting:
            return 0
        # a preempted request has streamed tokens already: it waits without a bound, as
        # on vLLM, instead of failing mid-answer
        late = [r for r in self.waiting if not r.num_preemptions and now - r.arrival >= bound]
        if not late:
            return 0
        why = self._waiting_reason(late[0])
        for req in late:
            self.waiting.remove(req)
            logger.warning(
                "Request %s waited %.1f s for %s; failing it",
                req.request_id,
                now - req.arrival,
                why,
            )
            req.error = RequestError(
                503,
                f"request waited {now - req.arrival:.1f} s for {why} and was given up "
                f"(--max-waiting-seconds {bound:g}); retry later or on another engine",
            )
            self.finish(req, "error")
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))
        return len(late)

    def _waiting_reason(self, req: Request) -> str:
        if len(self.running) + self.reader.num_pulling >= self.settings.max_num_seqs:
            return f"a sequence slot ({self.settings.max_num_seqs} busy, --max-num-seqs)"
        need = self._all_groups(blocks_for_tokens(req.prefill_len, self.settings.block_size))
        held = self.owner.held()
        return (
            f"KV blocks ({need} needed, {self.blocks.num_free} free of "
            f"{self.blocks.num_usable_blocks}; {held['retained']} retained and "
            f"{held['leased']} leased turns hold the rest)"
        )

    # ---- admission -----------------------------------------------------------------

    def _admit(self) -> None:
        bs = self.settings.block_size
        while (
            self.waiting
            and len(self.running) + self.reader.num_pulling < self.settings.max_num_seqs
        ):
            req = self.waiting[0]
            n = req.prefill_len
            hit_blocks = self.blocks.lookup(req.block_chain[: max_prefix_hit_blocks(n, bs)])
            # vLLM allocates the slots of the tokens it computes now (the prompt, or all
            # tokens of a preempted request); decode slots come one block at a time
            total = blocks_for_tokens(n, bs)
            self.blocks.touch(hit_blocks)
            own = total - len(hit_blocks)
            fresh = self._allocate(own + self._all_groups(total) - total)
            if fresh is None:
                self.blocks.free(hit_blocks)
                return  # head-of-line waits for retained/leased blocks to be released
            self.waiting.popleft()
            req.blocks = [*hit_blocks, *fresh[:own]]
            if self.runner.groups is not None:  # the other KV cache groups' tables
                self.runner.groups.assign(req, fresh[own:])
            req.num_cached_blocks = len(hit_blocks)
            hit = len(hit_blocks) * bs
            req.num_computed = hit
            if req.num_preemptions:
                self._resume(req)  # computes locally: its pull (if any) is long over
                continue
            req.cached_tokens = hit
            self.metrics.prefix_cache(n, hit)
            if not self.reader.begin(req, hit):
                self.run_locally(req, hit, external=0)
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))

    def _all_groups(self, per_group: int) -> int:
        """Blocks a request reserves over every KV cache group (engine/groups.py)."""
        groups = self.runner.groups
        return per_group if groups is None else groups.blocks_for(per_group)

    def _allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, evicting retained turns first if needed; None: wait."""
        if count > self.blocks.num_free:
            self.owner.evict_for(count)
        try:
            return self.blocks.allocate(count)
        except NoFreeBlocks:
            return None

    def run_locally(self, req: Request, hit: int, external: int) -> None:
        """Start computing: ``hit`` tokens came from our cache, ``external`` from a pull."""
        n = req.prompt_len
        self.metrics.by_source(n - hit - external, hit, external)
        self.metrics.inc(self.metrics.prompt_tokens, n)
        self.metrics.external_hit(external)
        req.external_tokens = external
        req.state = "running"
        self.running.append(req)
        self.wake.set()

    def _resume(self, req: Request) -> None:
        """A preempted request admitted again: it recomputes what its blocks held."""
        req.state = "running"
        self.running.append(req)
        self.wake.set()

    # ---- memory: decode growth and recompute preemption -----------------------------

    def _grow(self, req: Request) -> bool:
        """The block the decode step writes ``req``'s next slot into; when none is free,
        preempt the latest running request until one is (vLLM V1, FCFS: ``running[-1]``,
        possibly ``req`` itself). False when ``req`` was preempted.

        Retained turns are not given up here: a running request's growth is the vLLM
        scheduler's decision, which no connector takes part in (pressure release acts
        when a waiting request is admitted, ``_allocate``; docs/engine.md "Memory")."""
        need = blocks_for_tokens(req.num_computed + 1, self.settings.block_size) - len(req.blocks)
        count = self._all_groups(need)  # a block in every KV cache group's table
        while need > 0:
            if count <= self.blocks.num_free:
                fresh = self.blocks.allocate(count)
                req.blocks.extend(fresh[:need])
                if self.runner.groups is not None:
                    self.runner.groups.extend(req, fresh[need:])
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block of ``req`` (full ones stay in the prefix
        cache, so its recompute may hit them) and put it first in the waiting queue; it
        will compute all its tokens again (``Request.prefill_len``) and then go on
        sampling where it stopped. Its tokens already streamed stay streamed."""
        self.running.remove(req)
        self.blocks.free(req.blocks)
        if self.runner.groups is not None:
            self.runner.groups.drop(req)
        req.blocks = []
        req.resume_tokens = len(req.tokens)
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.reset_slot_hashes()
        req.reset_kv_digest()
        req.prefill_started = False
        req.external_tokens = 0  # the recompute pulls nothing: no pull work to charge
        req.num_preemptions += 1
        req.state = "waiting"
        self.waiting.appendleft(req)
        self.metrics.inc(self.metrics.preemptions)
        logger.debug(
            "Preempted request %s (%d tokens to recompute, preemption %d)",
            req.request_id,
            req.resume_tokens,
            req.num_preemptions,
        )

    # ---- steps ---------------------------------------------------------------------

    def received(self, resolve: Callable[[], None]) -> None:
        """A pull ended (the reader's ``resolve`` hands the request back).

        As vLLM's scheduler learns of a finished receive only from a step's output,
        the request rejoins when the step in flight is over, and its remaining prefill
        is computed in the next step (an idle engine takes it at once)."""
        self._received.append(resolve)
        self.wake.set()

    @property
    def num_received(self) -> int:
        return len(self._received)

    async def run(self) -> None:
        while True:
            await self.iterate()

    async def iterate(self) -> None:
        """One turn of the loop: take back finished pulls, admit, then one step (or
        wait for work)."""
        self.heartbeat = time.perf_counter()
        done, self._received = self._received, []
        for resolve in done:
            resolve()
        self._admit()
        if not self.running:
            self._step_end = None
            self.wake.clear()
            if not self._received:
                await self.wake.wait()
            return
        while self.faults.stall:
            await asyncio.sleep(0.05)
        await self._step()

    def stalled_for(self, now: float) -> float:
        """Seconds running work has waited for the loop (0 when idle or progressing)."""
        if not self.running:
            return 0.0
        return max(0.0, now - self.heartbeat)

    async def _step(self) -> None:
        """One step, lasting what the profile says from where the previous step ended.

        A real engine's steps follow each other on the device; here the loop's own work
        between steps (waking from the sleep, emitting, admitting) and the event loop's
        millisecond timer make each step start a little late. Steps are therefore paced
        against the previous step's modelled end, not against their own start, so a
        decode's inter-token latency is the profile's instead of the profile's plus the
        loop's overhead (docs/engine.md "Scheduling")."""
        t0 = time.perf_counter()
        start = t0 if self._step_end is None else max(self._step_end, t0 - _CATCH_UP_S)
        budget = self.settings.effective_max_num_batched_tokens
        emitted: list[tuple[Request, int]] = []
        decodes = [r for r in self.running if r.num_computed >= r.prefill_len]
        # in running order: a growth preempts only itself or a later request (running[-1])
        decodes = [r for r in decodes if r.state == "running" and self._grow(r)]
        for r in decodes:
            if budget <= 0:
                break
            budget -= 1
            self.runner.compute(r, r.num_computed, r.num_computed + 1)
            emitted.append((r, self._sample(r)))
        prefill_tokens, modelled = self._prefill_chunks(budget, emitted)
        modelled += self.settings.profile.decode_step_seconds(len(decodes))
        end = start + modelled + self.faults.stall_seconds
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        self._step_end = end
        if prefill_tokens or decodes:
            self.num_steps += 1
            self.metrics.iteration_tokens.labels(**self.metrics.labels).observe(
                prefill_tokens + len(decodes)
            )
        for r, tok in emitted:
            self._emit(r, tok)
        self.metrics.running.labels(**self.metrics.labels).set(len(self.running))
        self.metrics.waiting.labels(**self.metrics.labels).set(len(self.waiting))

    def _prefill_chunks(self, budget: int, emitted: list[tuple[Request, int]]) -> tuple[int, float]:
        """Spend what the decodes left on prefills, in running order (vLLM V1: running
        requests first, then waiting ones in the budget left, a prefill that does not
        fit chunked to it); returns the tokens computed and their modelled seconds.

        Each chunk is priced at its own request's context, so a step that finishes
        one prompt and starts another charges the second's attention from 0, not
        from the first's context; a request's per-request costs (the fixed part, P's
        work on the tokens it pulled) are charged in its first prefill step."""
        profile = self.settings.profile
        prefill_tokens = 0
        seconds = 0.0
        chunked = self.settings.enable_chunked_prefill
        for r in self.running:
            if budget <= 0:
                break
            left = r.prefill_len - r.num_computed
            if left <= 0:
                continue
            if not chunked and left > budget:
                break  # vLLM stops scheduling here: the prefill waits for a fuller budget
            chunk = min(budget, left)
            seconds += profile.prefill_seconds(chunk, r.num_computed)
            if not r.prefill_started:
                r.prefill_started = True
                if not r.is_d_node:
                    seconds += profile.prefill_fixed_seconds()
                    seconds += profile.pull_after_seconds(r.external_tokens)
            self.runner.compute(r, r.num_computed, r.num_computed + chunk)
            budget -= chunk
            prefill_tokens += chunk
            if r.num_computed >= r.prefill_len:
                emitted.append((r, self._sample(r)))
        return prefill_tokens, seconds

    def _sample(self, req: Request) -> int:
        """The model's choice under the request's rules: no end before ``min_tokens``
        (and never at the first token), no stop token id before ``min_tokens``."""
        vocab = req.vocab or _BUILTIN_VOCAB
        n = len(req.output)
        return int(
            vocab.choose(
                self.runner.sample(req),
                may_end=n >= max(1, req.min_tokens) and not req.ignore_eos,
                banned=req.stop_token_ids if n < req.min_tokens else frozenset(),
                salt=req.tokens[-1] + n,
            )
        )

    def _emit(self, req: Request, tok: int) -> None:
        if req.state == "finished":
            return
        now = time.perf_counter()
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.labels(**self.metrics.labels).observe(now - req.arrival)
        elif req.last_token_time is not None:
            self.metrics.itl.labels(**self.metrics.labels).observe(now - req.last_token_time)
        req.last_token_time = now
        req.output.append(tok)
        req.tokens.append(tok)
        self.metrics.inc(self.metrics.generation_tokens)
        eos = (req.vocab or _BUILTIN_VOCAB).eos_id
        stop = tok in req.stop_token_ids or (tok == eos and not req.ignore_eos)
        if stop and tok != eos:
            req.stop_reason = tok
        if req.text is not None:
            if stop and not req.include_stop_str:
                req.text.pieces.append("")  # vLLM: the stop token's text is not output
            elif req.text.push(tok, check_stops=len(req.output) >= req.min_tokens):
                stop, req.stop_reason = True, req.text.matched
        req.events.put_nowait(tok)
        if stop:
            self.finish(req, "stop")
        elif len(req.output) >= req.max_tokens or len(req.tokens) >= self.settings.max_model_len:
            self.finish(req, "length")

    def finish(self, req: Request, reason: str) -> None:
        """End a request; the owner decides whether its blocks stay for a peer."""
        if req.state == "finished":
            return
        if req in self.running:
            self.running.remove(req)
        state_before = req.state
        req.state = "finished"
        req.finish_reason = reason
        if req.text is not None:
            req.text.finish()
        self.metrics.inc(self.metrics.request_success, finished_reason=reason)
        self.metrics.e2e.labels(**self.metrics.labels).observe(time.perf_counter() - req.arrival)
        if len(req.output) > 1 and req.first_token_time is not None and req.last_token_time:
            decode = req.last_token_time - req.first_token_time
            self.metrics.tpot.labels(**self.metrics.labels).observe(decode / (len(req.output) - 1))
        self.chains.remember(req.tokens, req.block_chain, req.chain_root)
        if state_before == "waiting" or not req.blocks:
            req.blocks = []
        else:
            self.owner.release_or_retain(req, reason)
        req.events.put_nowait(None)
        req.done.set()
        self.wake.set()
