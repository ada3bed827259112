"""The daemon and signed events (docs/security.md): unsigned, forged, wrong-key and other-job
events are dead-lettered and counted, and change nothing; the job goes on with signed ones; the
previous key is accepted during a rotation; a plan key nobody signed is not resumed from; an
external Redis without a secret needs --insecure."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import redis
from daemon_harness import RunningJob, keyring, signed, wait_for

from chameleond.auth import SECRET_ENV, SECRET_PREVIOUS_ENV, Keyring, key_id, signed_json
from chameleond.protocol import unpacked_plan
from chameleond.redis_server import RedisServer, free_port

EVENTS, DEAD, PLAN = "chameleon:default:events", "chameleon:default:dead", "chameleon:default:plan"
PACKED = PLAN + ".zlib"


def test_forged_events_are_dead_lettered_counted_and_change_nothing(
    running_job: RunningJob,
) -> None:
    client, workers = running_job.client, running_job.workers
    daemon = running_job.start_training()
    fault = {"type": "fault", "worker": "w2", "cause": "forged"}
    stranger = Keyring((secrets.token_hex(16).encode(),))
    tampered = {**signed(fault), "worker": "w3"}
    forged = [
        fault,  # unsigned
        stranger.sign_event("default", fault),  # a key the job does not hold
        tampered,  # signed, then changed
        signed(fault, job="other"),  # another job's
        {**fault, "sig": "nonsense"},
    ]
    ids = [client.xadd(EVENTS, f) for f in forged]  # type: ignore[arg-type]
    wait_for(lambda: client.xlen(DEAD) == len(forged), 15, "the forged events dead-lettered")
    reasons = {e["entry"]: e["error"] for _, e in client.xrange(DEAD)}
    assert reasons[ids[0]] == "refused: unsigned"
    assert reasons[ids[1]].startswith("refused: signed with an unknown key")
    assert reasons[ids[2]].startswith("refused: bad signature")
    assert reasons[ids[3]].startswith("refused: bad signature")
    assert reasons[ids[4]].startswith("refused: signed with an unknown key")
    forged_total = 'chameleon_forged_messages_total{kind="fault"}'
    assert daemon.metric(forged_total) == len(forged)
    assert "refused fault event" in daemon.output()
    assert workers.generation() == 1 and daemon.status()["failed"] == []
    workers.send(**fault)  # the same fault, signed: it counts
    wait_for(lambda: workers.generation() == 2, 15, "a plan for the signed fault")
    assert daemon.status()["failed"] == ["w2"]


def test_rotation_accepts_the_previous_key_and_signs_with_the_new_one(
    running_job: RunningJob,
) -> None:
    client = running_job.client
    old = os.environ[SECRET_ENV]
    new = secrets.token_hex(16)
    running_job.start_training().terminate()
    rotated = {SECRET_ENV: new, SECRET_PREVIOUS_ENV: old}
    running_job.start(env=rotated)
    # Workers not restarted yet still sign with the old key: accepted.
    client.xadd(EVENTS, signed({"type": "fault", "worker": "w4", "cause": "old key"}))
    wait_for(lambda: running_job.workers.generation() == 2, 15, "a plan for the old-key fault")
    plan = json.loads(client.get(PLAN) or "{}")
    assert plan["sig"].split(".")[0] == key_id(new.encode())
    Keyring((new.encode(),)).verify_doc("plan", "default", plan)
    assert client.xlen(DEAD) == 0


def test_a_plan_key_nobody_signed_is_replaced_by_the_committed_plan(
    running_job: RunningJob,
) -> None:
    """The daemon resumes from the plan its last commit put in the (signed) snapshot, and writes
    it, signed, over the one somebody else wrote: a client can neither steer it nor keep it from
    starting."""
    client = running_job.client
    running_job.start_training().kill()
    plan = json.loads(client.get(PLAN) or "{}")
    plan["excluded"] = ["w0", "w1"]  # written by somebody without the secret
    client.set(PLAN, json.dumps(plan))
    daemon = running_job.start()
    assert "chameleon:default:plan is not the one this job published" in daemon.output()
    genuine = json.loads(client.get(PLAN) or "{}")
    keyring().verify_doc("plan", "default", genuine)
    resigned = signed_json(keyring(), "plan", "default", {**plan, "excluded": []})
    assert genuine == json.loads(resigned)
    assert daemon.status()["generation"] == 1
    # The copy the workers read is written with it.
    packed = redis.Redis.from_url(running_job.redis_url)  # bytes
    try:
        assert unpacked_plan(packed.get(PACKED) or b"") == genuine
        # A forged packed copy alone (the plan key intact) is found and written again too.
        packed.set(PACKED, zlib.compress(json.dumps(plan).encode()))
        daemon.kill()
        daemon = running_job.start()
        assert "its packed copy under chameleon:default:plan.zlib differs" in daemon.output()
        assert unpacked_plan(packed.get(PACKED) or b"") == genuine
    finally:
        packed.close()


@pytest.mark.parametrize(
    ("field", "where"),
    [
        ("snapshot", "chameleon:default:state snapshot"),
        ("base_spec", "chameleon:default:state base_spec"),
    ],
)
def test_persisted_state_nobody_signed_is_not_resumed_from(
    field: str, where: str, running_job: RunningJob
) -> None:
    """The next decisions start from the snapshot and the base spec: one written by
    somebody without the secret (a snapshot with every worker failed, a restore of an old
    checkpoint) would have the daemon sign a plan it chose."""
    client = running_job.client
    running_job.start_training().kill()
    state = "chameleon:default:state"
    raw = client.hget(state, field) if field else client.get(PLAN)
    doc = json.loads(raw or "{}")
    keyring().verify_doc({"": "plan", "snapshot": "state"}.get(field, field), "default", doc)
    doc.pop("sig")  # written by somebody without the secret
    if field:
        client.hset(state, field, json.dumps(doc))
    else:
        client.set(PLAN, json.dumps(doc))
    daemon = running_job.daemon().start()
    assert daemon.proc is not None and daemon.proc.wait(timeout=40) == 1
    assert f"{where} is not signed by this job's secret: unsigned" in daemon.output()


def test_an_external_redis_without_a_secret_needs_insecure(
    redis_server: RedisServer, running_job: RunningJob, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAMELEON_SECRET")}
    argv = [sys.executable, "-m", "chameleond.daemon.cli", "run", "--redis-url", redis_server.url,
            "--http", f"127.0.0.1:{free_port()}"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("chameleond: no secret for an external Redis")
    assert len(r.stderr.strip().splitlines()) == 1
    daemon = running_job.start("--insecure", env={SECRET_ENV: ""})
    assert "INSECURE" in daemon.output()
