"""What the CPU benchmarks share: the packaged job as a spec file, and a local cluster run to a
number of committed steps (`chameleonctl bench recovery`, `chameleonctl bench checkpoint`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chameleond.core.spec import load_spec
from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.redisurl import connect

JOB = "bench"


def spec_file(
    tmp: Path, spec: Path | None = None, workers: int | None = None, pp: int | None = None
) -> Path:
    """`spec` itself, or the packaged job (laid out for `workers` x `pp` when given) written to
    `tmp`. Raises SpecError for a layout that cannot be built."""
    if spec:
        return Path(spec)
    from chameleond.cli.up import build_spec_document
    from chameleond.jobs import load_default_spec

    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=workers, pp=pp, bind_addresses=[],
        mtbf_prior_seconds=None,
    )  # fmt: skip
    path = tmp / "spec.json"
    path.write_text(json.dumps(doc))
    return path


def worker_ids(spec: Path) -> list[str]:
    return [w.id for w in load_spec(spec).workers]


def wait_steps(
    mon: StreamMonitor, cluster: LocalCluster, n: int, gen: int | None, timeout: float
) -> None:
    """Until `n` steps (of generation `gen`, if given) have committed."""

    def done() -> bool:
        mon.poll(block_ms=50)
        cluster.check_daemon()
        return sum(1 for c in mon.commits if gen is None or c.generation == gen) >= n

    wait_for(done, timeout, f"{n} committed steps" + (f" on generation {gen}" if gen else ""), 0)


def kill_and_wait(
    mon: StreamMonitor, cluster: LocalCluster, victim: str, timeout: float
) -> tuple[int, float]:
    """kill -9 `victim`, then wait for a step on a newer plan: the generation it was killed in
    and when it was killed."""
    old_gen = mon.last_commit.generation if mon.last_commit else 0
    killed_at = cluster.kill_worker(victim)

    def recovered() -> bool:
        mon.poll(block_ms=20)
        cluster.check_daemon()
        return any(c.generation > old_gen for c in mon.commits)

    wait_for(recovered, timeout, f"a step on a new plan after killing {victim}", 0)
    return old_gen, killed_at


@contextmanager
def warmed_up(cluster: LocalCluster, warmup: int, timeout: float) -> Iterator[StreamMonitor]:
    """Start the daemon and workers; yield the stream monitor once `warmup` steps commit."""
    cluster.start_daemon()
    cluster.start_workers()
    client = connect(cluster.redis_url, decode_responses=True)
    try:
        mon = StreamMonitor(client, JOB)
        wait_steps(mon, cluster, warmup, None, timeout)
        yield mon
    finally:
        client.close()
