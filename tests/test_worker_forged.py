"""Real workers refuse plans the job's daemon did not sign: an unsigned (forged) plan, one signed
with a key the job does not hold, and an old signed plan replayed under the plan key. Each worker
keeps training on the plan it has, logs and counts the refusal (its heartbeats carry `refused`),
and follows the next genuine plan."""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from pathlib import Path

import pytest
from worker_harness import Controller, Workers, tiny_spec

from chameleond.auth import Keyring, signed_json
from chameleond.core.plan import plan_to_dict
from chameleond.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

IDS = ["w0", "w1"]


def test_forged_wrong_key_and_replayed_plans_are_refused_and_training_goes_on(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    spec = tiny_spec("forge", workers=2, stages=2, global_batch=4, micro_batch=2)
    controller = Controller(redis_server.url, spec, policy="reroute", heartbeat_lapse=60).start()
    workers = Workers(redis_server.url, "forge", tmp_path)
    client, keys, record = controller.client, controller.keys, controller.record

    def steps(generation: int) -> int:
        return sum(e["generation"] == str(generation) for e in record.of("step"))

    def logged(line: str) -> bool:
        return all(line in workers.log(w) for w in IDS)

    def write(raw: str, generation: int) -> None:
        client.set(keys.plan, raw)
        client.publish(keys.plans_channel, str(generation))

    try:
        workers.start(IDS)
        controller.wait_for("steps of generation 1", lambda: steps(1) >= 4, 180)
        first = controller.current
        assert first is not None
        genuine_first = client.get(keys.plan)
        assert isinstance(genuine_first, str)
        # A plan that would fence every worker, from somebody without the secret ...
        fence = plan_to_dict(replace(first, generation=7, excluded=tuple(IDS)))
        write(json.dumps(fence), 7)
        refusal = "refused the plan under chameleon:forge:plan: "
        controller.wait_for("every worker refusing it", lambda: logged(refusal + "unsigned"), 30)
        # ... and the same signed with a key that is not the job's.
        stranger = Keyring((secrets.token_hex(16).encode(),))
        write(signed_json(stranger, "plan", "forge", fence), 8)
        wrong_key = refusal + "signed with an unknown key"
        controller.wait_for("every worker refusing that", lambda: logged(wrong_key), 30)
        before = steps(1)
        controller.wait_for("training on after those", lambda: steps(1) >= before + 6, 60)

        def counted() -> bool:  # each worker's heartbeats report both refusals
            beats = record.of("heartbeat")
            return {e["worker"] for e in beats if int(e.get("refused", 0)) >= 2} == set(IDS)

        controller.wait_for("heartbeats counting the refusals", counted, 30)
        # The next genuine plan is followed; then the old signed plan, replayed, changes nothing.
        controller.publish(replace(first, generation=2))
        controller.wait_for("steps of generation 2", lambda: steps(2) >= 2, 60)
        write(genuine_first, 1)
        after = steps(2)
        controller.wait_for("training on after the replay", lambda: steps(2) >= after + 6, 60)
        assert all(workers.procs[w].poll() is None for w in IDS)
        acks = {(e["generation"], e["phase"]) for e in record.of("ack")}
        assert acks == {("1", "ready"), ("2", "ready")}, acks
        assert not any(e["generation"] in ("7", "8") for e in record.of("step", "ack"))
    finally:
        workers.stop()
        controller.stop()
