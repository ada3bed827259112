"""The local cluster's process management: own process groups, nothing left behind on teardown,
on an exception, on SIGTERM or SIGINT of `chameleonctl` itself, or when a worker's group is
kill -9'd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from chameleond.local.cluster import Child, LocalCluster, wait_for

# A stand-in process tree for the teardown mechanics only: it forks a helper (as torch can) and
# ignores SIGTERM, the worst case teardown has to handle.
STUBBORN = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
        sys.exit(0)
    open(sys.argv[1], "w").write("up")
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once reaped or defunct.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def spawn_stubborn(cluster: LocalCluster, name: str, tmp: Path) -> Child:
    flag = tmp / f"{name}.up"
    child = cluster._spawn(name, [sys.executable, "-c", STUBBORN, str(flag)])
    wait_for(flag.exists, 10, f"{name} to start")
    time.sleep(0.1)
    return child


def test_teardown_kills_whole_groups_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, job="t", workers=[])
    with cluster:
        kids = [spawn_stubborn(cluster, f"c{i}", tmp_path) for i in range(2)]
        groups = {k.pid: group_members(k.pid or 0) for k in kids}
        assert all(len(m) == 2 for m in groups.values())  # leader + forked helper
        cluster.workers.update({k.name: k for k in kids})
        redis_pid = cluster.redis.proc.pid if cluster.redis and cluster.redis.proc else 0
        assert alive(redis_pid)
        t = time.monotonic()
        cluster.stop(grace=0.5)
        assert time.monotonic() - t < 5
    for members in groups.values():
        assert not any(alive(p) for p in members)
    assert not alive(redis_pid)


def test_exception_inside_the_cluster_tears_down(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, job="t", workers=[])
    members: list[int] = []
    with pytest.raises(RuntimeError, match="boom"), cluster:
        kid = spawn_stubborn(cluster, "c0", tmp_path)
        cluster.workers["c0"] = kid
        members = group_members(kid.pid or 0)
        raise RuntimeError("boom")
    assert members and not any(alive(p) for p in members)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_controller_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    # A controller process runs a cluster with one stubborn child, then gets the signal. It starts
    # with SIGINT ignored, as a shell script's background command does: Python then raises no
    # KeyboardInterrupt of its own, and the cluster's handler is what stops it.
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from chameleond.local.cluster import LocalCluster, Interrupted
        from test_local_cluster import spawn_stubborn
        tmp = Path({str(tmp_path)!r})
        try:
            with LocalCluster(tmp, job="t", workers=[]) as c:
                k = spawn_stubborn(c, "c0", tmp)
                c.workers["c0"] = k
                (tmp / "pids").write_text(f"{{k.pid}} {{c.redis.proc.pid}}")
                time.sleep(600)
        except (Interrupted, KeyboardInterrupt):
            sys.exit(3)
        """
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
    try:
        ctl = subprocess.Popen([sys.executable, "-c", script])
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for((tmp_path / "pids").exists, 20, "the controller's cluster")
        child_pid, redis_pid = map(int, (tmp_path / "pids").read_text().split())
        members = group_members(child_pid)
        ctl.send_signal(sig)
        assert ctl.wait(timeout=30) == 3
        wait_for(lambda: not any(alive(p) for p in [*members, redis_pid]), 5, "teardown")
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
