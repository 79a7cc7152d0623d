"""Hosts on one machine: each a network, mount and pid namespace of its own, joined by a bridge.

A :class:`Hosts` (a context manager) makes a Linux bridge and, per host, a
network namespace with a veth pair into the bridge, an address in
198.18.0.0/15 (reserved for network testing; it exists only on this bridge,
which has no address of its own and no route anywhere), and a long-lived init
process in a new mount and pid namespace. The init mounts a private tmpfs on
``/dev/shm`` and on ``/tmp`` (mount propagation private, so nothing leaks to
the machine), then reaps orphans as a pid 1 does. Every process of a host is
started inside all three namespaces (``nsenter`` into the init): it sees its
own loopback, ``/dev/shm``, ``/tmp`` and processes only. Killing the init
with SIGKILL kills every process of the host at once, as losing the machine
does; its tmpfs mounts go with the last process.

Teardown kills every host, deletes the namespaces, the veth pairs and the
bridge, and checks that none of them (nor any process that ran in a host)
is left: :meth:`Hosts.leftovers`.

Needs root, util-linux's ``unshare`` and ``nsenter`` and iproute2's ``ip``;
:func:`why_not` says what is missing.

Example:
    with Hosts(prefix="rtsh") as hosts:
        head = hosts.add()
        print(head.run(["hostname", "-I"]).stdout)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

NETWORK = "198.18.0"
"""The hosts' /24, inside 198.18.0.0/15 (RFC 2544, network testing): host n is ``198.18.0.n``."""
PREFIX_LEN = 24

# The init of a host, run as pid 1 of the host's new pid namespace (inside its mount namespace):
# private tmpfs on /dev/shm and /tmp, "ready" on stdout, then reap orphans until killed.
_INIT = r"""
import os, subprocess, sys, time
for target, size in (("/dev/shm", "4g"), ("/tmp", "2g")):
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", target], check=True)
print("ready", flush=True)
sys.stdout.close()
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
    except InterruptedError:
        pass
"""


def why_not() -> str | None:
    """Why hosts cannot be made on this machine, or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network, mount and pid namespaces, a bridge)"
    repo = Path(__file__).resolve().parents[2]
    for private in ("/tmp", "/dev/shm"):
        if repo.is_relative_to(private):
            return f"the repository is under {private}, which each host mounts a tmpfs of its own on"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} on PATH (iproute2, util-linux)"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "sh", "-c",
         "mount -t tmpfs tmpfs /dev/shm && echo $$"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        return f"unshare --net --mount --pid does not work here: {probe.stderr.strip()[:300]}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def cmdline(pid: int) -> str:
    """The command line of ``pid`` as one string ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Host:
    """One host: its name, address, namespaces and init process.

    Attributes:
        index: Its number (1, 2, ...); its address is ``198.18.0.<index>``.
        name: ``<prefix><index>``: the network namespace's name.
        address: Its IPv4 address on the bridge.
        init_pid: Its init's pid as this machine sees it (pid 1 inside the host).
    """

    def __init__(self, hosts: Hosts, index: int) -> None:
        self.index = index
        self.name = f"{hosts.prefix}{index}"
        self.address = f"{NETWORK}.{index}"
        self._env = hosts.env
        self._seen = hosts._seen_in_shm
        self._cwd = hosts.cwd
        self._veth = f"{hosts.prefix}v{index}"
        self._bridge = hosts.bridge
        self._init: subprocess.Popen[str] | None = None
        self.init_pid = 0
        self._pid_ns: int | None = None
        self.killed = False

    def _start(self) -> None:
        """Make the network namespace, its veth pair and address, and the init in new mount/pid namespaces."""
        _ip("netns", "add", self.name)
        _ip("link", "add", self._veth, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        _ip("link", "set", self._veth, "master", self._bridge)
        _ip("link", "set", self._veth, "up")
        _ip("-n", self.name, "addr", "add", f"{self.address}/{PREFIX_LEN}", "dev", "eth0")
        _ip("-n", self.name, "link", "set", "eth0", "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        # No default route: from a host, only the bridge's /24 and its own loopback are reachable.
        self._init = subprocess.Popen(
            ["ip", "netns", "exec", self.name,
             "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
             "--mount-proc", sys.executable, "-c", _INIT],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        assert self._init.stdout is not None
        line = self._init.stdout.readline().strip()
        if line != "ready":
            err = self._init.stderr.read() if self._init.poll() is not None and self._init.stderr else ""
            raise RuntimeError(f"host {self.name}: init did not start ({line!r}, {err.strip()[:500]})")
        self.init_pid = self._find_init()
        self._pid_ns = _ns_inode(self.init_pid, "pid")

    def _find_init(self) -> int:
        """The pid of unshare's child (the host's pid 1), as this machine sees it."""
        assert self._init is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/status") as f:
                        status = f.read()
                except OSError:
                    continue
                fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                if fields.get("PPid", "").strip() == str(self._init.pid) and fields.get("NSpid", "").split()[
                    -1:
                ] == ["1"]:
                    return int(entry)
            time.sleep(0.05)
        raise RuntimeError(f"host {self.name}: no pid 1 found under unshare (pid {self._init.pid})")

    def command(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` run inside this host (its network, mount and pid namespaces)."""
        if self.killed:
            raise RuntimeError(f"host {self.name} was killed")
        return [
            "nsenter", f"--target={self.init_pid}", "--net", "--mount", "--pid",
            f"--wd={cwd or self._cwd}", "--", *argv,
        ]  # fmt: skip

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 300,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this host and wait for it; output captured as text."""
        return subprocess.run(
            self.command(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self._env, **(env or {})},
            check=check,
            stdin=subprocess.DEVNULL,
        )

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` in this host; the caller waits for it."""
        return subprocess.Popen(
            self.command(argv), env={**self._env, **(env or {})}, stdin=subprocess.DEVNULL, **kwargs
        )

    def inner_pid(self, proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
        """The pid (as this machine sees it) of the process that ``proc`` (an ``nsenter`` of
        :meth:`popen`) started in the host: ``nsenter`` forks it into the pid namespace and waits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == proc.pid:
                    return int(entry)
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}: {proc.args} exited (code {proc.returncode})")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: no process under nsenter {proc.pid}")

    def path(self, inside: str) -> Path:
        """Where ``inside`` (an absolute path in this host's mount namespace) is seen from this machine."""
        return Path(f"/proc/{self.init_pid}/root") / inside.lstrip("/")

    def shm(self) -> list[str]:
        """The entries of this host's own /dev/shm (each name is also kept in :meth:`Hosts.seen_in_shm`)."""
        names = sorted(os.listdir(self.path("/dev/shm")))
        self._seen.update(names)
        return names

    def pids(self) -> list[int]:
        """The processes running in this host (pids as this machine sees them), its init included."""
        if self._pid_ns is None:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _ns_inode(int(entry), "pid") == self._pid_ns:
                found.append(int(entry))
        return sorted(found)

    def processes(self, word: str) -> list[int]:
        """This host's processes whose command line contains ``word``."""
        return [pid for pid in self.pids() if word in cmdline(pid)]

    def kill(self, timeout_s: float = 30.0, link_down: bool = True) -> None:
        """Lose the host: SIGKILL its pid 1 (the kernel kills every process of the namespace with it).

        With ``link_down`` its link goes down too, so that nothing answers at its address any more
        (a machine gone); without, its address still answers, refusing connections (its processes gone).
        """
        if self.killed:
            return
        self.killed = True
        if link_down:
            _ip("link", "set", self._veth, "down", check=False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._init is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._init.wait(timeout=10)
        left = self.pids()
        if left:
            raise RuntimeError(f"host {self.name}: processes outlived its pid namespace: {left}")

    def _remove(self) -> None:
        """Kill (if not yet) and delete the network namespace and veth pair."""
        try:
            self.kill()
        finally:
            if self._init is not None and self._init.poll() is None:
                self._init.kill()
                self._init.wait(10)
            for stream in (self._init.stdout, self._init.stderr) if self._init else ():
                if stream is not None:
                    stream.close()
            _ip("link", "del", self._veth, check=False)
            _ip("netns", "del", self.name, check=False)


class Hosts:
    """A bridge and the hosts on it (see the module docstring); a context manager.

    Args:
        prefix: Names of everything made here start with it (namespaces, links, the bridge).
        env: The environment of every process started in a host.
        cwd: Their working directory (a path this machine and every host see).
    """

    def __init__(self, prefix: str = "rtsh", env: Mapping[str, str] | None = None, cwd: str = "/") -> None:
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.hosts: list[Host] = []
        self._made_bridge = False
        self._seen_in_shm: set[str] = set()

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the bridge (removing one left by an earlier run of the same prefix first)."""
        self._remove_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", self.bridge, "up")

    def add(self) -> Host:
        """A new host on the bridge: the next free index."""
        host = Host(self, len(self.hosts) + 1)
        self.hosts.append(host)
        host._start()
        return host

    def close(self) -> None:
        """Kill every host, delete namespaces, links and the bridge."""
        errors = []
        for host in reversed(self.hosts):
            try:
                host._remove()
            except Exception as e:  # go on: everything else must still go
                errors.append(f"{host.name}: {e}")
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        if errors:
            raise RuntimeError("hosts teardown: " + "; ".join(errors))

    def seen_in_shm(self) -> set[str]:
        """Every name :meth:`Host.shm` listed in any host's /dev/shm."""
        return set(self._seen_in_shm)

    def leftovers(self) -> list[str]:
        """What of these hosts is still on the machine (namespaces, links, processes); empty once clean."""
        left = []
        names = {h.name for h in self.hosts}
        netns = _ip("netns", "list", check=False).stdout.split()
        left += [f"network namespace {n}" for n in netns if n in names]
        links = _ip("-o", "link", "show", check=False).stdout
        for line in links.splitlines():
            name = line.split(":", 2)[1].strip().split("@")[0] if ":" in line else ""
            if name == self.bridge or any(name == h._veth for h in self.hosts):
                left.append(f"link {name}")
        for host in self.hosts:
            left += [f"process {pid} of {host.name}: {cmdline(pid)[:200]}" for pid in host.pids()]
        return left

    def _remove_stale(self) -> None:
        """Remove namespaces and links of this prefix left by an earlier run that was killed."""
        for name in _ip("netns", "list", check=False).stdout.split():
            if name.startswith(self.prefix) and name[len(self.prefix) :].isdigit():
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _ip("netns", "del", name, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":", 2)[1].strip().split("@")[0] if ":" in line else ""
            if name == self.bridge or (
                name.startswith(f"{self.prefix}v") and name[len(self.prefix) + 1 :].isdigit()
            ):
                _ip("link", "del", name, check=False)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)
