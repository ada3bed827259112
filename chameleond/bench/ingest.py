"""Event ingestion: heartbeat and step events through the real consumer and handlers, side by side
with the raw Redis XADD + XREADGROUP + XACK rate measured in the same run.

A producer process XADDs events (pipelined) into a private redis-server; the daemon's service runs
in this process on uvloop and handles them. Throughput: events over the time from the first send
to the last handled. Latency: from XADD (a `sent` field) to the end of handling, at a paced
10,000 events/s. Targets: >= 20,000 events/s, >= half the raw rate, p99 < 10 ms at 10,000/s.
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
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import uvloop

from chameleond.daemon.config import Config
from chameleond.daemon.consumer import Entry
from chameleond.daemon.service import Service
from chameleond.events import Ack, AckPhase, Event, Heartbeat, Register, Step
from chameleond.jobs import load_default_spec
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

WORKERS = tuple(w.id for w in load_default_spec().workers)
CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=int, default=60_000, help="events per throughput run")
    parser.add_argument("--rate", type=float, default=10_000.0, help="paced rate for latency")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the paced run")


def produce(url: str, stream: str, n: int, rate: float) -> None:
    """Heartbeats and steps, alternating; `rate` 0 sends as fast as Redis takes them."""
    client = redis.Redis.from_url(url)
    start = time.perf_counter()
    sent = 0
    step = 0
    while sent < n:
        chunk = min(CHUNK if not rate else max(1, int(rate / 200)), n - sent)
        if rate:  # pace: the chunk is due at sent/rate seconds after the start
            delay = start + sent / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        pipe = client.pipeline(transaction=False)
        now = f"{time.time():.6f}"
        for i in range(chunk):
            w = WORKERS[(sent + i) % len(WORKERS)]
            if (sent + i) % 2:
                pipe.xadd(stream, _stamped(Heartbeat(w), now))
            else:
                step += 1
                pipe.xadd(stream, _stamped(Step(w, 1, step // len(WORKERS), 12, 0.05, 1.0), now))
        pipe.execute()
        sent += chunk
    client.close()


def _stamped(event: Event, now: str) -> dict[Any, Any]:
    """The event's fields and `sent`, the producer's clock (the daemon ignores it)."""
    return {**event.to_fields(), "sent": now}


def _producer(url: str, stream: str, n: int, rate: float) -> subprocess.Popen[bytes]:
    """The producer in its own process, so it does not share this event loop's core."""
    call = f"produce({url!r}, {stream!r}, {n}, {rate})"
    code = f"from chameleond.bench.ingest import produce; {call}"
    return subprocess.Popen([sys.executable, "-c", code])  # noqa: S603 - this interpreter and code of this file


async def raw_rate(url: str, n: int) -> float:
    """The limit: the same producer, and a consumer that reads and acknowledges, nothing more."""
    stream, group = "bench:raw", "raw"
    client = aioredis.Redis.from_url(url, decode_responses=False)
    await client.xgroup_create(stream, group, id="0", mkstream=True)
    proc = _producer(url, stream, n, 0.0)
    got, first_sent = 0, None
    deadline = time.monotonic() + 120
    while got < n and time.monotonic() < deadline:
        reply: Any = await client.xreadgroup(group, "c", {stream: ">"}, count=512, block=100)
        for _, entries in reply or []:
            if first_sent is None and entries:
                first_sent = float(entries[0][1][b"sent"])
            await client.xack(stream, group, *[i for i, _ in entries])
            got += len(entries)
    elapsed = time.time() - (first_sent or time.time())
    proc.wait(timeout=30)
    await client.delete(stream)
    await client.aclose()
    return n / elapsed


async def through_daemon(url: str, n: int, rate: float) -> tuple[float, list[float]]:
    """Events/s and per-event handling latencies through the service's consumer and handlers."""
    job = f"bench{int(rate)}"
    cfg = Config(
        job=job, redis_url=url, consumer="bench", heartbeat_timeout_seconds=3600.0,
        ready_timeout_seconds=3600.0, log_level="warning",
    )  # fmt: skip
    latencies: list[float] = []
    first, last = [float("inf")], [0.0]
    done = asyncio.Event()

    def observe(entry: Entry, event: Event, now: float) -> None:
        sent = (entry.fields or {}).get(b"sent")
        if sent is None:
            return
        stamp = float(sent)
        latencies.append(now - stamp)
        first[0] = min(first[0], stamp)
        last[0] = now
        if len(latencies) >= n:
            done.set()

    service = Service(cfg, load_default_spec(), url, http=False, observer=observe)
    task = asyncio.create_task(service.run())
    client = redis.Redis.from_url(url, decode_responses=True)
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
    proc = _producer(url, stream, n, rate)
    await asyncio.wait_for(done.wait(), timeout=120)
    service.shutdown()
    await task
    proc.wait(timeout=30)
    client.close()
    # Throughput window: from the earliest send stamp to the last handled event.
    return n / (last[0] - first[0]), latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench(args: argparse.Namespace, url: str) -> dict[str, Any]:
    raw = await raw_rate(url, args.events)
    rate, _ = await through_daemon(url, args.events, 0.0)
    paced_n = int(args.rate * args.seconds)
    _, latencies = await through_daemon(url, paced_n, args.rate)
    return {
        "events_per_second": rate,
        "raw_redis_events_per_second": raw,
        "ratio_to_raw": rate / raw,
        "p50_seconds": statistics.median(latencies),
        "p99_seconds": percentile(latencies, 0.99),
        "latency_rate_events_per_second": args.rate,
        "events": args.events,
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
    return 0
