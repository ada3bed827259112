"""A burst of 100 faults while decisions are under way is folded into a handful of plans."""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis
from daemon_harness import RunningJob, signed, wait_for

from chameleond.core.spec import load_spec
from chameleond.jobstate.jobspec import spec_document

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "gpt-32.toml"


def test_burst_of_100_faults_is_coalesced(
    redis_client: redis.Redis, running_job: RunningJob, tmp_path: Path
) -> None:
    spec = load_spec(SPEC)
    doc = spec_document(spec)
    doc["job"]["name"] = "default"  # the job's name (a spec naming another job is refused)
    (tmp_path / "gpt-32.json").write_text(json.dumps(doc))
    ids = tuple(w.id for w in spec.workers)
    # One worker in each of 10 pipelines' worth of slots, mixed stages: recoverable.
    faulty = ("w0", "w5", "w10", "w15", "w16", "w21", "w26", "w31", "w1", "w6")
    daemon = running_job.start(
        "--spec", str(tmp_path / "gpt-32.json"), "--decision-delay-seconds", "0.2"
    )
    workers = running_job.workers
    workers.register(ids)
    wait_for(lambda: workers.generation() == 1, 20, "generation 1")
    workers.ready(1, ids)
    wait_for(lambda: daemon.status()["state"] == "training", 15, "training")
    # 100 faults in 10 waves, 50 ms apart: later waves land while a decision is held.
    for wave in range(10):
        pipe = redis_client.pipeline(transaction=False)
        for i in range(10):
            worker = faulty[(wave + i) % len(faulty)] if wave else faulty[i % 3]
            pipe.xadd(
                "chameleon:default:events",
                signed({"type": "fault", "worker": worker, "cause": f"burst {wave}.{i}"}),
            )
        pipe.execute()
        time.sleep(0.05)
    wait_for(
        lambda: redis_client.xpending("chameleon:default:events", "chameleond")["pending"] == 0
        and daemon.status()["pending_faults"] == {} and daemon.status()["state"] != "planning",
        30, "the burst decided",
    )  # fmt: skip
    plan = workers.plan()
    assert plan is not None and sorted(plan["excluded"]) == sorted(faulty)
    published = [d for d in workers.decisions() if d["kind"] == "decision"]
    fault_plans = [d for d in published if d.get("selected") not in ("", "initial", None)]
    assert 1 <= len(fault_plans) <= 4, [d["cause"] for d in fault_plans]
    status = daemon.status()
    assert status["generation"] == 1 + len(fault_plans)
    _, body = daemon.get("/metrics")
    counts = {
        line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in str(body).splitlines()
        if line.startswith("chameleon_events_total") and 'type="fault"' in line
    }
    assert counts["handled"] == len(faulty) and counts["duplicate"] == 100 - len(faulty)
