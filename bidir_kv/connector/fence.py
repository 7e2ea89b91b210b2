"""The fence as our connector's scheduler holds it, and what it tells its worker each step.

Pure (no vLLM), so it is unit-tested anywhere. The slots, values and config keys are
:mod:`bidir_kv.wire.fence`'s and the budget's choice of turns is
:func:`bidir_kv.policy.retention_budget_releases`, both shared with the emulator; this
module keeps the connector's own state: which turns D retains (oldest first, with their
blocks), which it is releasing, which reads P must check, and the orders for the worker.
The words themselves live in the worker's registered memory
(:mod:`bidir_kv.connector.worker`); the scheduler sends them as one :class:`FenceMeta`
per step (docs/connector.md §5.4).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bidir_kv.policy import retention_budget_releases
from bidir_kv.wire import fence as wire

__all__ = ["FenceMeta", "SchedulerFence", "WordCheck"]

# A child of vLLM's "vllm" logger (docs/connector.md §1), as in nixl.py.
log = logging.getLogger("vllm.bidir_kv.connector")

_WHY = {
    "budget": "over the retention budget",
    "fault": "fault injection",
    "pressure": "a request is waiting for KV blocks",
}


@dataclass(frozen=True, slots=True)
class WordCheck:
    """P: D's word a readback must still find after its block READ."""

    slot: int
    gen: int
    base: int  # the address of D's word table (D put it in its dict)
    engine: str  # D's engine id: whose NIXL agent to READ from


@dataclass(frozen=True, slots=True)
class FenceMeta:
    """The scheduler's fence orders for one step, read by the worker's ``start_load_kv``."""

    # D: exported turn -> (slot, gen) to write before the step's forward pass
    writes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # D: turns released early: bump their words, report them once as done sending
    release: frozenset[str] = frozenset()
    # P: readback -> the word to READ once its block READ is done
    checks: Mapping[str, WordCheck] = field(default_factory=dict)
    # D, fault injection only: released turn -> block ids to overwrite
    scribble: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class SchedulerFence:
    """The scheduler's side of the fence and the retention budget, for D and for P.

    Built once per scheduler from ``kv_connector_extra_config``: a bad value is one
    warning and stock behaviour. ``enabled`` turns off for good when the worker reports
    that its words are not registered (or it runs more than one worker)."""

    def __init__(
        self,
        extra: Mapping[str, Any] | None,
        *,
        bidirectional: bool,
        total_blocks: int,
        slots: int = wire.FENCE_SLOTS,
    ) -> None:
        config = wire.FenceConfig.from_extra(extra)
        for problem in config.problems:
            log.warning("bidir-kv: %s.", problem)
        self.enabled = config.fence and bidirectional
        self.budget = config.budget
        self.total_blocks = total_blocks
        self.base: int | None = None  # D: our worker's word table, learnt at the handshake
        self.reads = False  # P: our worker can READ a peer's word, so P advertises
        self.num_released_early = {"budget": 0, "pressure": 0, "fault": 0}
        self._slots = wire.FenceSlots(slots)
        self._held: OrderedDict[str, frozenset[int]] = OrderedDict()  # retained, oldest first
        self._releasing: set[str] = set()  # released early, not yet reported done sending
        self._asked: set[str] = set()  # asked about, not yet allocated (pressure)
        self._stock_readers: set[Any] = set()  # engines whose prefill did not advertise
        self._writes: dict[str, tuple[int, int]] = {}
        self._to_release: set[str] = set()
        self._checks: dict[str, WordCheck] = {}
        self._scribble: dict[str, tuple[int, ...]] = {}
        extra = extra or {}
        self.fault_release = extra.get(wire.FAULT_RELEASE_CONFIG_KEY, False) is True
        if self.fault_release and self.enabled:
            log.warning(
                "bidir-kv: fault injection %s: every fenced turn is released and "
                "overwritten right after it is exported.",
                wire.FAULT_RELEASE_CONFIG_KEY,
            )

    # ---- the handshake ----------------------------------------------------------------

    def worker_ready(self, bases: Sequence[int | None]) -> None:
        """What the workers said on their handshake payloads: the address of each one's
        registered word table (``None``: not registered)."""
        if not self.enabled:
            return
        if len(bases) == 1 and bases[0] is not None:
            self.base = bases[0]
            self.reads = True
            return
        log.warning(
            "bidir-kv: the fence is off: %s; retained turns are kept until P's "
            "notification or the TTL (stock behaviour).",
            "it runs with one worker (TP 1) only"
            if len(bases) != 1
            else "the fence words could not be registered",
        )
        self.enabled = False

    # ---- P: the advert and the checks -----------------------------------------------------

    def advert(self) -> dict[str, Any] | None:
        """What P adds to the dict it hands on with its prefill (``None``: nothing)."""
        return wire.reader_advert() if self.reads else None

    def check_after_read(self, request_id: str, params: Mapping[str, Any]) -> None:
        """P is about to read D's blocks for ``request_id``: have the worker check D's
        word afterwards, when D exported one (an unfenced D is read as stock vLLM reads)."""
        if not self.reads:
            return
        word, base = wire.word_of(params), wire.word_base(params)
        if word is not None and base is not None:
            self._checks[request_id] = WordCheck(*word, base, str(params["remote_engine_id"]))

    # ---- D: retained turns ------------------------------------------------------------

    def retain(
        self, request_id: str, params: Mapping[str, Any] | None, block_ids: Sequence[Iterable[int]]
    ) -> dict[str, Any] | None:
        """D retains a finished turn (``params``: the dict its prefill came with): the
        value to add under :data:`~bidir_kv.wire.fence.FENCE_KEY` to its D dict when its
        reader advertised the fence (``None``: unfenced); then hold the budget."""
        if not self.enabled:
            return None
        params = params or {}
        # block 0 is vLLM's null block (padding in sliding-window groups), never a turn's
        blocks = frozenset(b for group in block_ids for b in group if b)
        self._held[request_id] = blocks
        word = None
        if self.base is not None and wire.advertises_fence(params):
            word = self._slots.export(request_id)
        elif params.get("remote_engine_id") not in self._stock_readers:
            self._stock_readers.add(params.get("remote_engine_id"))
            log.info(
                "bidir-kv: turns prefilled by engine %s are not fenced (its dict does "
                "not advertise the fence); they are kept until its notification or the "
                "TTL, as vLLM keeps them (logged once per engine).",
                params.get("remote_engine_id"),
            )
        if word is not None:
            self._writes[request_id] = word
            if self.fault_release:  # the reader finds the turn released and reused
                first = next(iter(block_ids), ())
                self._scribble[request_id] = tuple(int(b) for b in first)
                self._release(request_id, "fault", request_id)
        if self.budget is not None and self.total_blocks:
            candidates = [rid for rid in self._held if rid in self._slots and rid != request_id]
            for victim in retention_budget_releases(
                self._held, candidates, self.budget, self.total_blocks, releasing=self._releasing
            ):
                self._release(victim, "budget", request_id)
        return wire.word_to_wire(*word, base=self.base) if word is not None else None

    def asked(self, request_id: str) -> None:
        """vLLM asks how many tokens ``request_id`` can load. Asked again with no
        allocation in between, it could not be allocated: it waits for blocks (or a
        sequence slot), so D releases its oldest fenced retained turn, one per ask."""
        if request_id in self._asked and self.enabled:
            victim = next(
                (rid for rid in self._held if rid in self._slots and rid not in self._releasing),
                None,
            )
            if victim is not None:
                self._release(victim, "pressure", request_id)
        self._asked.add(request_id)

    def allocated(self, request_id: str) -> None:
        """``request_id`` got its blocks, or finished: not waiting any more."""
        self._asked.discard(request_id)

    def sent(self, request_ids: Iterable[str]) -> None:
        """The worker reported these done sending (notified, expired or released)."""
        for rid in request_ids:
            self._held.pop(rid, None)
            self._slots.release(rid)  # reused last
            self._releasing.discard(rid)

    def _release(self, victim: str, reason: str, for_request: str) -> None:
        self._releasing.add(victim)
        self._to_release.add(victim)
        self.num_released_early[reason] += 1
        log.info(
            "bidir-kv: releasing fenced retained turn %s before its TTL (%s; for "
            "request %s); its fence word changes before its blocks are freed.",
            victim,
            _WHY[reason],
            for_request,
        )

    # ---- the worker ---------------------------------------------------------------------

    def take_meta(self) -> FenceMeta:
        """This step's orders for the worker; the scheduler starts the next step's afresh."""
        meta = FenceMeta(
            writes=self._writes,
            release=frozenset(self._to_release),
            checks=self._checks,
            scribble=self._scribble,
        )
        self._writes, self._to_release, self._checks, self._scribble = {}, set(), {}, {}
        return meta

    def state(self) -> dict[str, int]:
        """How many entries each piece of per-request state holds (all 0 when no turn is
        retained, released, waiting or read: the lifecycle tests' leak check)."""
        return {
            "retained": len(self._held),
            "slots": len(self._slots),
            "releasing": len(self._releasing),
            "asked": len(self._asked),
            "writes": len(self._writes),
            "to_release": len(self._to_release),
            "checks": len(self._checks),
            "scribble": len(self._scribble),
        }
