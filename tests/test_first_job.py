"""A new user's first job, as it went wrong once, against real processes (a real redis-server,
chameleond, chameleon-worker, chameleonctl): the spec names the job; a worker waiting for a spec
that is not there says so; a job whose workers all finished is finished everywhere; a fault's
cause reads as one; a device that is not there is one line; `up` runs a user's own script."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from cli_harness import chameleonctl
from daemon_harness import Daemon, wait_for
from worker_harness import Workers, tiny_spec

from chameleond.jobs import load_default_spec
from chameleond.jobstate.jobspec import spec_document
from chameleond.redis_server import RedisServer, free_port
from chameleond.worker._main import EXIT_BACKEND

ROOT = Path(__file__).resolve().parents[1]


def named_spec(tmp_path: Path, name: str) -> Path:
    doc = spec_document(load_default_spec())
    doc["job"]["name"] = name
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_specs_name_is_the_jobs_name(redis_server: RedisServer, tmp_path: Path) -> None:
    spec = named_spec(tmp_path, "myjob")
    cmd = [sys.executable, "-m", "chameleond.daemon.cli", "run", "--redis-url", redis_server.url,
           "--spec", str(spec), "--consumer", "t"]  # fmt: skip
    refused = subprocess.run([*cmd, "--job", "other"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "'other' (from --job) differs from the spec's name 'myjob'" in line, line
    daemon = subprocess.Popen(
        [*cmd, "--http", f"127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    client = redis.Redis.from_url(redis_server.url)
    try:
        wait_for(lambda: client.exists("chameleon:myjob:spec"), 30, "the spec of job myjob")
        assert not client.exists("chameleon:default:spec")
    finally:
        daemon.terminate()
        out, _ = daemon.communicate(timeout=20)
        client.close()
    assert "job myjob (from the spec's [job] name): start its workers with --job myjob" in out


def test_a_second_job_on_a_taken_http_port_is_one_line(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    first = Daemon(redis_server.url, tmp_path, job="a").start().wait_ready()
    try:
        second = subprocess.run(
            [sys.executable, "-m", "chameleond.daemon.cli", "run", "--redis-url",
             redis_server.url, "--job", "b", "--http", f"127.0.0.1:{first.port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        first.stop()
    assert second.returncode == 1
    (line,) = [x for x in second.stderr.splitlines() if "ERROR" in x]
    assert f"cannot serve HTTP on 127.0.0.1:{first.port}" in line and "--http" in line, line
    assert "Redis" not in line


def test_a_worker_waiting_for_a_spec_says_why_at_once_and_again(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.set("chameleon:default:spec", "{}")  # a daemon runs job `default`, not ours
    client.close()
    worker = subprocess.Popen(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", redis_server.url,
         "--job", "myjob", "--worker-id", "w0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert worker.stderr is not None
        for line in worker.stderr:
            lines.put((time.monotonic(), line))

    threading.Thread(target=read, daemon=True).start()
    said: list[tuple[float, str]] = []
    try:
        deadline = time.monotonic() + 60
        while len(said) < 2 and time.monotonic() < deadline:
            try:
                at, line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if "waiting for job myjob" in line:
                said.append((at, line))
    finally:
        worker.terminate()
        worker.wait(timeout=20)
    assert len(said) == 2, said
    expected = (
        f"waiting for job myjob: no spec in Redis at {redis_server.url} yet; is chameleond "
        "running with --job myjob? (that Redis holds the spec of job default)"
    )
    assert said[0][1].rstrip().endswith(expected), said[0][1]
    assert 9.0 <= said[1][0] - said[0][0] <= 15.0  # repeated every ~10 s


@pytest.mark.slow
def test_a_finished_job_is_finished_and_its_fault_reads_well(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Four workers, --max-steps 10, w3 killed after step 3: the survivors finish; the daemon's
    state, /api/v1/status and `chameleonctl status` all say finished; every decision's cause is
    one short line, the raw error kept in the record's detail."""
    job, steps = "first", 10
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(tiny_spec(job, workers=4, stages=2)))
    daemon = Daemon(
        redis_server.url, tmp_path, "--spec", str(spec), "--policy", "reroute",
        "--heartbeat-timeout-seconds", "3", job=job,
    )  # fmt: skip
    workers = Workers(redis_server.url, job, tmp_path)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        daemon.start().wait_ready()
        workers.start(["w0", "w1", "w2", "w3"], max_steps=steps)
        wait_for(lambda: daemon.status()["progress"]["step"] >= 3, 240, "step 3")
        workers.kill("w3")
        for w in ("w0", "w1", "w2"):
            assert workers.procs[w].wait(timeout=180) == 0, workers.log(w)[-3000:]
        wait_for(lambda: daemon.status()["state"] == "finished", 20, "state finished")
        status = daemon.status()
        assert {w: v["state"] for w, v in status["workers"].items()} == {
            "w0": "finished", "w1": "finished", "w2": "finished", "w3": "failed",
        }  # fmt: skip
        shown = chameleonctl("status", "--redis-url", redis_server.url, "--job", job)
        assert shown.returncode == 0, shown.stderr
        out = shown.stdout
        assert out.startswith(f"job {job}: state finished"), out
        assert "w0 finished, w1 finished, w2 finished" in out and "in plan" not in out, out
        assert "  generation 1: initial plan\n" in out and "[; D - s]" not in out, out
        records = [f for _, f in client.xrange(f"chameleon:{job}:decisions")]
        assert any(f.get("to") == "finished" for f in records if f.get("kind") == "transition")
        decisions = [f for f in records if f.get("kind") == "decision"]
        assert len(decisions) >= 2, decisions
        for d in decisions:
            cause = d["cause"]
            assert cause.isascii() and cause.isprintable() and len(cause) <= 160, cause
            assert "GLHF" not in cause and ".cc:" not in cause and "Error:" not in cause, cause
        detail: dict[str, Any] = json.loads(decisions[1].get("detail", "{}"))
        raw = detail.get("w3")
        if raw is not None:  # the peers' collective error: kept whole, beside the short cause
            assert len(raw) > len(decisions[1]["cause"]), (raw, decisions[1]["cause"])
    finally:
        workers.stop()
        daemon.stop()
        client.close()


def test_a_device_that_is_not_there_is_one_line(redis_server: RedisServer) -> None:
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has a cuda:3")
    r = subprocess.run(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", redis_server.url,
         "--worker-id", "w0", "--device", "cuda:3"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert r.returncode == EXIT_BACKEND
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert "device cuda:3 is not there" in line and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_up_on_cuda_without_cuda_is_one_line(tmp_path: Path) -> None:
    proc = chameleonctl("up", "--device", "cuda", "--report", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("chameleonctl up: --device cuda: torch ")
    assert "sees no CUDA device" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_up_with_a_script_needs_its_spec(tmp_path: Path) -> None:
    proc = chameleonctl("up", "--script", str(ROOT / "examples" / "sgd_tied.py"),
                        "--report", str(tmp_path / "r"))  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert "--script" in proc.stderr and "needs --spec" in proc.stderr


@pytest.mark.slow
def test_up_runs_a_users_own_script(tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    proc = chameleonctl(
        "up", "--script", str(ROOT / "examples" / "sgd_tied.py"),
        "--spec", str(ROOT / "examples" / "sgd-tied.toml"), "--device", "cpu",
        "--steps", "16", "--faults", "kill:w1@step=5", "--report", str(report_dir),
        "--timeout", "240",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 workers on cpu" in proc.stdout
    report = json.loads((report_dir / "report.json").read_text())
    assert report["completed"] and report["script"].endswith("sgd_tied.py")
    assert report["device"] == "cpu"
    (fault,) = report["faults"]
    assert fault["worker"] == "w1" and fault["policy"] in ("reroute", "dynamic")
    # The workers were the script (its model's first layer names it), not the built-in model.
    assert "layers of Embedding" in (report_dir / "run" / "logs" / "w0.log").read_text()


def test_up_ends_at_once_with_the_workers_error_when_every_worker_exits(tmp_path: Path) -> None:
    """A script whose model does not match its spec: every worker exits at start-up with one line
    naming the mismatch, and `up` ends then (not at its time limit) with that line and a report."""
    text = (ROOT / "examples" / "sgd-tied.toml").read_text()
    spec = tmp_path / "wrong.toml"
    spec.write_text(text.replace("count = 4", "count = 5", 1))
    report_dir = tmp_path / "report"
    t0 = time.monotonic()
    proc = chameleonctl(
        "up", "--script", str(ROOT / "examples" / "sgd_tied.py"), "--spec", str(spec),
        "--device", "cpu", "--faults", "none", "--report", str(report_dir), "--timeout", "600",
    )  # fmt: skip
    assert time.monotonic() - t0 < 300
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (ended,) = [line for line in proc.stdout.splitlines() if line.startswith("run ended:")]
    assert "every worker exited; w0 (exit 4)" in ended and "layers" in ended, ended
    report = json.loads((report_dir / "report.json").read_text())
    assert not report["completed"] and report["steps_committed"] == 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_documented_first_job_runs_as_written(tmp_path: Path) -> None:
    """The first job of docs/worker-api.md ("A first job by hand"), its shell block run as written
    from a fresh directory (only the ports changed to free ones): the daemon on the spec, six
    workers from the environment, `steps --follow` until the job is finished, `status`, and the
    daemon stopped with its Redis."""
    doc = (ROOT / "docs" / "worker-api.md").read_text()
    block = doc.split("### A first job by hand", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    redis_port, http_port = free_port(), free_port()
    assert "127.0.0.1:6380" in block
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHAMELEON_")},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CHAMELEON_EMBEDDED_REDIS_PORT": str(redis_port),
        "CHAMELEON_HTTP": f"127.0.0.1:{http_port}",
    }
    proc = subprocess.Popen(
        ["bash", "-c", block.replace("127.0.0.1:6380", f"127.0.0.1:{redis_port}")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=380)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    rows = [line.split() for line in out.splitlines()]
    steps = [r for r in rows if len(r) == 8 and r[0].isdigit() and r[1] == "1"]  # generation 1
    assert [int(s[0]) for s in steps] == list(range(12)), out[-4000:]
    assert "job sgd-tied finished" in out
    assert "job sgd-tied: state finished" in out
    assert "w0 finished, w1 finished, w2 finished, w3 finished, w4 finished, w5 finished" in out
    daemon_log = (tmp_path / "daemon.log").read_text()
    assert "job sgd-tied (from the spec's [job] name)" in daemon_log
    assert "WARNING" not in daemon_log and "ERROR" not in daemon_log, daemon_log[-3000:]
    with pytest.raises(redis.ConnectionError):  # the daemon stopped its Redis
        redis.Redis(port=redis_port, socket_timeout=1).ping()
