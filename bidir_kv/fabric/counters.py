"""The NICs' own counters around a measurement: did the KV reads cross the fabric?

vLLM's metrics count the bytes NIXL moved, whatever carried them: an EFA RDMA read, a
TCP fallback, or shared memory between two processes on one host. The devices count
only what crossed them, so a reading before and after the ON rounds tells those apart:

* **EFA**: every port of P's EFA devices counts the bytes of the RDMA reads it issued in
  ``/sys/class/infiniband/<dev>/ports/<n>/hw_counters/rdma_read_bytes`` (P is the reader
  of a D->P read); :func:`efa_counters` sums them over the devices.
* **an interface** (the dry run's veth, or any NIC carrying TCP): the bytes it received,
  ``/sys/class/net/<if>/statistics/rx_bytes`` (:func:`interface_counters`).

:func:`gate_fabric` asks that the counted bytes cover the KV bytes the reads had to move
and exceed them by no more than a stated overhead factor (headers, the side channel,
other traffic on the link): flat counters, too few bytes, or far too many fail with a
message naming every device and counter read.

Counters are read on the host this process runs on; a caller on another host reads the
same files there (``cat`` through the ssh launcher) and hands the numbers to
:func:`deltas`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bidir_kv.errors import CheckFailure

__all__ = [
    "EFA_OVERHEAD",
    "EFA_ROOT",
    "INTERFACE_OVERHEAD",
    "NET_ROOT",
    "Counter",
    "FabricFailure",
    "deltas",
    "efa_counters",
    "gate_fabric",
    "interface_counters",
    "read_counters",
]

EFA_ROOT = Path("/sys/class/infiniband")
NET_ROOT = Path("/sys/class/net")
# Counted bytes may exceed the KV bytes by at most these factors. RDMA read counters
# count payload only (the side channel's TCP does not touch them); an interface also
# counts Ethernet/IP/TCP headers (~5 % at MTU 1500), the transport's framing, the side
# channel and anything else the link carries during the rounds.
EFA_OVERHEAD = 1.05
INTERFACE_OVERHEAD = 1.25


class FabricFailure(CheckFailure):
    """The counters do not show the reads on the fabric; the message names them."""


@dataclass(frozen=True)
class Counter:
    """One monotonic byte counter: a label for messages and its file."""

    label: str  # "rdmap0s31 port 1 rdma_read_bytes", "eth1 rx_bytes"
    path: Path

    def read(self) -> int:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            raise FabricFailure(f"cannot read {self.label} ({self.path}): {exc}") from None


def efa_counters(
    devices: Sequence[str] | None = None, *, name: str = "rdma_read_bytes", root: Path = EFA_ROOT
) -> list[Counter]:
    """``name`` of every port of ``devices`` (default: every device under ``root`` with
    such a counter — on an EFA host, the EFA devices). Raises :class:`FabricFailure`
    naming what is missing when a requested device has no such counter, or none has."""
    names = (
        sorted(devices)
        if devices is not None
        else (sorted(p.name for p in root.iterdir()) if root.is_dir() else [])
    )
    out: list[Counter] = []
    for dev in names:
        found = sorted((root / dev / "ports").glob(f"*/hw_counters/{name}"))
        if not found and devices is not None:
            raise FabricFailure(
                f"device {dev} has no {name} counter under {root / dev / 'ports'}/*/hw_counters"
            )
        out += [Counter(f"{dev} port {p.parents[1].name} {name}", p) for p in found]
    if not out:
        raise FabricFailure(
            f"no device under {root} counts {name}: no EFA device here "
            "(or its driver does not expose hw_counters)"
        )
    return out


def interface_counters(
    interface: str, *, name: str = "rx_bytes", root: Path = NET_ROOT
) -> list[Counter]:
    """``statistics/name`` of one network interface."""
    path = root / interface / "statistics" / name
    if not path.exists():
        raise FabricFailure(f"interface {interface} has no {name} counter ({path})")
    return [Counter(f"{interface} {name}", path)]


def read_counters(counters: Sequence[Counter]) -> dict[str, int]:
    return {c.label: c.read() for c in counters}


def deltas(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Per counter, ``after - before`` (a counter that went backwards was reset: its
    delta is unknown and reported as such by :func:`gate_fabric`)."""
    return {k: after[k] - before[k] for k in before}


def _listing(delta: Mapping[str, int]) -> str:
    return ", ".join(f"{k} +{v:,}" for k, v in delta.items())


def gate_fabric(
    delta: Mapping[str, int], expected_bytes: float, overhead: float, *, what: str = "the fabric"
) -> int:
    """``expected_bytes <= sum(delta) <= expected_bytes × overhead``; returns the sum.

    ``what`` says where the bytes should have gone ("P's EFA devices", "P's interface
    bkv1p"); every failure names it, each counter and its delta."""
    if not delta:
        raise FabricFailure(f"no counters were read on {what}")
    reset = [k for k, v in delta.items() if v < 0]
    if reset:
        raise FabricFailure(f"counters on {what} went backwards (reset?): {_listing(delta)}")
    total = sum(delta.values())
    need = f"{expected_bytes:,.0f} KV bytes expected (×{overhead:g} overhead allowed)"
    if total == 0:
        raise FabricFailure(
            f"counters flat on {what} while the reads moved {need}: "
            f"{_listing(delta)}; the reads did not cross it (TCP fallback, "
            "shared memory on one host, or other devices)"
        )
    if total < expected_bytes:
        raise FabricFailure(
            f"{total:,} bytes counted on {what} < {need}: {_listing(delta)}; "
            "part of the reads went another way"
        )
    if total > expected_bytes * overhead:
        raise FabricFailure(
            f"{total:,} bytes counted on {what} > {need}: {_listing(delta)}; "
            "other traffic on it hides the reads"
        )
    return total
