"""Which of P's counters to read (bidir_kv/fabric/counters.py), here or on P's host through ssh:
the probe the hardware tier (``--hw-fabric``) and ``bidir-kv doctor`` (``--fabric``) read
before and after their D->P reads.

* ``efa`` / ``efa:DEV,DEV``: ``rdma_read_bytes`` of P's EFA devices (all, or those named);
* ``if:NAME``: ``rx_bytes`` of P's interface NAME.

On P's own host the counters are sysfs reads; on another host one ``cat`` through the
ssh launcher's client reads them all. A pair on one host has no fabric to read
(:data:`ONE_HOST`, the label every report gives it).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bidir_kv.fabric.counters import (
    EFA_OVERHEAD,
    EFA_ROOT,
    INTERFACE_OVERHEAD,
    Counter,
    FabricFailure,
    deltas,
    efa_counters,
    interface_counters,
    read_counters,
)
from bidir_kv.launch.ssh import SshHost, run_ssh

__all__ = ["ONE_HOST", "FabricProbe", "Window", "local_probe", "parse_spec", "remote_probe"]

ONE_HOST = "one host, no fabric"


@dataclass(frozen=True)
class FabricProbe:
    """Read P's counters: ``read()`` -> {label: value}; ``what`` names them in messages."""

    read: Callable[[], dict[str, int]]
    what: str
    overhead: float

    def window(self) -> Window:
        """A ``with`` block whose :attr:`Window.deltas` are what the counters counted
        inside it. Keep the block to the D->P read (P's prefill request): anything else
        on P's link, such as a client talking to D across it, would be counted too."""
        return Window(self.read)


class Window:
    """The counters' deltas across one ``with`` block (:meth:`FabricProbe.window`)."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read
        self._before: dict[str, int] = {}
        self.deltas: dict[str, int] = {}

    def __enter__(self) -> Window:
        self._before = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        self.deltas = deltas(self._before, self._read())


def _overhead(kind: str, given: float | None) -> float:
    if given is not None:
        return given
    return EFA_OVERHEAD if kind == "efa" else INTERFACE_OVERHEAD


def parse_spec(spec: str) -> tuple[str, list[str] | None]:
    kind, _, arg = spec.partition(":")
    if kind == "efa":
        return kind, [d for d in arg.split(",") if d] or None
    if kind == "if" and arg:
        return kind, [arg]
    raise ValueError(f"expected efa[:DEV,...] or if:NAME, got {spec!r}")


def local_probe(spec: str, overhead: float | None = None) -> FabricProbe:
    """A probe of counters on this host."""
    kind, arg = parse_spec(spec)
    if kind == "efa":
        counters = efa_counters(arg)
        what = f"P's EFA devices ({', '.join(sorted({c.label.split()[0] for c in counters}))})"
    else:
        assert arg is not None
        counters = interface_counters(arg[0])
        what = f"P's interface {arg[0]}"
    return FabricProbe(lambda: read_counters(counters), what, _overhead(kind, overhead))


def remote_probe(spec: str, host: SshHost, overhead: float | None = None) -> FabricProbe:
    """A probe of counters on P's host through ssh (one round trip per reading)."""
    kind, arg = parse_spec(spec)
    if kind == "efa":
        pattern = (
            " ".join(f"{EFA_ROOT}/{d}/ports/*/hw_counters/rdma_read_bytes" for d in arg)
            if arg
            else f"{EFA_ROOT}/*/ports/*/hw_counters/rdma_read_bytes"
        )
        listing = run_ssh(host, f"ls -1 {pattern} 2>/dev/null", 60).stdout.split()
        if not listing:
            raise FabricFailure(
                f"no rdma_read_bytes counter on {host.destination} ({pattern}): no EFA device there"
            )
        counters = [
            Counter(f"{p.split('/')[4]} port {p.split('/')[6]} rdma_read_bytes", Path(p))
            for p in listing
        ]
    else:
        assert arg is not None
        counters = [
            Counter(f"{arg[0]} rx_bytes", Path(f"/sys/class/net/{arg[0]}/statistics/rx_bytes"))
        ]
    script = "cat " + " ".join(shlex.quote(str(c.path)) for c in counters)

    def read() -> dict[str, int]:
        out = run_ssh(host, script, 60)
        values = out.stdout.split()
        if out.returncode != 0 or len(values) != len(counters):
            raise FabricFailure(
                f"reading counters on {host.destination} failed: "
                f"{out.stderr.strip() or out.stdout.strip()}"
            )
        return {c.label: int(v) for c, v in zip(counters, values, strict=True)}

    devices = "EFA devices" if kind == "efa" else f"interface {counters[0].label.split()[0]}"
    what = f"P's {devices} on {host.destination}"
    return FabricProbe(read, what, _overhead(kind, overhead))
