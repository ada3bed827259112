"""A job that accepts a smaller batch (`training.min_global_batch`): the daemon, with policy
adaptive, answers the loss of a pipeline's worker with a drop plan when it scores highest (the job
of tests/test_drop.py, with a short D: migrating its 1 GB layers does not pay), publishes it and
records every candidate by policy. The dropped pipeline's live worker goes on standby."""

from __future__ import annotations

import json
from pathlib import Path

from daemon_harness import RunningJob, wait_for
from test_drop import document

from chameleond.core.plan import check_batch, plan_from_dict
from chameleond.core.spec import parse_spec

WORKERS = tuple(f"w{i}" for i in range(16))


def test_a_fault_publishes_a_drop_plan_with_the_kept_pipelines_and_their_batch(
    running_job: RunningJob, tmp_path: Path
) -> None:
    doc = document(min_global_batch=8)
    # D = (prior + T) / 2 after one fault T seconds in: about 10 s here.
    doc["job"].update(name="default", mtbf_prior_seconds=20.0)
    spec_file = tmp_path / "drop.json"
    spec_file.write_text(json.dumps(doc))
    spec = parse_spec(doc)
    workers = running_job.workers
    daemon = running_job.start("--spec", str(spec_file), "--heartbeat-timeout-seconds", "60")
    workers.register(WORKERS)
    wait_for(lambda: workers.generation() == 1, 15, "generation 1")
    first = workers.plan()
    assert first is not None and first["global_batch"] == 16
    workers.ready(1, WORKERS)
    wait_for(lambda: daemon.status()["state"] == "training", 15, "training")

    workers.send(type="fault", worker="w0", cause="ECC error")
    wait_for(lambda: workers.generation() == 2, 15, "the plan after w0")
    raw = workers.plan()
    assert raw is not None
    plan = plan_from_dict(raw)
    assert plan.policy == "drop" and plan.global_batch == 14 and plan.excluded == ("w0",)
    assert plan.pipelines == plan_from_dict(first).pipelines[1:]
    assert "w1" not in plan.workers and plan.migration == ()
    assert check_batch(plan, spec.training) == []

    record = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert record["selected"] == "drop" and record["generation"] == "2"
    candidates = json.loads(record["candidates"])
    assert [c["policy"] for c in candidates] == ["reroute", "dynamic", "drop"]
    by_policy = {c["policy"]: c for c in candidates}
    assert by_policy["drop"]["global_batch"] == 14 and by_policy["reroute"]["global_batch"] == 16
    assert by_policy["drop"]["score"] > max(by_policy["reroute"]["score"],
                                            by_policy["dynamic"]["score"])  # fmt: skip
    assert daemon.metric('chameleon_policy_decisions_total{policy="drop"}') == 1
    state = json.loads(running_job.client.hget("chameleon:default:state", "snapshot") or "{}")
    assert "w1" in state["machine"]["standby"]  # alive, idle until a later plan takes it

    # Alive on standby, w1 is offered to the next decision: a fault of another pipeline's
    # worker names w3's fault alone and w1 as joined.
    workers.ready(2, [w for w in WORKERS if w not in ("w0", "w1")])
    wait_for(lambda: daemon.status()["state"] == "training", 15, "training")
    workers.send(type="fault", worker="w3", cause="ECC")
    wait_for(lambda: workers.generation() == 3, 15, "generation 3")
    answer = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert json.loads(answer["faults"]) == ["w3"] and json.loads(answer["joined"]) == ["w1"]
