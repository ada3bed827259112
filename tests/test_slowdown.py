"""Fail-slow injection: a real process duty-cycled to a fraction of its speed (SIGSTOP/SIGCONT),
applied by `chameleonctl up --faults slow:...` and, through the job's signed `slow` hash, by the
worker's chameleon-agent.

A busy-loop child counts into a shared file, so the work it does is read directly; a slowed one
is measured side by side with an unslowed one started with it."""

from __future__ import annotations

import json
import math
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from cli_harness import chameleonctl
from daemon_harness import wait_for

from chameleond.agent.run import status_of
from chameleond.auth import Keyring, new_secret_file
from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.local.faults import Fault, FaultSpecError, parse_faults
from chameleond.local.slowdown import Slowdown, cpu_seconds, pause_for
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

# Counts as fast as it can, publishing the count into the file of argv[1] every 2**14 iterations.
COUNTER = """
import mmap, struct, sys
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 8)
n = 0
while True:
    n += 1
    if n & 0x3FFF == 0:
        m[:8] = struct.pack("q", n)
"""
JOB = "slow"
HOST = "localhost"  # the host of the packaged spec's workers
# A worker that computes a little in every 20 ms (a slowdown charges the CPU time it spends).
SLEEPER = """
import json, os, sys, time
me = os.environ["CHAMELEON_WORKER_ID"]
with open(os.path.join(sys.argv[1], me + ".pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass
    time.sleep(0.01)
"""


def state(pid: int) -> str:
    """The process's state letter: R running, S sleeping, T stopped, Z zombie."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextmanager
def counter(tmp_path: Path, name: str) -> Iterator[tuple[int, Callable[[], int]]]:
    """A busy-loop child: its pid and a function reading its count."""
    path = tmp_path / f"{name}.count"
    path.write_bytes(b"\0" * 8)
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(path)])
    with path.open("r+b") as f:
        m = mmap.mmap(f.fileno(), 8)
    try:
        yield proc.pid, lambda: int(struct.unpack("q", m[:8])[0])
    finally:
        proc.kill()
        proc.wait(timeout=10)
        m.close()


def work_ratio(slow: Callable[[], int], fast: Callable[[], int], seconds: float) -> float:
    """The slowed child's work over the unslowed one's, over the same `seconds`."""
    s0, f0 = slow(), fast()
    time.sleep(seconds)
    return (slow() - s0) / max(1, fast() - f0)


def stopped_fraction(pid: int, seconds: float) -> float:
    """How often the process is seen stopped, sampled every 5 ms."""
    seen: list[bool] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(state(pid) == "T")
        time.sleep(0.005)
    return sum(seen) / len(seen)


def stopped_seconds(pid: int, seconds: float) -> tuple[float, float]:
    """(about how long the process is seen stopped, the CPU time it used) over `seconds`."""
    before = cpu_seconds(pid)
    fraction = stopped_fraction(pid, seconds)
    after = cpu_seconds(pid)
    assert before is not None and after is not None
    return fraction * seconds, after - before


def test_each_cpu_second_costs_the_rest_of_the_slowed_speed_in_pauses() -> None:
    assert pause_for(0.1, 0.5) == pytest.approx(0.1)  # half speed: as long again, stopped
    assert pause_for(0.1, 0.25) == pytest.approx(0.3)
    assert pause_for(0.1, 1.0) == 0.0
    assert pause_for(-1.0, 0.5) == 0.0
    for factor in (0.0, 0.005, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"factor must be between 0\.01 and 1"):
            pause_for(0.1, factor)


def test_a_process_cpu_time_is_read_from_proc() -> None:
    assert cpu_seconds(os.getpid()) is not None
    assert cpu_seconds(2**22 + 12345) is None


@pytest.mark.timeout(60)
def test_a_slowed_process_does_half_the_work_and_is_left_running(tmp_path: Path) -> None:
    with counter(tmp_path, "fast") as (_, fast), counter(tmp_path, "slow") as (pid, slow):
        wait_for(lambda: fast() > 0 and slow() > 0, 20, "both counting")
        slowdown = Slowdown(pid, 0.5).start()
        try:
            time.sleep(0.3)
            seconds, cpu_before = 3.0, cpu_seconds(pid)
            halved = work_ratio(slow, fast, seconds)
            cpu_after = cpu_seconds(pid)
            assert cpu_before is not None and cpu_after is not None
            slowed_share = (cpu_after - cpu_before) / seconds
            # Stopped for as long as it ran, it never has more than half the wall time (and a
            # pause still owed at the window's end).
            assert 0.05 < slowed_share <= 0.5 + 0.15, slowed_share
            # Beside its twin, about half on an idle machine; crowded, the side-by-side ratio is
            # what the scheduler leaves each: lower when the twin takes the cores while it is
            # stopped (0.29 once in a full CI run), higher when a process woken from a stop is
            # favoured (1.2 beside 4 busy loops on 2 cores). So it is held to keep working.
            assert halved >= 0.15, halved
            # However loaded the machine, each CPU second it gets costs it a second stopped.
            stopped, used = stopped_seconds(pid, 2.0)
            assert used > 0.05 and 0.5 * used <= stopped <= 2 * used + 0.1, (stopped, used)
            slowdown.set_factor(1.0)  # live: full speed again
            time.sleep(0.3)
            assert stopped_fraction(pid, 0.5) == 0.0  # never stopped at full speed
            slowdown.set_factor(0.5)
            time.sleep(0.3)
        finally:
            slowdown.stop()
        assert not slowdown.running
        assert state(pid) != "T"
        before = slow()
        time.sleep(0.3)
        assert slow() > before, "the process runs on after its slowdown stopped"


@pytest.mark.timeout(60)
def test_a_slowdown_ends_on_its_own(tmp_path: Path) -> None:
    with counter(tmp_path, "busy") as (pid, _):
        timed = Slowdown(pid, 0.2, seconds=0.5).start()
        wait_for(lambda: not timed.running, 5, "the slowdown's time up")
        assert state(pid) != "T"
    # Its process gone (killed): the slowdown sees it and ends.
    with counter(tmp_path, "doomed") as (pid, _):
        lasting = Slowdown(pid, 0.2).start()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not lasting.running, 5, "the slowdown of a dead process ended")


@pytest.mark.timeout(60)
def test_a_process_that_exits_mid_slowdown_leaves_its_target_running(tmp_path: Path) -> None:
    with counter(tmp_path, "target") as (pid, count):
        code = (
            "import sys, time\n"
            "from chameleond.local.slowdown import Slowdown\n"
            "Slowdown(int(sys.argv[1]), 0.05).start()\n"
            "time.sleep(1.0)\n"
        )
        subprocess.run([sys.executable, "-c", code, str(pid)], check=True, timeout=30)
        assert state(pid) != "T"
        before = count()
        time.sleep(0.3)
        assert count() > before


# ---- chameleonctl up --faults slow:... --------------------------------------------------------


def test_slow_faults_parse() -> None:
    got = parse_faults("slow:w3@step=5:0.5,slow:w1@t=2s:0.25:30,kill:w0@step=9,slow:w2@t=1:1:800ms")
    assert got == (
        Fault("slow", "w3", at_step=5, factor=0.5),
        Fault("slow", "w1", at_seconds=2.0, factor=0.25, seconds=30.0),
        Fault("kill", "w0", at_step=9),
        Fault("slow", "w2", at_seconds=1.0, factor=1.0, seconds=0.8),
    )
    assert got[1].default_cause() == "slowed to 0.25 of its speed for 30 s (injected)"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("slow:w3@step=5", "expected slow:WORKER@WHEN:FACTOR"),
        ("slow:w3@step=5:2", "FACTOR must be a number from 0.01 to 1, got '2'"),
        ("slow:w3@step=5:0", "FACTOR must be"),
        ("slow:w3@step=5:half", "FACTOR must be"),
        ("slow:w3@step=5:0.5:soon", "SECONDS must be seconds like 20"),
        ("slow:w3@step=5:0.5:0", "SECONDS must be above 0"),
        ("slow:w3@later:0.5", "expected ACTION:WORKER@WHEN"),
    ],
)
def test_bad_slow_faults_say_what_is_wrong(spec: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError, match=fragment):
        parse_faults(spec)


def test_up_refuses_a_bad_slow_fault_in_one_line(tmp_path: Path) -> None:
    proc = chameleonctl(
        "up", "--device", "cpu", "--faults", "slow:w3@step=5:2", "--report", str(tmp_path),
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "chameleonctl up: 'slow:w3@step=5:2': FACTOR must be a number from 0.01 to 1, got '2'"
    )


# ---- chameleon-agent and chameleonctl inject slow ---------------------------------------------


def pids(directory: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in directory.glob("*.pid") if p.read_text()}


@pytest.mark.timeout(120)
def test_the_agent_slows_its_worker_on_a_signed_request_only(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    secret = new_secret_file(tmp_path / "secret")
    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=4, pp=2, bind_addresses=[], mtbf_prior_seconds=None
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    script, out = tmp_path / "train.py", tmp_path / "workers"
    script.write_text(SLEEPER)
    out.mkdir()
    log_path = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "chameleond.agent.cli", "--job", JOB, "--host", HOST,
             "--redis-url", redis_server.url, "--secret-file", str(secret), "--spec", str(spec),
             "--backoff-max", "1", "--", sys.executable, str(script), str(out)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    inject = ("inject", "slow", "--redis-url", redis_server.url, "--job", JOB)
    try:
        workers = wait_for(lambda: len(p := pids(out)) == 4 and p, 20, "four workers")

        # A signed request: w1 is stopped for as long as it computes, its siblings never.
        proc = chameleonctl(
            *inject, "--worker", "w1", "--factor", "0.5", "--secret-file", str(secret)
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(
            f"w1 slowed to 0.5 of its speed until cleared: {Keys(JOB).slow}"
        )
        wait_for(lambda: state(workers["w1"]) == "T", 5, "w1 slowed")
        # Every CPU second costs it a second stopped (however much CPU a loaded machine gives).
        stopped, used = stopped_seconds(workers["w1"], 2.0)
        assert used > 0.05 and 0.5 * used <= stopped <= 2 * used + 0.1, (stopped, used)
        assert stopped_fraction(workers["w0"], 0.5) == 0.0

        # Unsigned, or signed for another worker: refused and logged, nobody slowed.
        redis_client.hset(Keys(JOB).slow, "w2", json.dumps({"worker": "w2", "factor": 0.1}))
        signed_w1 = redis_client.hget(Keys(JOB).slow, "w1")
        assert signed_w1 is not None
        redis_client.hset(Keys(JOB).slow, "w3", signed_w1)

        def text() -> str:
            return log_path.read_text(errors="replace")

        # Both refusals are logged in one tick, in the hash's order (arbitrary once a signed
        # value makes it a hashtable): wait for both lines, then check what each says.
        refusals = ("slow request for w2 refused", "slow request for w3 refused")
        wait_for(lambda: all(r in text() for r in refusals), 5, "both requests refused")
        assert "slow request for w2 refused: unsigned" in text()
        assert "slow request for w3 refused: it is for worker 'w1', stored under 'w3'" in text()
        assert stopped_fraction(workers["w2"], 0.5) == 0.0
        assert stopped_fraction(workers["w3"], 0.5) == 0.0

        # The request names the worker, not its process: w1 restarted is slowed again.
        os.kill(workers["w1"], signal.SIGKILL)
        restarted = wait_for(
            lambda: (p := pids(out).get("w1")) != workers["w1"] and p, 15, "w1 restarted"
        )
        wait_for(lambda: state(restarted) == "T", 5, "the new w1 slowed")

        # --clear: full speed again.
        proc = chameleonctl(*inject, "--worker", "w1", "--clear")
        assert proc.returncode == 0 and proc.stdout.startswith("w1 back to full speed"), proc
        time.sleep(1.5)
        assert stopped_fraction(restarted, 0.5) == 0.0
        assert "worker w1 back to full speed" in text()
        assert status_of(redis_client, JOB)[HOST]["workers"]["w1"]["restarts"] == 1
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0, log_path.read_text(errors="replace")


def test_inject_slow_checks_its_flags(redis_server: RedisServer) -> None:
    base = ("inject", "--redis-url", redis_server.url, "--worker", "w1")
    for args, why in [
        ((*base, "--factor", "0.5"), "--factor: for a slowed worker, `chameleonctl inject slow`"),
        (("inject", "slow", *base[1:], "--cause", "x", "--factor", "0.5"), "--cause: for a fault"),
        (("inject", "slow", *base[1:]), "inject slow takes --factor F or --clear"),
        (("inject", "slow", *base[1:], "--factor", "0"), "--factor must be between 0.01 and 1"),
        (("inject", "slow", *base[1:], "--factor", "0.5", "--seconds", "-1"), "--seconds must"),
    ]:
        proc = chameleonctl(*args, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr, (args, proc.stderr)


def test_inject_slow_signs_a_request_that_ends(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    secret = new_secret_file(tmp_path / "secret")
    before = time.time()
    proc = chameleonctl(
        "inject", "slow", "--redis-url", redis_server.url, "--job", JOB, "--worker", "w3",
        "--factor", "0.25", "--seconds", "30", "--secret-file", str(secret), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("w3 slowed to 0.25 of its speed until ")
    raw = redis_client.hget(Keys(JOB).slow, "w3")
    assert raw is not None
    doc = json.loads(raw)
    Keyring.from_file(secret).verify_doc("slow", JOB, doc)
    assert doc["worker"] == "w3" and doc["factor"] == 0.25
    assert before + 30 <= doc["until"] <= time.time() + 30
    assert f"(unix {doc['until']:.0f})" in proc.stdout
