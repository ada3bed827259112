"""`chameleonctl steps` against a real redis-server and real signed step events, each step reported
by every worker of its plan: one line per step, its figures, throughput from the slowest report;
--last, --json, --follow until Ctrl-C; unsigned, forged and malformed entries left out and named;
any job (its own name and secret, no daemon, no plan), or one a daemon runs."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import redis
from cli_harness import chameleonctl
from daemon_harness import WORKERS, RunningJob, keyring, wait_for

from chameleond.auth import Keyring
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

SECONDS = (0.1, 0.2, 0.3, 0.1, 0.2, 0.4)  # each worker's time for a step: the slowest is 0.4 s
FIGURES = {"samples": 12, "loss": 2.5, "grad_norm": 1.25, "lr": 3e-4, "tokens": 1536,
           "skipped": 0, "overflow": 0, "vote_seconds": 0.01}  # fmt: skip


def send(client: redis.Redis, job: str, ring: Keyring, **fields: Any) -> None:
    """One event as a worker of `job` sends it, signed with `ring`."""
    event = ring.sign_event(job, {k: str(v) for k, v in fields.items()})
    client.xadd(Keys(job).events, event)  # type: ignore[arg-type]


def report(
    client: redis.Redis, job: str, ring: Keyring, step: int, generation: int = 1,
    workers: tuple[str, ...] = WORKERS, **figures: Any,
) -> None:  # fmt: skip
    """Step `step` as each worker of the plan reports it, with a heartbeat between reports."""
    for w, seconds in zip(workers, SECONDS, strict=False):
        fields = {**FIGURES, **figures, "seconds": seconds}
        send(client, job, ring, type="step", worker=w, generation=generation, step=step, **fields)
        send(client, job, ring, type="heartbeat", worker=w)


def rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split() == [
        "step", "generation", "loss", "grad_norm", "lr", "samples/s", "tokens/s", "eval_loss"
    ]  # fmt: skip
    return [line.split() for line in lines[1:]]


def test_each_step_once_for_any_job_with_its_own_secret(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A job no daemon runs, with a secret of its own: nothing but its stream."""
    secret = tmp_path / "nightly.secret"
    secret.write_text("nightly-" + "x" * 32 + "\n")
    ring = Keyring.from_file(secret)
    job = "nightly"
    report(redis_client, job, ring, 0)
    report(redis_client, job, ring, 1, loss=2.25, lr=2e-4)
    # A step after which a held-out evaluation ran; a late copy of step 1 from w0.
    report(redis_client, job, ring, 2, loss=2.0, tokens=1024, eval_loss=2.75)
    send(redis_client, job, ring, type="step", worker="w0", generation=1, step=1,
         **{**FIGURES, "seconds": 9.0})  # fmt: skip
    # Left out: unsigned, signed with another job's secret, malformed (signed).
    redis_client.xadd(Keys(job).events, {"type": "step", "worker": "w0", "generation": "1",
                                         "step": "3", "samples": "12", "seconds": "1",
                                         "loss": "0"})  # fmt: skip
    send(redis_client, job, keyring(), type="step", worker="w0", generation=1, step=4,
         **{**FIGURES, "seconds": 1})  # fmt: skip
    send(redis_client, job, ring, type="step", worker="w0", generation=1, step=5,
         **{**FIGURES, "seconds": 1, "lr": "fast"})  # fmt: skip

    url = ["--redis-url", redis_server.url, "--job", job, "--secret-file", str(secret)]
    out = chameleonctl("steps", *url, timeout=60)
    assert out.returncode == 0, out.stderr
    assert rows(out.stdout) == [
        ["0", "1", "2.5000", "1.25", "0.0003", "30.0", "3840", "-"],
        ["1", "1", "2.2500", "1.25", "0.0002", "30.0", "3840", "-"],
        ["2", "1", "2.0000", "1.25", "0.0003", "30.0", "2560", "2.7500"],
    ]
    assert "3 step entries left out" in out.stderr
    assert "refused: unsigned" in out.stderr and "refused: signed with an unknown key" in out.stderr
    assert "'lr' must be a number, got 'fast'" in out.stderr

    last = chameleonctl("steps", *url, "--last", "2", "--json", timeout=60)
    assert last.returncode == 0, last.stderr
    docs = [json.loads(line) for line in last.stdout.splitlines()]
    assert [(d["generation"], d["step"]) for d in docs] == [(1, 1), (1, 2)]
    assert docs[1] == {
        **docs[1], "loss": 2.0, "grad_norm": 1.25, "learning_rate": 3e-4, "samples": 12,
        "tokens": 1024, "seconds": 0.4, "eval_loss": 2.75, "workers": 6, "overflow": False,
    }  # fmt: skip
    assert docs[1]["samples_per_second"] == 12 / 0.4 and docs[1]["tokens_per_second"] == 1024 / 0.4

    # With another secret (the environment's), only what that one signed verifies: step 4.
    other = chameleonctl("steps", "--redis-url", redis_server.url, "--job", job, timeout=60)
    assert other.returncode == 0 and [r[0] for r in rows(other.stdout)] == ["4"]
    assert "signed with an unknown key" in other.stderr
    assert "21 step entries left out" in other.stderr


def test_last_reads_back_only_as_far_as_it_needs(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The newest steps behind thousands of heartbeats (several pages read backwards), and every
    step the stream holds with --last 0."""
    ring = keyring()
    pipe = redis_client.pipeline(transaction=False)
    for step in range(40):
        for w, seconds in zip(WORKERS, SECONDS, strict=True):
            fields = {**FIGURES, "seconds": seconds, "loss": 3.0 - step / 100}
            event = ring.sign_event("long", {"type": "step", "worker": w, "generation": 1,
                                             "step": step, **fields})  # fmt: skip
            pipe.xadd(Keys("long").events, event)  # type: ignore[arg-type]
        for i in range(100):
            beat = ring.sign_event("long", {"type": "heartbeat", "worker": WORKERS[i % 6]})
            pipe.xadd(Keys("long").events, beat)  # type: ignore[arg-type]
    pipe.execute()
    url = ["--redis-url", redis_server.url, "--job", "long"]
    newest = chameleonctl("steps", *url, "--last", "3", timeout=60)
    assert newest.returncode == 0, newest.stderr
    assert [(r[0], r[2]) for r in rows(newest.stdout)] == [
        ("37", "2.6300"), ("38", "2.6200"), ("39", "2.6100")
    ]  # fmt: skip
    every = chameleonctl("steps", *url, "--last", "0", "--json", timeout=60)
    docs = [json.loads(line) for line in every.stdout.splitlines()]
    assert [d["step"] for d in docs] == list(range(40))
    assert {d["workers"] for d in docs} == {6}
    assert chameleonctl("steps", *url, "--last", "-1", timeout=60).returncode == 2


class Lines:
    """A process's stdout lines as they come, read on a thread."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: [self.queue.put(x) for x in stdout], daemon=True).start()

    def next(self, timeout: float = 15.0) -> str:
        return self.queue.get(timeout=timeout)

    def empty_for(self, seconds: float) -> bool:
        try:
            self.queue.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


def follow(redis_server: RedisServer) -> subprocess.Popen[str]:
    """`chameleonctl steps --follow --json` started as a shell script's background command is,
    and as CI starts everything: with SIGINT ignored. Ctrl-C (SIGINT) still ends it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
    try:
        return subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "chameleond.cli.ctl", "steps",
             "--redis-url", redis_server.url, "--follow", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_code(proc: subprocess.Popen[str], timeout: float) -> int:
    """The process's exit status; past `timeout`, the failure shows where each of its threads
    was (SIGABRT makes faulthandler print them)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"still running {timeout:g} s on; its threads:\n{err}") from None


def test_follow_prints_each_step_as_its_plan_commits_it_until_ctrl_c(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob
) -> None:
    """Beside a daemon: the plan names the step's workers, so a step is printed once the last of
    them reports it, without waiting for the next; Ctrl-C prints the step still open and exits 0.
    The daemon shows the same figures on /metrics, /api/v1/status and `chameleonctl status`."""
    daemon = running_job.start_training()
    ring = keyring()
    report(redis_client, "default", ring, 0)
    proc = follow(redis_server)
    try:
        lines = Lines(proc)
        assert json.loads(lines.next())["step"] == 0
        report(redis_client, "default", ring, 1, loss=2.0, eval_loss=2.75, tokens=2048)
        first = json.loads(lines.next())
        assert (first["step"], first["eval_loss"], first["workers"]) == (1, 2.75, 6)
        assert first["tokens_per_second"] == 2048 / 0.4
        report(redis_client, "default", ring, 2, workers=WORKERS[:5], loss=1.75)
        assert lines.empty_for(1.5)  # w5 has not reported step 2: still open
        proc.send_signal(signal.SIGINT)
        assert exit_code(proc, 30) == 0
        flushed = json.loads(lines.next())
        assert (flushed["step"], flushed["workers"], flushed["loss"]) == (2, 5, 1.75)
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A supervisor's SIGTERM ends it the same way.
    proc = follow(redis_server)
    try:
        lines = Lines(proc)
        assert [json.loads(lines.next())["step"] for _ in range(2)] == [0, 1]
        assert lines.empty_for(1.0)
        proc.send_signal(signal.SIGTERM)
        assert exit_code(proc, 30) == 0
        assert json.loads(lines.next())["step"] == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # The daemon counted each step once, and shows the newest step's figures.
    def loss() -> float | None:
        try:
            return daemon.metric("chameleon_training_loss ")
        except AssertionError:  # no series before the first step is handled
            return None

    wait_for(lambda: loss() == 1.75, 10, "the loss gauge")
    assert daemon.metric("chameleon_trained_samples_total") == 3 * 12
    assert daemon.metric("chameleon_trained_tokens_total") == 1536 + 2048 + 1536
    assert daemon.metric("chameleon_eval_loss") == 2.75
    assert daemon.metric("chameleon_training_learning_rate") == 3e-4
    assert daemon.metric("chameleon_training_grad_norm") == 1.25
    assert daemon.metric("chameleon_training_throughput_tokens_per_second") == 2048 / 0.4
    progress = daemon.status()["progress"]
    assert (progress["step"], progress["loss"], progress["eval_loss"]) == (2, 1.75, 2.75)
    assert progress["eval_step"] == 1 and progress["learning_rate"] == 3e-4

    def printed() -> str | None:
        out = chameleonctl("status", "--redis-url", redis_server.url, timeout=60)
        line = next((x for x in out.stdout.splitlines() if x.startswith("last step")), None)
        return line if line and line.startswith("last step 2 ") else None

    line = wait_for(printed, 15, "the persisted progress")
    assert "loss 1.7500, grad norm 1.2500, lr 0.0003" in line
    assert "eval loss 2.7500 after step 1" in line
