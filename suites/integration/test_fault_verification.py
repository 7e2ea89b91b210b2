"""Injected faults check that they took effect: a kill of a process that already
exited, a pause of an exited process, a restart that leaves the old pid, a link "cut"
that still passes, a failure counter that did not rise, or an emulator that did not
take the fault, each fails with a clear message. The processes are real and cheap
(``sleep`` and one-line Python servers)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bidir_kv.launch.process import ManagedProcess, free_port, wait_http_ok
from bidir_kv.testing.faults import (
    FAULT_NOT_APPLIED,
    confirm_counter_rose,
    confirm_faults,
    confirm_logged,
    cut_link,
    kill_pid,
    kill_process,
    pause_process,
    process_state,
    process_tree,
    restart_node,
    stop_process,
)
from bidir_kv.testing.poll import wait_for
from bidir_kv.topology.base import Node, Topology, TopologySpec

NOT_APPLIED = f"{FAULT_NOT_APPLIED}: "


def _proc(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log").start()


def _tree(tmp_path: Path, name: str = "tree") -> ManagedProcess:
    """A shell with two children: three processes in one group."""
    return ManagedProcess(
        name, ["sh", "-c", "sleep 60 & sleep 60 & wait"], tmp_path / f"{name}.log"
    ).start()


def _exited(tmp_path: Path, name: str = "gone") -> ManagedProcess:
    proc = _proc(tmp_path, name, "print('bye')")
    wait_for(lambda: proc.returncode is not None, 10, "the node to exit by itself")
    return proc


@pytest.fixture
def started() -> Iterator[list[ManagedProcess]]:
    procs: list[ManagedProcess] = []
    yield procs
    for proc in procs:
        proc.send_signal(signal.SIGCONT)
        proc.stop(2)


# ---- kill ------------------------------------------------------------------------------


def test_killing_a_process_that_already_exited_fails_the_fault(tmp_path: Path) -> None:
    proc = _exited(tmp_path)
    with pytest.raises(AssertionError) as err:
        kill_process(proc)
    msg = str(err.value)
    assert msg.startswith(f"{NOT_APPLIED}kill of gone (pid {proc.pid})")
    assert "already exited with code 0" in msg and "bye" in msg  # the node's log tail


def test_killing_a_running_process_is_verified_gone(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    proc = _proc(tmp_path, "live", "import time; time.sleep(60)")
    started.append(proc)
    assert kill_process(proc) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL


def test_a_kill_of_a_node_never_started_fails(tmp_path: Path) -> None:
    proc = ManagedProcess("never", [sys.executable, "-c", "pass"], tmp_path / "never.log")
    with pytest.raises(AssertionError, match=f"{NOT_APPLIED}kill of never"):
        kill_process(proc)


def test_kill_pid_of_a_process_gone_fails_and_of_a_running_one_holds(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    gone = _exited(tmp_path)
    assert gone.pid is not None
    with pytest.raises(
        AssertionError,
        match=f"{NOT_APPLIED}kill of worker \\(pid {gone.pid}\\): it was not running",
    ):
        kill_pid(gone.pid, "worker")
    live = _tree(tmp_path)
    started.append(live)
    wait_for(lambda: len(process_tree(live.pid or 0)) == 3, 10, "the shell's two children")
    child = min(p for p in process_tree(live.pid or 0) if p != live.pid)
    kill_pid(child, "worker")
    assert process_state(child) in (None, "Z")


# ---- stop --------------------------------------------------------------------------------


def test_stop_of_a_running_tree_leaves_none_of_it(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    proc = _tree(tmp_path)
    started.append(proc)
    assert proc.pid is not None
    wait_for(lambda: len(process_tree(proc.pid or 0)) == 3, 10, "the shell's two children")
    assert stop_process(proc) is not None
    assert process_tree(proc.pid) == {}


def test_stop_of_an_exited_process_fails(tmp_path: Path) -> None:
    proc = _exited(tmp_path)
    with pytest.raises(AssertionError, match=f"^{NOT_APPLIED}stop of gone .*already exited"):
        stop_process(proc)


def test_a_stop_that_does_nothing_fails(
    tmp_path: Path, started: list[ManagedProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _tree(tmp_path, "stubborn")
    started.append(proc)
    monkeypatch.setattr(proc, "stop", lambda timeout=10.0: None)
    with pytest.raises(AssertionError) as err:
        stop_process(proc, gone_within=0.3)
    assert str(err.value).startswith(
        f"{NOT_APPLIED}stubborn (pid {proc.pid}) still runs after its stop (processes left: ["
    )


# ---- pause -------------------------------------------------------------------------------


def test_pause_stops_every_process_of_the_tree_and_resumes_them(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    proc = _tree(tmp_path)
    started.append(proc)
    assert proc.pid is not None
    wait_for(lambda: len(process_tree(proc.pid or 0)) == 3, 10, "the shell's two children")
    with pause_process(proc) as tree:
        assert len(tree) == 3 and set(tree.values()) == {"T"}
        assert {process_state(p) for p in tree} == {"T"}
    assert "T" not in process_tree(proc.pid).values()


def test_pause_of_an_exited_process_fails(tmp_path: Path) -> None:
    proc = _exited(tmp_path)
    with (
        pytest.raises(AssertionError, match=f"^{NOT_APPLIED}pause of gone .*already exited"),
        pause_process(proc),
    ):
        pytest.fail("the block ran")


def test_a_pause_whose_sigstop_goes_nowhere_fails(
    tmp_path: Path, started: list[ManagedProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _tree(tmp_path, "busy")
    started.append(proc)
    real = proc.send_signal
    monkeypatch.setattr(
        proc, "send_signal", lambda sig: None if sig == signal.SIGSTOP else real(sig)
    )
    with pytest.raises(AssertionError) as err, pause_process(proc, timeout=0.3):
        pytest.fail("the block ran")
    assert str(err.value).startswith(f"{NOT_APPLIED}pause of busy (pid {proc.pid}): processes {{")
    assert "are not stopped 0.3 s after SIGSTOP" in str(err.value)


def test_a_resume_whose_sigcont_goes_nowhere_fails(
    tmp_path: Path, started: list[ManagedProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _tree(tmp_path, "frozen")
    started.append(proc)
    real = proc.send_signal
    monkeypatch.setattr(
        proc, "send_signal", lambda sig: None if sig == signal.SIGCONT else real(sig)
    )
    with pytest.raises(AssertionError) as err, pause_process(proc, timeout=0.3):
        pass
    assert str(err.value).startswith(f"{NOT_APPLIED}resume of frozen (pid {proc.pid}): processes [")
    assert "are still stopped 0.3 s after SIGCONT" in str(err.value)
    real(signal.SIGCONT)


# ---- restart -----------------------------------------------------------------------------

_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Servers(Topology):
    """One tiny HTTP server as a node; ``mode`` makes its restart real or broken."""

    backend = "unit"

    def __init__(self, run_dir: Path, mode: str = "real") -> None:
        super().__init__(TopologySpec())
        self.run_dir, self.mode = run_dir, mode
        self.procs: list[ManagedProcess] = []

    def _serve(self, port: int) -> ManagedProcess:
        proc = ManagedProcess(
            "server",
            [sys.executable, "-c", _SERVER, str(port)],
            self.run_dir / f"server-{len(self.procs)}.log",
        ).start()
        self.procs.append(proc)
        wait_http_ok(f"http://127.0.0.1:{port}/health", 20, alive=proc)
        return proc

    def start(self) -> _Servers:
        port = free_port()
        proc = self._serve(port)
        self.decode = [Node("decode", "decode-0", "127.0.0.1", port, info={"pid": proc.pid})]
        return self

    def restart(self, node: Node) -> None:
        if self.mode == "noop":
            return
        self.procs[-1].stop()
        if self.mode == "stop-only":
            return
        node.info["pid"] = self._serve(node.port).pid

    def close(self) -> None:
        for proc in self.procs:
            proc.stop(2)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Any]:
    made: list[_Servers] = []

    def make(mode: str) -> _Servers:
        topo = _Servers(tmp_path, mode).start()
        made.append(topo)
        return topo

    yield make
    for topo in made:
        topo.close()


def test_a_restart_is_verified_by_a_new_pid_that_serves(servers: Any) -> None:
    topo = servers("real")
    node = topo.decode[0]
    old = node.info["pid"]
    new = restart_node(topo, node, timeout=10)
    assert new == node.info["pid"] != old and process_state(old) is None


def test_a_restart_that_leaves_the_old_pid_fails(servers: Any) -> None:
    topo = servers("noop")
    node = topo.decode[0]
    with pytest.raises(AssertionError) as err:
        restart_node(topo, node)
    assert str(err.value) == (
        f"{NOT_APPLIED}restart of decode-0: the old process "
        f"(pid {node.info['pid']}) still runs and no new one was started"
    )


def test_a_restart_that_starts_nothing_fails(servers: Any) -> None:
    topo = servers("stop-only")
    node = topo.decode[0]
    with pytest.raises(
        AssertionError, match=f"^{NOT_APPLIED}restart of decode-0: no new process was started"
    ):
        restart_node(topo, node)


# ---- link cuts ---------------------------------------------------------------------------


class _Link:
    """A listening socket: the "link" passes while it listens."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock: socket.socket | None = None
        self.up()

    def up(self) -> None:
        if self.sock is None:
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("127.0.0.1", self.port))
            self.sock.listen(512)

    def down(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def passes(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                pass
        except OSError:
            return False
        if self.sock is not None:  # take it off the accept queue: polls never fill it
            self.sock.accept()[0].close()
        return True


@pytest.fixture
def link() -> Iterator[_Link]:
    made = _Link()
    yield made
    made.down()


def test_a_cut_link_drops_in_the_block_and_passes_after(link: _Link) -> None:
    with cut_link("the test link", link.down, link.up, link.passes):
        assert not link.passes()
    assert link.passes()


def test_a_cut_that_still_passes_fails(link: _Link) -> None:
    with (
        pytest.raises(AssertionError) as err,
        cut_link("the test link", lambda: None, link.up, link.passes, timeout=0.3),
    ):
        pytest.fail("the block ran")
    assert str(err.value) == (
        f"{NOT_APPLIED}cut of the test link: traffic still passes 0.3 s after the cut"
    )


def test_a_restore_that_does_not_restore_fails(link: _Link) -> None:
    with (
        pytest.raises(AssertionError) as err,
        cut_link("the test link", link.down, lambda: None, link.passes, timeout=0.3),
    ):
        pass
    assert str(err.value) == (
        f"{NOT_APPLIED}restore of the test link: traffic still drops 0.3 s after the restore"
    )


def test_a_link_down_before_the_cut_fails(link: _Link) -> None:
    link.down()
    with (
        pytest.raises(
            AssertionError, match=f"^{NOT_APPLIED}cut of the test link: the link already drops"
        ),
        cut_link("the test link", link.down, link.up, link.passes),
    ):
        pytest.fail("the block ran")


# ---- counters, logs, emulator faults -----------------------------------------------------


def test_a_failure_counter_that_did_not_rise_fails() -> None:
    values = iter([0.0, 0.0, 1.0, 1.0])
    assert confirm_counter_rose("P's failed transfers", lambda: next(values), 0.0) == 1.0
    with pytest.raises(AssertionError) as err:
        confirm_counter_rose("P's failed transfers", lambda: 3.0, 3.0, timeout=0.1)
    assert str(err.value) == (
        f"{NOT_APPLIED}P's failed transfers stayed at 3 (0.1 s after the fault)"
    )


def test_a_fault_only_a_log_shows_must_be_logged_after_the_mark(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text("releasing fenced turn r0\n")
    mark = log.stat().st_size
    with pytest.raises(AssertionError) as err:
        confirm_logged("D's release fault", log, "releasing fenced", since=mark, timeout=0.1)
    assert str(err.value) == (
        f"{NOT_APPLIED}D's release fault: decode.log shows no 'releasing fenced' within 0.1 s"
    )
    with log.open("a") as fh:
        fh.write("releasing fenced turn r1\n")
    confirm_logged("D's release fault", log, "releasing fenced", since=mark)


def test_an_emulator_fault_not_reported_back_fails() -> None:
    confirm_faults("d0", {"stall": True}, {"stall": True, "fail_reads": 0})
    with pytest.raises(AssertionError) as err:
        confirm_faults("d0", {"stall": True, "fail_reads": 2}, {"stall": False})
    assert str(err.value) == (
        f"{FAULT_NOT_APPLIED}: d0 reports faults "
        "{'stall': False, 'fail_reads': '<absent>'} after being asked for "
        "{'stall': True, 'fail_reads': 2}"
    )


def test_the_campaign_fails_its_rows_with_the_same_words() -> None:
    from bidir_kv.campaign.faults import NOT_APPLIED as CAMPAIGN_NOT_APPLIED

    assert CAMPAIGN_NOT_APPLIED == FAULT_NOT_APPLIED


def test_a_campaign_row_whose_redis_pause_did_nothing_fails(
    tmp_path: Path, started: list[ManagedProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    from types import SimpleNamespace

    from bidir_kv.campaign import faults as campaign

    redis = _tree(tmp_path, "redis")
    started.append(redis)
    real_kill = os.kill
    monkeypatch.setattr(
        campaign.os,
        "kill",  # a SIGSTOP that goes nowhere
        lambda pid, sig: None if sig == signal.SIGSTOP else real_kill(pid, sig),
    )
    monkeypatch.setattr(campaign, "EFFECT_SECONDS", 0.3)

    async def warm(tag: str) -> None:
        return None

    ctx = SimpleNamespace(dep=SimpleNamespace(redis_pid=lambda: redis.pid), warm=warm)
    row = asyncio.run(campaign.redis_paused(ctx))  # type: ignore[arg-type]
    assert not row.holds
    assert row.saw == (
        f"{FAULT_NOT_APPLIED}: Redis (pid {redis.pid}) is in state S, not "
        "stopped, 0.3 s after SIGSTOP"
    )


# ---- an expected failure is no cover -----------------------------------------------------

_XFAIL = """
import pytest
from bidir_kv.testing.faults import restart_node, confirm_faults


@pytest.mark.xfail(strict=True, reason="a pinned defect")
def test_pinned_but_the_fault_did_nothing():
    confirm_faults("d0", {"stall": True}, {"stall": False})


@pytest.mark.xfail(strict=True, reason="a pinned defect")
def test_pinned_and_failing_for_its_defect():
    assert False, "the defect"
"""


def test_an_xfail_test_whose_fault_did_not_take_effect_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=_XFAIL)
    # in-process: the plugin (already imported here) is registered in a session of its own
    out = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "bidir_kv.testing.plugin", "-q", "-rfx", "-o", "addopts="
    )
    text = "\n".join(out.outlines)
    assert "1 failed, 1 xfailed" in text, text
    assert "FAILED test_inner.py::test_pinned_but_the_fault_did_nothing" in text, text
    assert f"FaultNotApplied: {FAULT_NOT_APPLIED}: d0 reports faults" in text, text
    assert "XFAIL test_inner.py::test_pinned_and_failing_for_its_defect" in text, text


# ---- every refusal in full (the words a red run shows) --------------------------------

_DEAF = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('deaf', flush=True); time.sleep(60)"
)


def _deaf(tmp_path: Path, started: list[ManagedProcess]) -> ManagedProcess:
    """A process that ignores SIGTERM, once it does (it says so in its log)."""
    proc = _proc(tmp_path, "deaf", _DEAF)
    started.append(proc)
    log = tmp_path / "deaf.log"
    wait_for(lambda: log.exists() and "deaf" in log.read_text(), 10, "SIGTERM ignored")
    return proc


def test_a_kill_that_leaves_the_process_running_fails_in_full(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    deaf = _deaf(tmp_path, started)
    with pytest.raises(AssertionError) as err:
        kill_process(deaf, signal.SIGTERM, timeout=0.3)
    assert str(err.value) == (
        f"{NOT_APPLIED}deaf (pid {deaf.pid}) still runs 0.3 s after signal SIGTERM"
    )
    assert deaf.pid is not None
    with pytest.raises(AssertionError) as pid_err:
        kill_pid(deaf.pid, "worker", signal.SIGTERM, timeout=0.3)
    assert str(pid_err.value) == (
        f"{NOT_APPLIED}worker (pid {deaf.pid}) still runs 0.3 s after signal SIGTERM"
    )


def test_a_stop_kills_what_ignores_sigterm_after_its_timeout(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    deaf = _deaf(tmp_path, started)
    assert stop_process(deaf, 0.3, gone_within=5) == -signal.SIGKILL


def test_refusals_name_the_state_and_the_last_ten_log_lines(
    tmp_path: Path, started: list[ManagedProcess]
) -> None:
    gone = _proc(tmp_path, "chatty", "for i in range(12): print(f'line {i}')")
    wait_for(lambda: gone.returncode is not None, 10, "the node to exit by itself")
    with pytest.raises(AssertionError) as err:
        kill_process(gone)
    assert str(err.value) == (
        f"{NOT_APPLIED}kill of chatty (pid {gone.pid}): it had already exited with code 0\n"
        + gone.log_tail(10)
    )
    assert "line 2\n" in gone.log_tail(10) and "line 1\n" not in gone.log_tail(10)
    assert gone.pid is not None
    with pytest.raises(AssertionError) as pid_err:
        kill_pid(gone.pid, "worker")
    assert str(pid_err.value) == (
        f"{NOT_APPLIED}kill of worker (pid {gone.pid}): it was not running (state gone)"
    )
    import subprocess

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not yet reaped
    try:
        wait_for(lambda: process_state(zombie.pid) == "Z", 10, "a zombie")
        with pytest.raises(AssertionError) as z_err:
            kill_pid(zombie.pid, "worker")
        assert str(z_err.value).endswith("it was not running (state Z)")
    finally:
        zombie.wait(10)
    never = ManagedProcess("never", [sys.executable, "-c", "pass"], tmp_path / "never.log")
    with pytest.raises(AssertionError) as n_err:
        stop_process(never)
    assert str(n_err.value) == f"{NOT_APPLIED}stop of never: it was never started"


class _Broken(_Servers):
    """Restarts that go wrong in other ways: the new process dies at once, or never
    serves /health."""

    def restart(self, node: Node) -> None:
        self.procs[-1].stop()
        if self.mode == "dies":
            proc = ManagedProcess(
                "server", [sys.executable, "-c", "pass"], self.run_dir / "dies.log"
            ).start()
            wait_for(lambda: proc.returncode is not None, 10, "the new process to exit")
        else:  # "silent": runs, never answers
            proc = ManagedProcess(
                "server",
                [sys.executable, "-c", "import time; time.sleep(60)"],
                self.run_dir / "s.log",
            ).start()
        self.procs.append(proc)
        node.info["pid"] = proc.pid


def test_a_restart_whose_new_process_dies_or_never_serves_fails(tmp_path: Path) -> None:
    for mode, says in (
        ("dies", "the new process (pid {new}) is not running (state gone)"),
        ("silent", "the new process (pid {new}) does not answer {url}/health within 0.5 s"),
    ):
        topo = _Broken(tmp_path, mode).start()
        try:
            node = topo.decode[0]
            with pytest.raises(AssertionError) as err:
                restart_node(topo, node, timeout=0.5)
            new = node.info["pid"]
            assert str(err.value) == (
                f"{NOT_APPLIED}restart of decode-0: " + says.format(new=new, url=node.url)
            )
        finally:
            topo.close()
    topo = _Servers(tmp_path, "real").start()
    try:
        node = topo.decode[0]
        del node.info["pid"]
        with pytest.raises(AssertionError) as unknown:
            restart_node(topo, node)
        assert str(unknown.value) == (
            f"{NOT_APPLIED}restart of decode-0: its process id is not known, so no restart "
            "can be shown"
        )
    finally:
        topo.close()
