"""Event ingestion: heartbeat and step events through the real consumer and handlers, side by side
with the raw Redis XADD + XREADGROUP + XACK rate measured in the same run.

A producer process XADDs events (pipelined) into a private redis-server; the daemon's service runs
in this process on uvloop and handles them. The raw consumer reads as the daemon reads (its
StreamConsumer) and acknowledges each batch with one XACK: the daemon's Redis work without the
handling. Throughput: events over the time from the first XADD to the last acknowledged (for the
daemon: the commit that acknowledged it). Latency, at a paced 10,000 events/s: from the XADD (the
entry's ID, Redis's clock when it appended the entry) to the end of the event's handling
(`p99_seconds`), and to the end of the commit that acknowledged it (`p99_committed_seconds`: the
flush's, up to ACK_SPACING_SECONDS later, for events that changed nothing durable), once the
daemon settled its heap after the job's plan (a pause once per plan, chameleond/daemon/heap.py);
beside it, the same paced producer read by the raw consumer (`raw_p99_seconds`: this machine's
floor). The raw and daemon runs alternate for `--rounds` rounds and each figure is the best
round's (a shared machine only ever makes a round slower); every round is in `rounds`.
Targets: >= 70% of the raw rate, p99 < 5 ms at 10,000/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import uvloop

from chameleond.daemon.config import Config
from chameleond.daemon.consumer import Entry, StreamConsumer
from chameleond.daemon.service import Service
from chameleond.events import Ack, AckPhase, Event, Heartbeat, Register, Step
from chameleond.jobs import load_default_spec
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.redis_server import RedisServer
from chameleond.redisurl import connect, connect_async

WORKERS = tuple(w.id for w in load_default_spec().workers)
CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=60_000, help="events per throughput run")
    parser.add_argument("--rate", type=float, default=10_000.0, help="paced rate for latency")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the paced run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating raw/daemon rounds")


def produce(url: str, stream: str, n: int, rate: float) -> None:
    """Heartbeats and steps, alternating; `rate` 0 sends as fast as Redis takes them. Each chunk's
    events are made before it is due, then stamped `sent` (the producer's clock, which the daemon
    ignores) and sent at once: the latency starts at the XADD, not at the making of the event."""
    client = connect(url)
    start = time.perf_counter()
    sent = 0
    step = 0
    while sent < n:
        chunk = min(CHUNK if not rate else max(1, int(rate / 200)), n - sent)
        events: list[dict[Any, Any]] = []
        for i in range(chunk):
            w = WORKERS[(sent + i) % len(WORKERS)]
            if (sent + i) % 2:
                events.append(Heartbeat(w).to_fields())
            else:
                step += 1
                events.append(Step(w, 1, step // len(WORKERS), 12, 0.05, 1.0).to_fields())
        if rate:  # pace: the chunk is due at sent/rate seconds after the start
            delay = start + sent / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        pipe = client.pipeline(transaction=False)
        now = f"{time.time():.6f}"
        for fields in events:
            fields["sent"] = now
            pipe.xadd(stream, fields)
        pipe.execute()
        sent += chunk
    client.close()


def _producer(url: str, stream: str, n: int, rate: float) -> subprocess.Popen[bytes]:
    """The producer in its own process, so it does not share this event loop's core."""
    call = f"produce({url!r}, {stream!r}, {n}, {rate})"
    code = f"from chameleond.bench.ingest import produce; {call}"
    return subprocess.Popen([sys.executable, "-c", code])  # noqa: S603 - this interpreter and code of this file


class RawRun(NamedTuple):
    events_per_second: float
    read: list[float]  # per event: XADD -> read by the consumer
    cpu_seconds_per_event: float  # this process, while it consumed


async def raw_run(url: str, job: str, n: int, rate: float) -> RawRun:
    """The limit: the same producer, and the daemon's reads of the job's stream (its
    StreamConsumer) each acknowledged with one XACK, nothing more (`job`: a name not used before
    on this Redis)."""
    client = connect_async(url, decode_responses=False)
    keys = Keys(job)
    consumer = StreamConsumer(
        client, keys, "raw", block_ms=Config.block_ms, count=Config.batch_count,
        claim_idle_ms=int(Config.claim_idle_seconds * 1000), maxlen=Config.stream_maxlen,
    )  # fmt: skip
    await consumer.ensure_group()
    proc = _producer(url, keys.events, n, rate)
    cpu = time.process_time()
    got, first_sent = 0, None
    read: list[float] = []  # per event: XADD -> read
    deadline = time.monotonic() + 120
    while got < n and time.monotonic() < deadline:
        entries = await consumer.read()
        now = time.time()
        if not entries:
            continue
        if first_sent is None:
            first_sent = float((entries[0].fields or {})[b"sent"])
        read.extend(now - added(e.id) for e in entries)
        await client.xack(keys.events, CONSUMER_GROUP, *[e.id for e in entries])
        got += len(entries)
    elapsed = time.time() - (first_sent or time.time())
    cpu = time.process_time() - cpu
    proc.wait(timeout=30)
    await client.delete(keys.events)
    await client.aclose()
    return RawRun(n / elapsed, read, cpu / n)


class DaemonRun(NamedTuple):
    events_per_second: float
    handled: list[float]  # per event: XADD -> handled
    committed: list[float]  # per event: XADD -> the end of the commit that acknowledged it
    cpu_seconds_per_event: float  # this process, from the producer's start


async def through_daemon(url: str, job: str, n: int, rate: float) -> DaemonRun:
    """`n` events through the service's consumer and handlers, for a job of its own (`job`: a
    name not used before on this Redis)."""
    cfg = Config(
        job=job, redis_url=url, consumer="bench", heartbeat_timeout_seconds=3600.0,
        ready_timeout_seconds=3600.0, log_level="warning",
    )  # fmt: skip
    # Each handled event's entry id and handling time, and each acknowledged entry's commit
    # time: the latencies are worked out after the run. Strings and floats only: the entries
    # and events themselves kept to the end made the collector walk a growing heap (full
    # collections of 20 to 30 ms inside the measured window).
    ids: list[str] = []
    times: list[float] = []
    acked: dict[str, float] = {}
    measuring, done = asyncio.Event(), asyncio.Event()

    def observe(handled: Sequence[tuple[Entry, Event, float]]) -> None:
        if not measuring.is_set():
            return  # the job's registrations and acknowledgements before the producer's events
        for e, _, t in handled:
            ids.append(e.id)
            times.append(t)

    def acknowledge(entries: Sequence[str], now: float) -> None:
        if measuring.is_set():
            acked.update(dict.fromkeys(entries, now))
            if len(ids) >= n and len(acked) >= n and all(i in acked for i in ids):
                done.set()

    service = Service(
        cfg, load_default_spec(), url, http=False, observer=observe, acknowledged=acknowledge
    )
    task = asyncio.create_task(service.run())
    client = connect(url, decode_responses=True)
    stream = Keys(job).events
    while not service.ready:
        await asyncio.sleep(0.01)
    for w in WORKERS:
        client.xadd(stream, Register(w, "localhost", 2**31).to_fields())  # type: ignore[arg-type]
    while service.job.machine.generation < 1:
        await asyncio.sleep(0.01)
    for w in WORKERS:
        client.xadd(stream, Ack(w, 1, AckPhase.READY).to_fields())  # type: ignore[arg-type]
    while str(service.job.machine.phase) != "training":
        await asyncio.sleep(0.01)
    # The daemon settles its heap once a plan is acknowledged by all (daemon/heap.py): a pause
    # once per plan, not part of the steady state measured here.
    settles = service.metrics.registry.get_sample_value
    while (settles("chameleon_heap_settle_seconds_count") or 0) < 2:
        await asyncio.sleep(0.01)
    measuring.set()
    proc = _producer(url, stream, n, rate)
    cpu = time.process_time()
    await asyncio.wait_for(done.wait(), timeout=120)
    cpu = time.process_time() - cpu
    service.shutdown()
    await task
    proc.wait(timeout=30)
    client.close()
    latencies: list[float] = []  # XADD -> handled
    committed: list[float] = []  # XADD -> the commit that acknowledged it
    for i, t in zip(ids, times, strict=True):
        s = added(i)
        latencies.append(t - s)
        committed.append(acked[i] - s)
    # Throughput window: from the earliest XADD to the commit that acknowledged the last event.
    first = min(added(i) for i in ids)
    return DaemonRun(n / (max(acked.values()) - first), latencies, committed, cpu / n)


def added(entry_id: str | bytes) -> float:
    """When Redis appended a stream entry (unix seconds): its ID's milliseconds, Redis's own clock
    at the XADD. Truncated to the millisecond, so a latency from it is long by up to 1 ms."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) / 1e3


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rounds: list[dict[str, float]] = []
    paced_n = int(args.rate * args.seconds)
    for r in range(max(1, args.rounds)):
        bare = await raw_run(url, f"raw{r}", args.events, 0.0)
        run = await through_daemon(url, f"bench{r}", args.events, 0.0)
        raw_timed = await raw_run(url, f"paced-raw{r}", paced_n, args.rate)
        timed = await through_daemon(url, f"paced{r}", paced_n, args.rate)
        rounds.append({
            "events_per_second": run.events_per_second,
            "raw_redis_events_per_second": bare.events_per_second,
            "p50_seconds": statistics.median(timed.handled),
            "p99_seconds": percentile(timed.handled, 0.99),
            "p99_committed_seconds": percentile(timed.committed, 0.99),
            "raw_p50_seconds": statistics.median(raw_timed.read),
            "raw_p99_seconds": percentile(raw_timed.read, 0.99),
            "cpu_seconds_per_event": run.cpu_seconds_per_event,
            "raw_cpu_seconds_per_event": bare.cpu_seconds_per_event,
        })  # fmt: skip
    rate = max(r["events_per_second"] for r in rounds)
    raw = max(r["raw_redis_events_per_second"] for r in rounds)
    paced = min(rounds, key=lambda r: r["p99_seconds"])
    return {
        "events_per_second": rate,
        "raw_redis_events_per_second": raw,
        "ratio_to_raw": rate / raw,
        "p50_seconds": paced["p50_seconds"],
        "p99_seconds": paced["p99_seconds"],
        "p99_committed_seconds": paced["p99_committed_seconds"],
        # The same paced producer read by the bare consumer: the floor of this machine.
        "raw_p50_seconds": min(r["raw_p50_seconds"] for r in rounds),
        "raw_p99_seconds": min(r["raw_p99_seconds"] for r in rounds),
        "latency_rate_events_per_second": args.rate,
        "events": args.events,
        # The consuming process's CPU per event: steadier than the rates on a busy machine.
        "cpu_seconds_per_event": min(r["cpu_seconds_per_event"] for r in rounds),
        "raw_cpu_seconds_per_event": min(r["raw_cpu_seconds_per_event"] for r in rounds),
        "rounds": rounds,
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        result = uvloop.run(bench(args, server.url))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"ingest: {result['events_per_second']:,.0f} events/s through consumer + handlers")
    print(f"raw Redis XADD + XREADGROUP + XACK: {result['raw_redis_events_per_second']:,.0f} "
          f"events/s (ratio {result['ratio_to_raw']:.2f})")  # fmt: skip
    p50, p99 = result["p50_seconds"] * 1e3, result["p99_seconds"] * 1e3
    print(f"handling latency at {args.rate:,.0f} events/s: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    raw50, raw99 = result["raw_p50_seconds"] * 1e3, result["raw_p99_seconds"] * 1e3
    print(f"raw read latency at {args.rate:,.0f} events/s: p50 {raw50:.2f} ms, p99 {raw99:.2f} ms")
    cpu, raw_cpu = result["cpu_seconds_per_event"] * 1e6, result["raw_cpu_seconds_per_event"] * 1e6
    print(f"consumer CPU per event: {cpu:.1f} us (raw {raw_cpu:.1f} us)")
    return 0
