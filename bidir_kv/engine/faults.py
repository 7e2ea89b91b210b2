"""Fault injection: make an engine fail on purpose, from flags or ``POST /_emulator/faults``.

Each knob names one failure the protocol must survive (docs/protocol.md §5, §7): a
node dying mid-turn, failed or slow READs, a skewed exported deadline, lost
completion notifications, a wedged scheduler.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from bidir_kv.errors import ConfigError

__all__ = ["FaultError", "Faults", "add_fault_flags", "faults_from_args"]


class FaultError(ConfigError):
    """A bad fault setting; the message names the field."""


@dataclass
class Faults:
    """Current fault settings; all off by default."""

    exit_on_request: int = 0  # exit the process when the Nth request (1-based) arrives
    exit_after_tokens: int = 0  # exit after this many streamed tokens of one response
    fail_transfers: float = 0.0  # fraction of READs that fail (counted as failed transfers)
    delay_transfers: float = 0.0  # fraction of READs delayed by delay_seconds
    delay_seconds: float = 0.0
    clock_skew: float = 0.0  # seconds added to the exported remote_blocks_expiry_time only
    drop_notifications: float = 0.0  # fraction of incoming notifications ignored
    stall_seconds: float = 0.0  # extra wall time added to every scheduler step
    stall: bool = False  # no scheduler steps until cleared (/health turns 503, see settings)
    # D releases a fenced retained turn right after granting its read's claim and reuses
    # its blocks: the in-flight release the fence guards (docs/connector.md §5)
    release_on_claim: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()
        self._rng = random.Random(self.seed)

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("fail_transfers", "delay_transfers", "drop_notifications"):
                if not 0.0 <= v <= 1.0:
                    raise FaultError(f"{f.name}: must be a fraction in [0, 1], got {v}")
            elif (
                f.name in ("exit_on_request", "exit_after_tokens", "delay_seconds", "stall_seconds")
                and v < 0
            ):
                raise FaultError(f"{f.name}: must be >= 0, got {v}")

    def update(self, changes: Any) -> None:
        """Apply a partial JSON object; unknown keys and wrong types are errors."""
        if not isinstance(changes, Mapping):
            raise FaultError("faults must be a JSON object")
        types = {f.name: f.type for f in fields(self)}
        staged = asdict(self)
        for key, value in changes.items():
            if key not in types:
                raise FaultError(f"unknown fault {key!r}; known: {', '.join(types)}")
            kind = types[key]
            if kind == "bool":
                if not isinstance(value, bool):
                    raise FaultError(f"{key}: expected a boolean, got {value!r}")
            elif kind == "int":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise FaultError(f"{key}: expected an integer, got {value!r}")
            elif not isinstance(value, int | float) or isinstance(value, bool):
                raise FaultError(f"{key}: expected a number, got {value!r}")
            staged[key] = float(value) if kind == "float" else value
        candidate = Faults(**staged)  # validates
        for key in types:
            setattr(self, key, getattr(candidate, key))
        if "seed" in changes:
            self._rng = random.Random(self.seed)

    def roll(self, fraction: float) -> bool:
        return fraction > 0 and (fraction >= 1 or self._rng.random() < fraction)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fault injection (emulator only)")
    g.add_argument("--fault-exit-on-request", type=int, default=0, metavar="N")
    g.add_argument("--fault-exit-after-tokens", type=int, default=0, metavar="K")
    g.add_argument("--fault-fail-transfers", type=float, default=0.0, metavar="FRACTION")
    g.add_argument("--fault-delay-transfers", type=float, default=0.0, metavar="FRACTION")
    g.add_argument("--fault-delay-seconds", type=float, default=0.0, metavar="S")
    g.add_argument("--fault-clock-skew", type=float, default=0.0, metavar="S")
    g.add_argument("--fault-drop-notifications", type=float, default=0.0, metavar="FRACTION")
    g.add_argument("--fault-stall-seconds", type=float, default=0.0, metavar="S")
    g.add_argument("--fault-stall", action="store_true", help="no scheduler steps until cleared")
    g.add_argument(
        "--fault-release-on-claim",
        action="store_true",
        help="D releases a fenced turn and rewrites its blocks while it is read",
    )
    g.add_argument("--fault-seed", type=int, default=0)


def faults_from_args(ns: argparse.Namespace) -> Faults:
    return Faults(
        exit_on_request=ns.fault_exit_on_request,
        exit_after_tokens=ns.fault_exit_after_tokens,
        fail_transfers=ns.fault_fail_transfers,
        delay_transfers=ns.fault_delay_transfers,
        delay_seconds=ns.fault_delay_seconds,
        clock_skew=ns.fault_clock_skew,
        drop_notifications=ns.fault_drop_notifications,
        stall_seconds=ns.fault_stall_seconds,
        stall=ns.fault_stall,
        release_on_claim=ns.fault_release_on_claim,
        seed=ns.fault_seed,
    )
