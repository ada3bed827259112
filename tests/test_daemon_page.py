"""The status page at `/`, loaded in headless Chromium (Debian's chromium) from a real chameleond
on a real redis-server: it shows the state, the plan and the last decision with both candidates;
what clients wrote into Redis (worker ids, causes, dead-lettered fields) is shown as text, never
run. A screenshot is saved beside the test's files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis
from daemon_harness import WORKERS, Daemon, RunningJob, Workers, wait_for

XSS = "<script>document.title='owned'</script><img src=x onerror=alert(1)>"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium not installed: run scripts/test-peers.sh (Debian package chromium)")
    return found


def browse(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", f"--user-data-dir={tmp / 'chromium-profile'}", *args, url,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def daemon(running_job: RunningJob) -> Daemon:
    return running_job.start(timeout=60)


def test_the_status_page_shows_state_plan_and_last_decision_in_a_browser(
    daemon: Daemon, redis_client: redis.Redis, tmp_path: Path
) -> None:
    workers = Workers(redis_client)
    workers.register()
    wait_for(lambda: workers.generation() == 1, 60, "generation 1")
    workers.ready(1, WORKERS)
    workers.send(type="fault", worker="w3", cause=XSS)
    wait_for(lambda: workers.generation() == 2, 60, "generation 2")
    workers.send(type="heartbeat", worker=XSS)  # no such worker: dead-lettered with its fields
    wait_for(lambda: redis_client.xlen("chameleon:default:dead") >= 1, 60, "a dead letter")
    decision = daemon.status()["last_decision"]
    chosen = decision["selected"]
    assert chosen in ("reroute", "dynamic")

    url = f"http://127.0.0.1:{daemon.port}/"
    dom = browse(url, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    state = daemon.status()["state"]
    assert f'<span id="state" class="state {state}">{state}</span>' in html
    # The plan: a row per pipeline, each slot its worker and layer range.
    assert '<table id="plan">' in html and "stage 0" in html
    assert "w0<br>layers 0-" in html or "run by w2" in html
    # The last decision: both candidates scored, the chosen policy named.
    decisions = html.split('<table id="decisions">', 1)[1].split("</table>", 1)[0]
    assert "reroute: " in decisions and "dynamic: " in decisions
    assert f"<b>{chosen}</b>" in decisions
    assert "score " in decisions
    # Client-written text stays text: escaped in the page, no element made of it, title intact.
    assert "&lt;script&gt;document.title=" in html
    assert "<script>" not in html and "<img" not in html
    assert "<title>chameleond: default</title>" in html
    dead = html.split('<table id="dead-letters">', 1)[1].split("</table>", 1)[0]
    assert "heartbeat" in dead and "&lt;img src=x" in dead

    png = tmp_path / "status-page.png"
    shot = browse(url, tmp_path, f"--screenshot={png}", "--window-size=1280,1400")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert png.read_bytes()[:4] == b"\x89PNG"
    print(f"status page screenshot: {png}")


def test_the_status_page_shows_the_newest_steps_training_figures(
    daemon: Daemon, redis_client: redis.Redis
) -> None:
    """The summary names the newest step's loss, gradient norm, learning rate and throughput, and
    the newest evaluation's loss with its step (the page as served; no browser needed to read
    its text)."""
    workers = Workers(redis_client)
    workers.run_first_plan()
    wait_for(lambda: daemon.status()["state"] == "training", 60, "training")
    for step, extra in ((0, {"eval_loss": 2.75}), (1, {})):
        for w, seconds in zip(WORKERS, (0.1, 0.2, 0.3, 0.1, 0.2, 0.4), strict=True):
            workers.send(type="step", worker=w, generation=1, step=step, samples=12,
                         seconds=seconds, loss=2.5 - step / 10, grad_norm=1.25, lr=3e-4,
                         tokens=1536, **extra)  # fmt: skip

    def summary() -> str | None:
        code, html = daemon.get("/")
        if code != 200 or "<td>Step</td><td>1</td>" not in str(html):
            return None
        return str(html).split("<table id=summary>", 1)[1].split("</table>", 1)[0]

    table = wait_for(summary, 30, "step 1 on the status page")
    for name, value in (
        ("Loss", "2.4000"),
        ("Gradient norm", "1.2500"),
        ("Learning rate", "0.0003"),
        ("Throughput (tokens/s)", "3840"),
        ("Eval loss", "2.7500 (after step 0)"),
    ):
        assert f"<td>{name}</td><td>{value}</td>" in table, (name, table)
    assert "<td>Throughput (samples/s)</td><td>measured 30.0, estimated" in table
