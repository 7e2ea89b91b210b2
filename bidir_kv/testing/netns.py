"""Two hosts on one machine: a network namespace for D joined to this one by a veth pair,
and a real OpenSSH server in D's namespace.

Placement: **P stays in the root namespace** on the veth's near end; **D runs in its own
namespace** on the far end. So the router, the test client and P share one namespace as
they share a node in the recipe, P's interface counters are plain sysfs reads
(``/sys/class/net/<P's veth>/statistics/rx_bytes``, no namespace switch), and every byte
D sends P — side channel and KV reads — crosses the veth, never loopback. P's HTTP stays
on 127.0.0.1; D's HTTP and its sshd listen on D's veth address only.

The pair gets a /24 of 198.18.0.0/15 (reserved for network benchmarks) that overlaps no
route of this namespace; it exists only on the two veth ends. Everything is made from
scratch in a temp dir (sshd config, host key, an authorized client key, known_hosts) and
torn down in reverse order even when a step fails: processes left in D's namespace, sshd,
the veth pair, the namespace.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ``ip`` (iproute2), ``sshd`` and ``ssh-keygen``
(openssh-server / openssh-client); ``ci/provision.d/two-hosts.sh`` installs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bidir_kv.errors import TopologyError
from bidir_kv.launch.process import ManagedProcess, process_tree
from bidir_kv.testing.poll import WaitTimeout, wait_for

__all__ = ["SSHD", "SshAccess", "TwoHosts", "TwoHostsUnavailable", "unavailable_reason"]

SSHD = "/usr/sbin/sshd"
_BENCH_NET = ipaddress.IPv4Network("198.18.0.0/15")
_LOCK = "/run/lock/bidir-kv-two-hosts.lock"


class TwoHostsUnavailable(TopologyError):
    """This machine cannot make the two hosts (not root, a tool missing)."""


def unavailable_reason() -> str | None:
    """Why :class:`TwoHosts` cannot run here, or None."""
    if os.geteuid() != 0:
        return "two hosts need root (network namespaces, veth, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (ci/provision.d/two-hosts.sh)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (Debian's openssh-server; ci/provision.d/two-hosts.sh)"
    return None


def _run(*argv: str) -> str:
    """Run a setup command; a failure raises with the command and its stderr on one line."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        err = " ".join(out.stderr.split()) or f"exit {out.returncode}"
        raise TwoHostsUnavailable(f"{' '.join(argv)}: {err}")
    return out.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of the benchmark range that no route of this namespace overlaps."""
    taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in _run("ip", "-4", "route", "show", "table", "all").splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "blackhole"):
            word = line.split()[1]
        with contextlib.suppress(ValueError):
            taken.append(
                ipaddress.ip_network(word if word != "default" else "0.0.0.0/0", strict=False)
            )
    subnets: list[ipaddress.IPv4Network] = list(_BENCH_NET.subnets(new_prefix=24))
    random.shuffle(subnets)
    for net in subnets:
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise TwoHostsUnavailable("no free /24 in 198.18.0.0/15 for the veth pair")


@dataclass(frozen=True)
class SshAccess:
    """How to log in to D's host: destination plus the client options of the temp dir."""

    host: str
    user: str
    options: tuple[str, ...]  # -F <config>: identity, known_hosts, batch mode, timeouts

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}"


@dataclass
class TwoHosts:
    """``with TwoHosts(tmp) as hosts: hosts.ssh`` — see the module docstring."""

    workdir: Path
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    connect_timeout: float = 20.0
    p_addr: str = ""
    d_addr: str = ""
    spare_addr: str = ""  # in the pair's /24 but on no interface: an unreachable host
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _sshd: ManagedProcess | None = None
    ssh: SshAccess | None = None
    bad_ssh: SshAccess | None = None  # same host, a key sshd does not authorize

    @property
    def d_ns(self) -> str:
        return f"bkv-d-{self.tag}"

    @property
    def p_if(self) -> str:
        """P's end of the veth pair (root namespace): the interface P's reads cross."""
        return f"bkv{self.tag}p"

    @property
    def d_if(self) -> str:
        return f"bkv{self.tag}d"

    def in_d(self, *argv: str) -> list[str]:
        """``argv`` run inside D's namespace."""
        return ["ip", "netns", "exec", self.d_ns, *argv]

    def __enter__(self) -> TwoHosts:
        reason = unavailable_reason()
        if reason:
            raise TwoHostsUnavailable(reason)
        try:
            self._network()
            self._keys()
            self._start_sshd()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ---- network -------------------------------------------------------------------

    def _network(self) -> None:
        _run("ip", "netns", "add", self.d_ns)
        self._stack.callback(self._delete_namespace)
        _run("ip", "link", "add", self.p_if, "type", "veth", "peer", "name", self.d_if)
        self._stack.callback(self._delete_veth)
        _run("ip", "link", "set", self.d_if, "netns", self.d_ns)
        # pick and take the /24 under a lock: pairs made at once (xdist workers) never
        # pick the same one
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = _free_subnet()
            p, d, spare = (str(net[i]) for i in (1, 2, 3))
            self.p_addr, self.d_addr, self.spare_addr = p, d, spare
            _run("ip", "addr", "add", f"{p}/{net.prefixlen}", "dev", self.p_if)
        _run("ip", "link", "set", self.p_if, "up")
        _run(*self.in_d("ip", "addr", "add", f"{d}/{net.prefixlen}", "dev", self.d_if))
        _run(*self.in_d("ip", "link", "set", self.d_if, "up"))
        _run(*self.in_d("ip", "link", "set", "lo", "up"))
        for argv in (
            ("sysctl", "-qw", f"net.ipv6.conf.{self.p_if}.disable_ipv6=1"),
            self.in_d("sysctl", "-qw", f"net.ipv6.conf.{self.d_if}.disable_ipv6=1"),
        ):
            # no IPv6 neighbour discovery on the pair: its counters carry our traffic only
            subprocess.run(argv, capture_output=True, timeout=30)

    def _delete_veth(self) -> None:
        # deleting one end deletes the pair; the far end may already be gone with the ns
        subprocess.run(["ip", "link", "del", self.p_if], capture_output=True, timeout=30)

    def _delete_namespace(self) -> None:
        self.kill_leftovers()
        subprocess.run(["ip", "netns", "del", self.d_ns], capture_output=True, timeout=30)

    def pids_in_d(self) -> list[int]:
        """Processes running in D's namespace (all of them ours: we made it)."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.d_ns], capture_output=True, text=True, timeout=30
        )
        return [int(w) for w in out.stdout.split() if w.isdigit()]

    def wait_ssh_sessions_closed(self, timeout: float = 15.0) -> list[int]:
        """Wait until sshd has no per-connection process left, then return the PIDs in D's
        namespace. A refused login is reported to the client before sshd's connection
        process has exited, so a count taken right after it can see that process; a session
        that never ends (a program still running under it) fails the wait, naming it."""
        sshd = self._sshd
        assert sshd is not None and sshd.pid is not None, "sshd is not running"
        listener = sshd.pid

        def sessions() -> dict[int, str]:
            return {p: s for p, s in process_tree(listener).items() if p != listener}

        wait_for(
            lambda: not sessions(),
            timeout,
            f"sshd's connection processes in {self.d_ns} to exit",
            interval=0.05,
        )
        return self.pids_in_d()

    def kill_leftovers(self) -> list[int]:
        """SIGKILL whatever still runs in D's namespace; returns the PIDs it found."""
        pids = self.pids_in_d()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    # ---- ssh -----------------------------------------------------------------------

    def _keys(self) -> None:
        d = self.workdir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        for name in ("host_key", "client_key", "stranger_key"):
            _run(
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                f"bidir-kv-{name}",
                "-f",
                str(d / name),
            )
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        host_pub = " ".join((d / "host_key.pub").read_text().split()[:2])
        (d / "known_hosts").write_text(f"{self.d_addr} {host_pub}\n")
        for key, name in (("client_key", "ssh_config"), ("stranger_key", "ssh_config_bad")):
            (d / name).write_text(
                "\n".join(
                    [
                        "Host *",
                        f"  IdentityFile {d / key}",
                        "  IdentitiesOnly yes",
                        f"  UserKnownHostsFile {d / 'known_hosts'}",
                        "  StrictHostKeyChecking yes",
                        "  BatchMode yes",
                        "  ConnectTimeout 5",
                        "  ServerAliveInterval 5",
                        "  ServerAliveCountMax 3",
                        "  LogLevel ERROR",
                        "",
                    ]
                )
            )
        user = "root"
        self.ssh = SshAccess(self.d_addr, user, ("-F", str(d / "ssh_config")))
        self.bad_ssh = SshAccess(self.d_addr, user, ("-F", str(d / "ssh_config_bad")))

    def _start_sshd(self) -> None:
        d = self.workdir
        (d / "sshd_config").write_text(
            "\n".join(
                [
                    f"ListenAddress {self.d_addr}:22",
                    f"HostKey {d / 'host_key'}",
                    f"PidFile {d / 'sshd.pid'}",
                    f"AuthorizedKeysFile {d / 'authorized_keys'}",
                    "AllowUsers root",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitUserEnvironment no",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        _run(SSHD, "-t", "-f", str(d / "sshd_config"))
        sshd = ManagedProcess(
            "sshd", self.in_d(SSHD, "-D", "-e", "-f", str(d / "sshd_config")), d / "sshd.log"
        )
        self._sshd = sshd
        sshd.start()
        self._stack.callback(sshd.stop)

        def banner() -> bool:
            if sshd.returncode is not None:
                raise TwoHostsUnavailable(
                    f"sshd in {self.d_ns} exited with code {sshd.returncode}\n{sshd.log_tail()}"
                )
            try:
                with socket.create_connection((self.d_addr, 22), timeout=2) as s:
                    return s.recv(8).startswith(b"SSH-")
            except OSError:
                return False

        try:
            wait_for(banner, self.connect_timeout, f"sshd on {self.d_addr}:22", interval=0.1)
        except WaitTimeout as exc:
            raise TwoHostsUnavailable(f"{exc}\n{sshd.log_tail()}") from None
