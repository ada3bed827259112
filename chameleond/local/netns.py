"""Hosts that are really separate: each host a Linux network namespace with its own address.

`Hosts(["a", "b"])` builds a bridge in the root namespace with the .1 address of a /24 of its own
(bind Redis and the daemon there: `bridge_address`), and per host a namespace whose veth is a port
of that bridge, with the host's address, lo up and a default route via the bridge. Traffic between
hosts, and between a host and the root namespace, crosses the bridge, so a host's link can be cut
(`partition`: the root-side veth goes down, established connections stall with no RST) or slowed
(`slow_link`: netem, or a token bucket where the kernel has no netem, on both ends of the veth).
Processes run inside a host through `ip netns exec` and `kill_host` kill -9s every one of them.

Names carry the creating pid and a per-process counter, and the subnet is chosen under a lock and
checked against the addresses and routes already on this machine, so concurrent test processes do
not collide; whatever an earlier, dead process left behind is removed first. Needs root.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

NAMESPACE_PREFIX = "chm"  # chm{pid}-{counter}-{host}
BRIDGE_PREFIX = "cb"  # cb{pid:5 base36}{counter:2 base36}: at most 15 characters, as Linux wants
VETH_PREFIX = "cv"  # cv{pid}{counter}{host index:2 base36}, the root side; the inner side is eth0
INNER_DEVICE = "eth0"
NETNS_DIR = Path("/run/netns")
HOST_NAME = re.compile(r"^[A-Za-z0-9_]{1,32}$")
MAX_HOSTS = 253  # .2 .. .254 of the /24
KILL_ROUNDS = 50  # kill_host repeats while processes fork faster than they die
CHECK_SECONDS = 3.0  # a connect across a fresh bridge takes milliseconds
CLONE_NEWNET = 0x40000000
ENTER_SECONDS = 10.0  # popen waits at most this long for `ip netns exec` to enter the namespace
FIREWALL_HINT = (
    "; this machine passes bridged frames to iptables (net.bridge.bridge-nf-call-iptables=1):"
    " if its firewall drops them, accept FORWARD and INPUT on the bridge"
)


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed: the command and what it said."""


def _base36(value: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while value:
        value, rest = divmod(value, 36)
        out = digits[rest] + out
    return out.rjust(width, "0")[-width:]


def instance_tag(pid: int, counter: int) -> str:
    """Seven characters naming one `Hosts` of one process (pids fit in five base-36 digits)."""
    return _base36(pid, 5) + _base36(counter, 2)


def candidate_subnets(pid: int) -> Iterator[ipaddress.IPv4Network]:
    """10.(200 + pid % 50).N.0/24 for N = 0..255, then the other second octets: where to look."""
    for offset in range(50):
        second = 200 + (pid + offset) % 50
        for third in range(256):
            yield ipaddress.IPv4Network(f"10.{second}.{third}.0/24")


def first_free_subnet(
    pid: int, used: Sequence[ipaddress.IPv4Network]
) -> ipaddress.IPv4Network | None:
    for subnet in candidate_subnets(pid):
        if not any(subnet.overlaps(taken) for taken in used):
            return subnet
    return None


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(  # noqa: S603 - iproute2 argv built here, no shell
        list(argv), capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network with an address, or a route of /16 or narrower, in the root namespace."""
    used: list[ipaddress.IPv4Network] = []
    for line in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
        target = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):  # "default", "local ...", "broadcast ..."
            network = ipaddress.IPv4Network(target, strict=False)
            if network.prefixlen >= 16:  # broader routes (a VPN's 10/8) are only shadowed
                used.append(network)
    return used


@contextlib.contextmanager
def _allocation_lock() -> Iterator[None]:
    """Serialises subnet choice and bridge creation between processes of this machine."""
    directory = (
        Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path(tempfile.gettempdir())
    )
    with open(directory / "chameleond-netns.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def namespace_pids(namespace: str) -> list[int]:
    """Every live process whose network namespace is `namespace` (what `ip netns pids` reads)."""
    try:
        target = os.stat(NETNS_DIR / namespace)
    except FileNotFoundError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            inside = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a zombie whose namespaces are already released
            continue
        if (inside.st_dev, inside.st_ino) == (target.st_dev, target.st_ino):
            found.append(int(entry))
    return sorted(found)


def kill_namespace(namespace: str) -> int:
    """SIGKILL every process in the namespace, again while new ones appear; how many were killed."""
    killed: set[int] = set()
    for _ in range(KILL_ROUNDS):
        pids = [pid for pid in namespace_pids(namespace) if pid != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
    return len(killed)


def _owner_of_bridge(name: str) -> int | None:
    """The pid that made a bridge of ours (`Hosts` or the probe of `unavailable`), else None."""
    if re.fullmatch(rf"{BRIDGE_PREFIX}[0-9a-z]{{7}}", name):
        return int(name[len(BRIDGE_PREFIX) : len(BRIDGE_PREFIX) + 5], 36)
    probe = re.fullmatch(rf"{BRIDGE_PREFIX}-p(\d+)", name)
    return int(probe.group(1)) if probe else None


def _sweep_dead_owners() -> None:
    """Remove the namespaces and bridges of processes that died without closing their `Hosts`."""
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        namespace = line.split()[0] if line.split() else ""
        owner = re.match(rf"^{NAMESPACE_PREFIX}(\d+)-", namespace)
        if owner and not _pid_alive(int(owner.group(1))):
            kill_namespace(namespace)
            _run(["ip", "netns", "del", namespace], check=False)
    for line in _run(["ip", "-o", "link", "show", "type", "bridge"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner_pid = _owner_of_bridge(name)
        if owner_pid is not None and not _pid_alive(owner_pid):
            _run(["ip", "link", "del", name], check=False)


def socket_in(namespace: str | None) -> socket.socket:
    """A TCP socket of the named network namespace (None: this process's own). It is made on a
    short-lived thread that enters the namespace, so the calling thread never leaves its own."""
    if namespace is None:
        return socket.socket()
    made: list[socket.socket | OSError] = []

    def enter_and_make() -> None:
        try:
            handle = os.open(NETNS_DIR / namespace, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(handle, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            finally:
                os.close(handle)
            made.append(socket.socket())
        except OSError as error:
            made.append(error)

    thread = threading.Thread(target=enter_and_make, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (probed once)."""
    if not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces on this system"
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2) on PATH"
    probe = f"{NAMESPACE_PREFIX}{os.getpid()}-probe"
    bridge, veth = f"{BRIDGE_PREFIX}-p{os.getpid()}", f"{VETH_PREFIX}-p{os.getpid()}"
    try:
        for argv in (
            ["ip", "netns", "add", probe],
            ["ip", "link", "add", bridge, "type", "bridge"],
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "p0", "netns", probe],
            ["ip", "link", "set", veth, "master", bridge],
        ):
            done = _run(argv, check=False)
            if done.returncode != 0:
                return f"`{' '.join(argv)}` failed: {done.stderr.strip()}"
        return None
    finally:
        _run(["ip", "link", "del", veth], check=False)
        _run(["ip", "link", "del", bridge], check=False)
        _run(["ip", "netns", "del", probe], check=False)


@functools.lru_cache(maxsize=1)
def _bridged_traffic_filtered() -> bool:
    """Whether br_netfilter hands this machine's bridged IPv4 frames to iptables' FORWARD chain."""
    try:
        return Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"
    except OSError:
        return False


class Hosts:
    """A bridge and one namespace per host name; a context manager whose exit is `close()`."""

    _counter = itertools.count()

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) <= MAX_HOSTS:
            raise ValueError(f"host names must be 1..{MAX_HOSTS} distinct names, not {names!r}")
        for name in names:
            if not HOST_NAME.match(name):
                raise ValueError(f"host name {name!r}: use letters, digits and _ (at most 32)")
        self.names = list(names)
        self._closed = False
        self._namespaces: dict[str, str] = {}
        self._veths: dict[str, str] = {}
        self._addresses: dict[str, str] = {}
        self._netem: bool | None = None
        self._firewall_rule: list[str] | None = None
        self.bridge = ""
        self.bridge_address = ""
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        pid = os.getpid()
        with _allocation_lock():
            _sweep_dead_owners()
            links = _run(["ip", "-o", "link", "show"]).stdout
            namespaces = _run(["ip", "netns", "list"]).stdout
            counter = next(self._counter)  # skip names a dead process with our pid left behind
            while f" {BRIDGE_PREFIX}{instance_tag(pid, counter)}:" in links or re.search(
                rf"^{NAMESPACE_PREFIX}{pid}-{counter}-", namespaces, re.MULTILINE
            ):
                counter = next(self._counter)
            subnet = first_free_subnet(pid, _used_networks())
            if subnet is None:
                raise NetnsError("no free /24 left in 10.200.0.0 - 10.249.255.0")
            tag = instance_tag(pid, counter)
            self.bridge = f"{BRIDGE_PREFIX}{tag}"
            hosts = list(subnet.hosts())
            self.bridge_address = str(hosts[0])
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        self._open_firewall()
        for index, name in enumerate(self.names):
            namespace = f"{NAMESPACE_PREFIX}{pid}-{counter}-{name}"
            veth = f"{VETH_PREFIX}{tag}{_base36(index, 2)}"
            address = str(hosts[index + 1])
            _run(["ip", "netns", "add", namespace])
            self._namespaces[name] = namespace
            peer = ["peer", "name", INNER_DEVICE, "netns", namespace]
            _run(["ip", "link", "add", veth, "type", "veth", *peer])
            self._veths[name] = veth
            inside = ["ip", "-n", namespace]
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run([*inside, "link", "set", "lo", "up"])
            _run([*inside, "addr", "add", f"{address}/24", "dev", INNER_DEVICE])
            _run([*inside, "link", "set", INNER_DEVICE, "up"])
            _run([*inside, "route", "add", "default", "via", self.bridge_address])
            self._addresses[name] = address
        self._check_bridged_traffic()

    def _check_bridged_traffic(self) -> None:
        """Connect from the first host to the second across the bridge, and from the root
        namespace to the first host: a firewall that drops either is named here, not by a test
        that hangs later."""
        first, *others = self.names
        paths = [(others[0], self.namespace(first)), (first, None)] if others else [(first, None)]
        for listening, client_namespace in paths:
            address = self.address(listening)
            with (
                socket_in(self.namespace(listening)) as listener,
                socket_in(client_namespace) as client,
            ):
                listener.bind((address, 0))
                listener.listen()
                client.settimeout(CHECK_SECONDS)
                try:
                    client.connect(listener.getsockname())
                except OSError as error:
                    where = f"from {client_namespace or 'the root namespace'} to {address}"
                    hint = FIREWALL_HINT if _bridged_traffic_filtered() else ""
                    raise NetnsError(
                        f"TCP {where} over {self.bridge} failed: {error}{hint}"
                    ) from error

    def _open_firewall(self) -> None:
        """Where br_netfilter would send this bridge's frames through iptables, accept them there
        (a FORWARD policy of DROP, as Docker sets, would otherwise cut host-to-host traffic)."""
        if not _bridged_traffic_filtered() or shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _run(["iptables", "-w", "-I", *rule])
        self._firewall_rule = rule

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _known(self, host: str) -> str:
        if host not in self._namespaces:
            raise KeyError(f"no host {host!r} (hosts: {', '.join(self.names)})")
        return host

    def address(self, host: str) -> str:
        """The host's address: its veth inside its namespace."""
        return self._addresses[self._known(host)]

    def namespace(self, host: str) -> str:
        """The host's namespace name, for `ip netns exec`."""
        return self._namespaces[self._known(host)]

    def veth(self, host: str) -> str:
        """The root-namespace end of the host's link (a port of the bridge)."""
        return self._veths[self._known(host)]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv run inside the host: same user, environment and working directory."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside the host; keyword arguments go to subprocess.Popen (env, cwd, stdout
        ...). `ip netns exec` execs argv, so the Popen's pid is the process itself. Returns once
        the process is in the namespace, so a kill_host or close right after reaches it."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)  # noqa: S603 - no shell
        target = os.stat(NETNS_DIR / self.namespace(host))
        deadline = time.monotonic() + ENTER_SECONDS
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                inside = os.stat(f"/proc/{proc.pid}/ns/net")
                if (inside.st_dev, inside.st_ino) == (target.st_dev, target.st_ino):
                    break
            time.sleep(0.001)
        return proc

    def pids(self, host: str) -> list[int]:
        """Every live process in the host's namespace."""
        return namespace_pids(self.namespace(host))

    def kill_host(self, host: str) -> int:
        """kill -9 every process of the host at once (as when the machine dies); how many."""
        return kill_namespace(self.namespace(host))

    def partition(self, host: str) -> None:
        """Pull the host's cable: its bridge port goes down, packets to and from it are dropped
        without a reset, so connections stall and connects time out."""
        _run(["ip", "link", "set", self.veth(host), "down"])

    def heal(self, host: str) -> None:
        """Plug it back in; the host's address and default route were never removed."""
        _run(["ip", "link", "set", self.veth(host), "up"])

    def slow_link(
        self, host: str, *, rate_mbit: float, delay_ms: float = 0.0, loss_percent: float = 0.0
    ) -> None:
        """Limit the host's link to rate_mbit each way, with delay_ms added per direction and
        loss_percent of packets lost per direction. netem does it; on a kernel without netem the
        rate alone is kept by a token bucket (tbf), and delay or loss is an error."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, not {rate_mbit}")
        if self._netem is None:
            self._netem = self._qdisc(host, ["netem", "rate", f"{rate_mbit}mbit"], check=False)
        if self._netem:
            shape = ["netem", "rate", f"{rate_mbit}mbit", "limit", "100000"]
            shape += ["delay", f"{delay_ms}ms"] if delay_ms else []
            shape += ["loss", f"{loss_percent}%"] if loss_percent else []
        elif delay_ms or loss_percent:
            raise NetnsError("this kernel has no netem qdisc (sch_netem): delay and loss need it")
        else:
            rate_bytes = rate_mbit * 1e6 / 8
            burst = max(int(rate_bytes / 100), 16 * 1024)  # 10 ms of traffic, at least 16 KiB
            shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "500ms"]
        self._qdisc(host, shape)

    def restore_link(self, host: str) -> None:
        """Remove what slow_link set: the link is as fast as the machine again."""
        for tc, device in self._link_ends(host):
            _run([*tc, "qdisc", "del", "dev", device, "root"], check=False)  # none there is fine

    def _link_ends(self, host: str) -> list[tuple[list[str], str]]:
        """The tc command and the device for each end of the host's veth: root side, inner side."""
        return [(["tc"], self.veth(host)), (["tc", "-n", self.namespace(host)], INNER_DEVICE)]

    def _qdisc(self, host: str, shape: list[str], *, check: bool = True) -> bool:
        """Set `shape` as the root qdisc on both ends of the host's veth; whether both took it."""
        for tc, device in self._link_ends(host):
            done = _run([*tc, "qdisc", "replace", "dev", device, "root", *shape], check=check)
            if done.returncode != 0:
                return False
        return True

    def close(self) -> None:
        """Kill every process left in the namespaces, delete them, their links and the bridge.
        Idempotent; also run at interpreter exit for a test that never got to call it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for namespace in self._namespaces.values():
            kill_namespace(namespace)
        for veth in self._veths.values():
            _run(["ip", "link", "del", veth], check=False)
        for namespace in self._namespaces.values():
            _run(["ip", "netns", "del", namespace], check=False)
        if self.bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
        if self._firewall_rule:
            _run(["iptables", "-w", "-D", *self._firewall_rule], check=False)
