"""The inputs that once crash-looped the daemon, written into a real Redis stream: each is
dead-lettered with a short reason, the daemon stays up, and it stays up across a restart (kill -9)
with some of them still unread in the stream; a fault afterwards is still planned."""

from __future__ import annotations

from daemon_harness import RunningJob, wait_for
from test_bounds import CRASH_INPUTS

from chameleond.protocol import MAX_REASON_LEN

DEAD = "chameleon:default:dead"


def test_crash_inputs_are_dead_lettered_and_survive_a_restart(
    running_job: RunningJob,
) -> None:
    client, workers = running_job.client, running_job.workers
    daemon = running_job.start_training()
    half = len(CRASH_INPUTS) // 2
    sent = [workers.send(**fields) for fields in CRASH_INPUTS[:half]]
    wait_for(lambda: client.xlen(DEAD) == half, 20, "the first crash inputs dead-lettered")
    assert daemon.get("/healthz")[0] == 200
    daemon.kill()  # kill -9; the rest arrive while it is down and wait in the stream
    sent += [workers.send(**fields) for fields in CRASH_INPUTS[half:]]
    daemon = running_job.start(timeout=40)
    wait_for(lambda: client.xlen(DEAD) == len(CRASH_INPUTS), 20, "every crash input dead")
    dead = {e["entry"]: e for _, e in client.xrange(DEAD)}
    assert set(dead) == set(sent)
    assert all(len(e["error"]) <= MAX_REASON_LEN for e in dead.values())
    assert all(max(len(v) for v in e.values()) <= 1024 + 3 for e in dead.values())
    assert client.xpending("chameleon:default:events", "chameleond")["pending"] == 0
    daemon.kill()  # and once more: nothing of them is left to crash a restart
    daemon = running_job.start(timeout=40)
    assert daemon.status()["generation"] == 1
    workers.send(type="fault", worker="w2", cause="after the crash inputs")
    wait_for(lambda: workers.generation() == 2, 20, "a plan after the crash inputs")
    assert client.xlen(DEAD) == len(CRASH_INPUTS)
