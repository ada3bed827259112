"""Every move of the policy state machine reaches the decisions stream: the recorded transitions
form one unbroken chain, each leaving the phase the previous one entered."""

from __future__ import annotations

from itertools import pairwise

import pytest
import redis
from daemon_harness import WORKERS, Daemon, RunningJob, Workers, wait_for


@pytest.fixture
def daemon(running_job: RunningJob) -> Daemon:
    return running_job.start("--min-workers", str(len(WORKERS) - 1), timeout=60)


def test_a_worker_missing_from_the_initial_plan_is_a_recorded_fault(
    daemon: Daemon, redis_client: redis.Redis
) -> None:
    workers = Workers(redis_client)
    missing = WORKERS[-1]
    workers.register(WORKERS[:-1])
    # The initial plan (the spec's layout, `missing` in it), then the decision that answers it.
    wait_for(lambda: workers.generation() == 2, 60, "the decision that answers the missing worker")
    transitions = [r for r in workers.decisions() if r["kind"] == "transition"]
    moves = [(t["from"], t["to"]) for t in transitions]
    assert moves[:3] == [
        ("waiting", "transitioning"),
        ("transitioning", "fault_detected"),
        ("fault_detected", "planning"),
    ]
    assert transitions[1]["cause"] == f"{missing}: not registered when the initial plan was made"
    for before, after in pairwise(moves):
        assert before[1] == after[0], moves
