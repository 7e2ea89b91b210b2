"""P's counters read on another host (``bidir_kv.fabric.probe.remote_probe``): one ``ls``
to find the EFA counters, one ``cat`` per reading, every failure named.

``ssh`` is replaced by a stand-in that runs the script here, with the host's
``/sys/class/infiniband`` mapped to a fake tree (below the unit boundary: the scripts and
their parsing are under test; the real OpenSSH client and server are in
suites/integration/test_two_hosts.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bidir_kv.fabric.counters import EFA_OVERHEAD, INTERFACE_OVERHEAD, FabricFailure
from bidir_kv.fabric.probe import remote_probe
from bidir_kv.launch.ssh import SshHost

# the last argument is the script (SshHost.argv): run it with the fake sysfs, and give
# the paths it prints back as the host's own
SHIM = """#!/bin/sh
for last in "$@"; do :; done
script=$(printf '%s' "$last" | sed "s|/sys/class/infiniband|$BKV_FAKE_IB|g")
out=$(sh -c "$script"); rc=$?
[ -n "$out" ] && printf '%s\\n' "$out" | sed "s|$BKV_FAKE_IB|/sys/class/infiniband|g"
exit $rc
"""


def _counter(ib: Path, dev: str, port: int, value: int) -> None:
    d = ib / dev / "ports" / str(port) / "hw_counters"
    d.mkdir(parents=True, exist_ok=True)
    (d / "rdma_read_bytes").write_text(f"{value}\n")


@pytest.fixture
def p_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[SshHost, Path]:
    shim = tmp_path / "ssh"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    ib = tmp_path / "infiniband"
    ib.mkdir()
    monkeypatch.setenv("BKV_FAKE_IB", str(ib))
    return SshHost("p-host", user="ubuntu", ssh=str(shim)), ib


def test_efa_counters_on_p_host_are_found_and_read_in_one_call(
    p_host: tuple[SshHost, Path],
) -> None:
    host, ib = p_host
    _counter(ib, "rdmap0s31", 1, 100)
    _counter(ib, "rdmap0s31", 2, 7)
    _counter(ib, "rdmap16s27", 1, 5)
    every = remote_probe("efa", host)
    assert every.what == "P's EFA devices on ubuntu@p-host" and every.overhead == EFA_OVERHEAD
    with every.window() as window:
        _counter(ib, "rdmap0s31", 2, 7 + 8192)
    assert window.deltas == {
        "rdmap0s31 port 1 rdma_read_bytes": 0,
        "rdmap0s31 port 2 rdma_read_bytes": 8192,
        "rdmap16s27 port 1 rdma_read_bytes": 0,
    }
    named = remote_probe("efa:rdmap16s27", host, overhead=1.1)
    assert named.read() == {"rdmap16s27 port 1 rdma_read_bytes": 5} and named.overhead == 1.1
    both = remote_probe("efa:rdmap16s27,rdmap0s31", host)
    assert sorted(both.read()) == [
        "rdmap0s31 port 1 rdma_read_bytes",
        "rdmap0s31 port 2 rdma_read_bytes",
        "rdmap16s27 port 1 rdma_read_bytes",
    ]


def test_an_interface_on_p_host(p_host: tuple[SshHost, Path]) -> None:
    host, _ = p_host
    lo = remote_probe("if:lo", host)  # every Linux host has a loopback interface
    assert lo.what == "P's interface lo on ubuntu@p-host" and lo.overhead == INTERFACE_OVERHEAD
    assert list(lo.read()) == ["lo rx_bytes"]


def test_no_efa_device_and_an_unreadable_counter_are_named(p_host: tuple[SshHost, Path]) -> None:
    host, ib = p_host
    with pytest.raises(FabricFailure) as none:
        remote_probe("efa:rdmap9", host)
    assert str(none.value) == (
        "no rdma_read_bytes counter on ubuntu@p-host "
        "(/sys/class/infiniband/rdmap9/ports/*/hw_counters/rdma_read_bytes): no EFA device there"
    )
    with pytest.raises(FabricFailure, match=r"^no rdma_read_bytes counter on ubuntu@p-host \("):
        remote_probe("efa", host)
    _counter(ib, "rdmap0s31", 1, 100)
    probe = remote_probe("efa", host)
    (ib / "rdmap0s31" / "ports" / "1" / "hw_counters" / "rdma_read_bytes").unlink()
    with pytest.raises(FabricFailure) as gone:
        probe.read()
    assert str(gone.value).startswith("reading counters on ubuntu@p-host failed: cat: ")
    # a counter that reads more than one value: not what was asked for
    _counter(ib, "rdmap0s31", 1, 100)
    (ib / "rdmap0s31" / "ports" / "1" / "hw_counters" / "rdma_read_bytes").write_text("1 2\n")
    with pytest.raises(FabricFailure, match=r"^reading counters on ubuntu@p-host failed: 1"):
        probe.read()
    missing = remote_probe("if:bkv-none", host)
    with pytest.raises(FabricFailure, match="reading counters on ubuntu@p-host failed: cat: "):
        missing.read()
