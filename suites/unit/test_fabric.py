"""The NIC counter reader and the fabric gate (bidir_kv/fabric/counters.py) on a fake sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from bidir_kv.fabric.counters import (
    EFA_OVERHEAD,
    FabricFailure,
    deltas,
    efa_counters,
    gate_fabric,
    interface_counters,
    read_counters,
)


def _efa(root: Path, dev: str, port: int, **values: int) -> None:
    d = root / dev / "ports" / str(port) / "hw_counters"
    d.mkdir(parents=True, exist_ok=True)
    for name, value in values.items():
        (d / name).write_text(f"{value}\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    ib = tmp_path / "infiniband"
    _efa(ib, "rdmap0s31", 1, rdma_read_bytes=100, rdma_read_wrs=1, rdma_read_resp_bytes=7)
    _efa(ib, "rdmap16s27", 1, rdma_read_bytes=5, rdma_read_wrs=2)
    (ib / "mlx5_0" / "ports" / "1").mkdir(parents=True)  # a device without hw_counters
    net = tmp_path / "net" / "eth1" / "statistics"
    net.mkdir(parents=True)
    (net / "rx_bytes").write_text("42\n")
    return tmp_path


def test_efa_reader_sums_rdma_read_bytes_over_every_device_and_port(sysfs: Path) -> None:
    counters = efa_counters(root=sysfs / "infiniband")
    assert [c.label for c in counters] == [
        "rdmap0s31 port 1 rdma_read_bytes",
        "rdmap16s27 port 1 rdma_read_bytes",
    ]
    before = read_counters(counters)
    _efa(sysfs / "infiniband", "rdmap0s31", 1, rdma_read_bytes=100 + 600)
    _efa(sysfs / "infiniband", "rdmap16s27", 1, rdma_read_bytes=5 + 400)
    delta = deltas(before, read_counters(counters))
    assert delta == {
        "rdmap0s31 port 1 rdma_read_bytes": 600,
        "rdmap16s27 port 1 rdma_read_bytes": 400,
    }
    assert gate_fabric(delta, 1000, EFA_OVERHEAD, what="P's EFA devices") == 1000


def test_efa_reader_names_a_requested_device_without_the_counter(sysfs: Path) -> None:
    with pytest.raises(FabricFailure, match=r"device mlx5_0 has no rdma_read_bytes counter"):
        efa_counters(["mlx5_0"], root=sysfs / "infiniband")
    with pytest.raises(FabricFailure, match=r"no device under .* counts rdma_read_bytes"):
        efa_counters(root=sysfs / "missing")


def test_interface_reader(sysfs: Path) -> None:
    (counter,) = interface_counters("eth1", root=sysfs / "net")
    assert counter.label == "eth1 rx_bytes" and counter.read() == 42
    with pytest.raises(FabricFailure, match=r"interface veth9 has no rx_bytes counter"):
        interface_counters("veth9", root=sysfs / "net")


def test_flat_counters_fail_naming_every_device_and_counter(sysfs: Path) -> None:
    counters = efa_counters(root=sysfs / "infiniband")
    flat = deltas(read_counters(counters), read_counters(counters))
    with pytest.raises(FabricFailure) as failure:
        gate_fabric(flat, 8_257_536, EFA_OVERHEAD, what="P's EFA devices")
    text = str(failure.value)
    assert text.startswith("counters flat on P's EFA devices while the reads moved 8,257,536")
    assert "rdmap0s31 port 1 rdma_read_bytes +0" in text
    assert "rdmap16s27 port 1 rdma_read_bytes +0" in text


@pytest.mark.parametrize(
    ("counted", "message"),
    [
        (500, r"500 bytes counted on eth1 < 1,000 KV bytes expected .*part of the reads"),
        (1300, r"1,300 bytes counted on eth1 > 1,000 KV bytes expected \(×1.25 overhead"),
        (-1, r"went backwards"),
    ],
)
def test_too_few_or_too_many_bytes_fail(counted: int, message: str) -> None:
    with pytest.raises(FabricFailure, match=message):
        gate_fabric({"eth1 rx_bytes": counted}, 1000, 1.25, what="eth1")


def test_bytes_within_the_overhead_pass() -> None:
    assert gate_fabric({"eth1 rx_bytes": 1000}, 1000, 1.25) == 1000
    assert gate_fabric({"eth1 rx_bytes": 1250}, 1000, 1.25) == 1250


@pytest.mark.parametrize("counted", [999, 800, 501])
@pytest.mark.parametrize("overhead", [1.25, 2.0])
def test_any_shortfall_below_the_expected_bytes_fails(counted: int, overhead: float) -> None:
    """The overhead factor allows bytes *above* the expected ones (headers, the side
    channel); below them, by any amount, part of the KV went another way: a fifth of the
    bytes missing must not pass because the factor is 1.25."""
    with pytest.raises(FabricFailure, match=rf"{counted:,} bytes counted on eth1 < 1,000 KV"):
        gate_fabric({"eth1 rx_bytes": counted}, 1000, overhead, what="eth1")
    assert gate_fabric({"eth1 rx_bytes": 1000}, 1000, overhead, what="eth1") == 1000


def test_requested_devices_only_and_every_missing_piece_named_in_full(sysfs: Path) -> None:
    ib = sysfs / "infiniband"
    (only,) = efa_counters(["rdmap16s27"], root=ib)
    assert only.label == "rdmap16s27 port 1 rdma_read_bytes" and only.read() == 5
    with pytest.raises(FabricFailure) as missing:
        efa_counters(["mlx5_0"], root=ib)
    assert str(missing.value) == (
        f"device mlx5_0 has no rdma_read_bytes counter under {ib / 'mlx5_0' / 'ports'}"
        "/*/hw_counters"
    )
    with pytest.raises(FabricFailure) as none:
        efa_counters(root=sysfs / "missing")
    assert str(none.value) == (
        f"no device under {sysfs / 'missing'} counts rdma_read_bytes: no EFA device here "
        "(or its driver does not expose hw_counters)"
    )
    (ib / "rdmap0s31" / "ports" / "1" / "hw_counters" / "rdma_read_bytes").write_text("n/a\n")
    with pytest.raises(FabricFailure) as unreadable:
        efa_counters(["rdmap0s31"], root=ib)[0].read()
    assert str(unreadable.value).startswith(
        f"cannot read rdmap0s31 port 1 rdma_read_bytes ({ib}/rdmap0s31/ports/1/hw_counters/"
        "rdma_read_bytes): invalid literal"
    )


def test_every_gate_failure_says_where_and_why_in_full() -> None:
    two = {"eth1 rx_bytes": 300, "eth2 rx_bytes": 200}
    cases = [
        ({}, "no counters were read on the fabric"),
        (
            {"eth1 rx_bytes": 0},
            "counters flat on the fabric while the reads moved 1,000 KV bytes expected (×1.25 "
            "overhead allowed): eth1 rx_bytes +0; the reads did not cross it (TCP fallback, "
            "shared memory on one host, or other devices)",
        ),
        (
            two,
            "500 bytes counted on the fabric < 1,000 KV bytes expected (×1.25 overhead "
            "allowed): eth1 rx_bytes +300, eth2 rx_bytes +200; part of the reads went another way",
        ),
        (
            {"eth1 rx_bytes": 1251},
            "1,251 bytes counted on the fabric > 1,000 KV bytes expected (×1.25 overhead "
            "allowed): eth1 rx_bytes +1,251; other traffic on it hides the reads",
        ),
    ]
    for delta, message in cases:
        with pytest.raises(FabricFailure) as failure:
            gate_fabric(delta, 1000, 1.25)  # ``what`` left at its default
        assert str(failure.value) == message


# ---- the probe: which counters, read here (bidir_kv/fabric/probe.py) -------------------


def test_probe_specs_and_their_errors() -> None:
    from bidir_kv.fabric.probe import parse_spec

    assert parse_spec("efa") == ("efa", None)
    assert parse_spec("efa:") == ("efa", None)
    assert parse_spec("efa:rdmap1,,rdmap0") == ("efa", ["rdmap1", "rdmap0"])
    assert parse_spec("if:bkv1p") == ("if", ["bkv1p"])
    for bad in ("if", "if:", "eth0", "EFA", ""):
        with pytest.raises(ValueError) as err:
            parse_spec(bad)
        assert str(err.value) == f"expected efa[:DEV,...] or if:NAME, got {bad!r}"


def test_local_probe_of_efa_devices_reads_their_counters_in_a_window(
    sysfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    from bidir_kv.fabric import probe

    ib = sysfs / "infiniband"
    monkeypatch.setattr(probe, "efa_counters", functools.partial(efa_counters, root=ib))
    every = probe.local_probe("efa")
    assert every.what == "P's EFA devices (rdmap0s31, rdmap16s27)"
    assert every.overhead == EFA_OVERHEAD
    one = probe.local_probe("efa:rdmap16s27", overhead=1.5)
    assert one.what == "P's EFA devices (rdmap16s27)" and one.overhead == 1.5
    with every.window() as window:
        assert window.deltas == {}
        _efa(ib, "rdmap0s31", 1, rdma_read_bytes=100 + 4096)
    assert window.deltas == {
        "rdmap0s31 port 1 rdma_read_bytes": 4096,
        "rdmap16s27 port 1 rdma_read_bytes": 0,
    }


def test_local_probe_of_an_interface() -> None:
    from bidir_kv.fabric.counters import INTERFACE_OVERHEAD
    from bidir_kv.fabric.probe import local_probe

    lo = local_probe("if:lo")  # every Linux host has a loopback interface
    assert lo.what == "P's interface lo" and lo.overhead == INTERFACE_OVERHEAD
    assert list(lo.read()) == ["lo rx_bytes"]
    assert local_probe("if:lo", overhead=2.0).overhead == 2.0
    with pytest.raises(FabricFailure, match=r"^interface bkv-none has no rx_bytes counter \("):
        local_probe("if:bkv-none")
