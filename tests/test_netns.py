"""Hosts as network namespaces (chameleond/local/netns.py): real namespaces, veths and a bridge,
real TCP between them, a cut and a slowed link, kill -9 of a host and the clean-up after a crash."""

from __future__ import annotations

import ipaddress
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from chameleond.local import netns
from chameleond.local.netns import Hosts

MEGABYTE = 1_000_000

# Inside a host: listens on argv[1], prints its port, then per connection by the first byte:
# "e": one "!" back for every "?" received (anything else is discarded); "d": sends MEGABYTE
# bytes and closes; "u": reads MEGABYTE bytes and answers "!".
SERVER = r"""
import socket, sys, threading
MEGABYTE = 1_000_000
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def serve(conn):
    with conn:
        mode = conn.recv(1)
        if mode == b"d":
            conn.sendall(b"x" * MEGABYTE)
        elif mode == b"u":
            left = MEGABYTE
            while left > 0:
                left -= len(conn.recv(65536))
            conn.sendall(b"!")
        while mode == b"e":
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(b"!" * data.count(b"?"))
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""

# Inside a host: connects to argv[1]:argv[2] with a timeout of argv[3] seconds, says how it went.
CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timeout")
except OSError as error:
    print(type(error).__name__, error)
"""


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with Hosts(["a", "b", "c"]) as made:
        yield made


def start_server(hosts: Hosts, host: str) -> tuple[subprocess.Popen[str], int]:
    server = hosts.popen(
        host, [sys.executable, "-c", SERVER, hosts.address(host)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    return server, int(server.stdout.readline())


def connect_from(hosts: Hosts, host: str, address: str, port: int, timeout: float) -> str:
    argv = [sys.executable, "-c", CONNECT, address, str(port), str(timeout)]
    done = subprocess.run(
        hosts.command(host, argv), capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.strip()


def ip_output(*argv: str) -> str:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True).stdout


def wait_for(received: bytes, conn: socket.socket, timeout: float) -> None:
    conn.settimeout(timeout)
    assert conn.recv(len(received)) == received


def test_each_host_has_its_own_address_inside_its_namespace(hosts: Hosts) -> None:
    addresses = {name: hosts.address(name) for name in hosts.names}
    assert len(set(addresses.values()) | {hosts.bridge_address}) == 4
    for name, address in addresses.items():
        inside = ip_output("-n", hosts.namespace(name), "-o", "-4", "addr", "show")
        assert f"inet {address}/24" in inside
        assert hosts.bridge_address not in inside
        route = ip_output("-n", hosts.namespace(name), "route", "show", "default")
        assert f"via {hosts.bridge_address}" in route
    assert f"inet {hosts.bridge_address}/24" in ip_output("-o", "-4", "addr", "show")


def test_tcp_between_hosts_and_the_bridge(hosts: Hosts) -> None:
    server, port = start_server(hosts, "a")
    assert connect_from(hosts, "b", hosts.address("a"), port, 5) == "connected"
    with socket.create_connection((hosts.address("a"), port), timeout=5) as conn:
        conn.sendall(b"e??")
        conn.settimeout(5)
        assert conn.recv(2) in (b"!!", b"!")
    with socket.create_server((hosts.bridge_address, 0)) as listener:
        listener.settimeout(10)
        reached = connect_from(hosts, "c", hosts.bridge_address, listener.getsockname()[1], 5)
        assert reached == "connected"
        peer = listener.accept()
        peer[0].close()
        assert peer[1][0] == hosts.address("c")
    server.kill()
    server.wait()


def test_partition_stalls_connections_and_heal_resumes_them(hosts: Hosts) -> None:
    server, port = start_server(hosts, "a")
    conn = socket.create_connection((hosts.address("a"), port), timeout=5)
    conn.sendall(b"e?")
    wait_for(b"!", conn, 5)

    hosts.partition("a")
    assert connect_from(hosts, "b", hosts.address("a"), port, 1) == "timeout"
    conn.sendall(b"?")
    with pytest.raises(TimeoutError):
        wait_for(b"!", conn, 1)
    conn.settimeout(1)
    with pytest.raises(TimeoutError):  # the send buffer fills and stays full: no reset
        conn.sendall(bytes(64 * MEGABYTE))

    hosts.heal("a")
    assert f"via {hosts.bridge_address}" in ip_output(
        "-n", hosts.namespace("a"), "route", "show", "default"
    )
    wait_for(b"!", conn, 15)  # the same connection carries on
    assert connect_from(hosts, "b", hosts.address("a"), port, 5) == "connected"
    conn.close()
    server.kill()
    server.wait()


def transfer_seconds(hosts: Hosts, port: int, mode: bytes) -> float:
    started = time.monotonic()
    with socket.create_connection((hosts.address("a"), port), timeout=20) as conn:
        conn.sendall(mode)
        if mode == b"u":
            conn.sendall(b"x" * MEGABYTE)
            assert conn.recv(1) == b"!"
        else:
            received = 0
            while chunk := conn.recv(65536):
                received += len(chunk)
            assert received == MEGABYTE
    return time.monotonic() - started


def test_slow_link_limits_both_directions_and_restore_link_lifts_it(hosts: Hosts) -> None:
    server, port = start_server(hosts, "a")
    hosts.slow_link("a", rate_mbit=8)
    assert transfer_seconds(hosts, port, b"d") >= 0.8  # 1 MB at 1 MB/s, out of the host
    assert transfer_seconds(hosts, port, b"u") >= 0.8  # and into it
    hosts.restore_link("a")
    assert transfer_seconds(hosts, port, b"d") < 0.4
    assert transfer_seconds(hosts, port, b"u") < 0.4
    server.kill()
    server.wait()


def test_kill_host_kills_every_process_of_that_host_only(hosts: Hosts) -> None:
    sleeps = [hosts.popen("a", ["sleep", "60"]) for _ in range(3)]
    spared = hosts.popen("b", ["sleep", "60"])
    grandchild = hosts.popen("a", ["sh", "-c", "sleep 60 & wait"])
    deadline = time.monotonic() + 10
    while len(hosts.pids("a")) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(hosts.pids("a")) >= {proc.pid for proc in [*sleeps, grandchild]}
    assert len(hosts.pids("a")) == 5

    assert hosts.kill_host("a") == 5
    assert [proc.wait(5) for proc in [*sleeps, grandchild]] == [-signal.SIGKILL] * 4
    assert hosts.pids("a") == []
    assert hosts.pids("b") == [spared.pid] and spared.poll() is None
    spared.kill()
    spared.wait()


def test_close_removes_namespaces_links_and_processes() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts(["x", "y"])
    sleeper = made.popen("y", ["sleep", "60"])
    namespaces = [made.namespace("x"), made.namespace("y")]
    links = [made.bridge, made.veth("x"), made.veth("y")]
    made.close()
    made.close()
    assert sleeper.wait(5) == -signal.SIGKILL
    listed = ip_output("netns", "list").split()
    assert not set(namespaces) & set(listed)
    link_names = {
        line.split(":")[1].strip().split("@")[0] for line in ip_output("-o", "link").splitlines()
    }
    assert not set(links) & link_names


CRASHING_OWNER = r"""
import os, signal, subprocess
from chameleond.local.netns import Hosts
made = Hosts(["z"])
made.popen("z", ["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(made.namespace("z"), made.bridge, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_new_instance_removes_what_a_killed_process_left() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_OWNER], capture_output=True, text=True, timeout=30
    )
    assert crashed.returncode == -signal.SIGKILL
    namespace, bridge = crashed.stdout.split()
    assert namespace in ip_output("netns", "list")
    with Hosts(["a"]):
        assert namespace not in ip_output("netns", "list")
        assert bridge not in ip_output("-o", "link")


def test_a_subnet_in_use_on_this_machine_is_skipped() -> None:
    pid = 4242  # 10.(200 + 4242 % 50) = 10.242
    taken = [netns.first_free_subnet(pid, [])]
    assert str(taken[0]) == "10.242.0.0/24"
    used = [ipaddress.IPv4Network("10.242.0.0/24"), ipaddress.IPv4Network("10.242.1.128/25")]
    assert str(netns.first_free_subnet(pid, used)) == "10.242.2.0/24"
    assert netns.first_free_subnet(pid, [ipaddress.IPv4Network("10.0.0.0/8")]) is None
