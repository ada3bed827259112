"""A worker's start in a job: wait for the spec, check and profile the user's model, report the
profile, register.

    spec -> the user's Training (checked: chameleond.worker._trainable, chameleond.worker._validate)
      -> untimed pass over the layers -> (a new job's shared CPU host: wait for its others)
      -> timed pass -> profile + register (a worker of the spec: in that order)

Profile first, then register: a registered worker is ready to train, so the daemon's initial plan
(published once every worker of the spec registered) never waits in a rendezvous on a worker that
is still measuring, and that plan is made from every worker's measurements. A worker new to the
job registers first: the daemon knows it by its registration and rejects a profile before it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import torch

from chameleond.auth import AuthError, Keyring
from chameleond.core.spec import JobSpec, SpecError, parse_spec
from chameleond.events import Profile, Register
from chameleond.protocol import Keys
from chameleond.worker._activation import Structure
from chameleond.worker._backend import DeviceChoice, device_memory_bytes
from chameleond.worker._link import Refused, Reporter
from chameleond.worker._profile import profile_model
from chameleond.worker._rendezvous import start_together
from chameleond.worker._trainable import Trainable
from chameleond.worker._validate import check_model
from chameleond.worker.api import DataError, Job, ModelError, Training, TrainingOf

log = logging.getLogger("chameleon.worker")
PROFILE_TOGETHER_SECONDS = 10.0  # how long a new job's worker waits for its host's others
SPEC_NOTE_SECONDS = 10.0  # how often a worker waiting for its job's spec says so


@dataclass(frozen=True)
class Joined:
    """What a worker knows once it has joined its job."""

    spec: JobSpec
    model: Trainable
    outputs: list[Structure]  # each layer's output: the structure and dtypes of its messages
    hosts: Mapping[str, str]  # worker -> host, from the spec
    host: str  # this worker's
    layers: list[dict[str, Any]]  # the start-up profile, per layer (TrainingMeter splits by it)

    def on_host(self, workers: Collection[str]) -> int:
        """How many of these workers share this worker's host."""
        return _sharing(self.hosts, self.host, workers)


def _sharing(hosts: Mapping[str, str], host: str, workers: Collection[str]) -> int:
    return sum(1 for w in workers if hosts.get(w) == host)


def wait_for_spec(
    client: redis.Redis,
    keys: Keys,
    timeout_seconds: float,
    keyring: Keyring | None = None,
    refused: Refused | None = None,
) -> JobSpec:
    """The job's spec, once the daemon stored it. With a keyring, one without the job's signature
    is refused (counted and logged) and waited past, as if it were not there yet. While there is
    none, the worker says so at once and every SPEC_NOTE_SECONDS: a daemon running another job
    name (or none) is the usual cause, and silence would hide it."""
    start = time.monotonic()
    deadline, note_at = start + timeout_seconds, start
    while True:
        raw = client.get(keys.spec)
        now = time.monotonic()
        if raw is None and now >= note_at:
            log.info("%s", no_spec_yet(client, keys))
            note_at = now + SPEC_NOTE_SECONDS
        if raw is not None:
            try:
                doc = json.loads(raw)
                if keyring is not None:
                    if not isinstance(doc, dict):
                        raise AuthError("not a JSON object")
                    keyring.verify_doc("spec", keys.job, doc)
                return parse_spec(doc)
            except AuthError as e:
                (refused or Refused()).note(f"the spec under {keys.spec}", raw, str(e))
            except (json.JSONDecodeError, SpecError) as e:
                raise SpecError(f"{keys.spec}: {e}") from e
        if now > deadline:
            raise TimeoutError(f"gave up after {timeout_seconds:.0f} s {no_spec_yet(client, keys)}")
        time.sleep(0.1)


def no_spec_yet(client: redis.Redis, keys: Keys) -> str:
    """Why a worker waits: the job named, the Redis it looks in (no password), what to check, and
    the jobs that Redis does hold a spec of."""
    job = keys.job
    line = (
        f"waiting for job {job}: no spec in Redis at {_where(client)} yet; "
        f"is chameleond running with --job {job}?"
    )
    others = [j for j in _jobs_with_spec(client) if j != job]
    if others:
        line += f" (that Redis holds the spec of job {', '.join(others)})"
    return line


def _where(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    scheme = (
        "rediss"
        if issubclass(client.connection_pool.connection_class, redis.SSLConnection)
        else "redis"
    )
    return f"{scheme}://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def _jobs_with_spec(client: redis.Redis, most: int = 5) -> list[str]:
    """The jobs whose spec this Redis holds (a few; none where the ACL allows no SCAN)."""
    head, tail = Keys("\0").spec.split("\0")
    found: list[str] = []
    try:
        for key in client.scan_iter(match=f"{head}*{tail}", count=1000):
            name = key.decode() if isinstance(key, bytes) else str(key)
            found.append(name[len(head) : len(name) - len(tail)])
            if len(found) >= most:
                break
    except redis.ResponseError:  # NOPERM: a job's ACL user sees its own keys only
        return []
    return sorted(found)


def profile_together(
    client: redis.Redis, keys: Keys, host: str, me: str, device: torch.device, on_host: int
) -> None:
    """At a new job's start, the workers sharing a CPU host time their start-up profiles
    together. An op costs more CPU time while the host's workers compete for its cores (cache,
    its frequency) than alone: 4 to 77% more on the development machine. Workers that start apart
    (one imports torch faster) would each measure most of their layers alone, and the initial
    plan's forecast would be that much short. A worker joining a job that already has a plan
    profiles at once: its peers are training."""
    if device.type != "cpu" or on_host < 2 or client.exists(keys.plan):
        return
    arrived = start_together(client, keys.profiling(host), me, on_host, PROFILE_TOGETHER_SECONDS)
    if arrived < on_host:
        log.info(
            "profiling with %d of the %d workers on this host: the others were not ready "
            "within %gs",
            arrived,
            on_host,
            PROFILE_TOGETHER_SECONDS,
        )


def join(
    client: redis.Redis,
    keys: Keys,
    reporter: Reporter,
    device: DeviceChoice,
    bind_address: str,
    spec_timeout_seconds: float,
    training: Training | TrainingOf,
) -> Joined:
    """Wait for the job's spec, check and profile the model, then send `profile` and `register`
    (the reporter is started here). Raises SpecError when the training and the spec disagree,
    ModelError for a model the runtime cannot train, DataError for data the others do not read."""
    me = reporter.worker
    spec = wait_for_spec(client, keys, spec_timeout_seconds, reporter.keyring, reporter.refused)
    hosts = {w.id: w.host for w in spec.workers}
    model = Trainable(training_for(spec, training))
    model.prepare_for(device.torch_device)
    check_layer_count(spec, model)
    outputs = check_model(model, spec.training.micro_batch, device.torch_device)
    digest = model.data_digest()
    agree_on_corpus(client, keys, digest)
    agree_on_weights(client, keys, model.weights_digest)
    host = hosts.get(me) or socket.gethostname()
    on_host = _sharing(hosts, host, hosts)  # the spec's workers on this host
    t0 = time.perf_counter()
    data = profile_model(
        model,
        spec.training.micro_batch,
        device.torch_device,
        host,
        on_host,
        start=lambda: profile_together(client, keys, host, me, device.torch_device, on_host),
    )
    log.info(
        "profiled %d layers of %s in %.2fs", model.n_layers, model.name, time.perf_counter() - t0
    )
    reporter.start()
    profile = Profile(me, data)
    memory = device_memory_bytes(device)
    registration = Register(me, host, memory, str(device), os.getpid(), bind_address, digest)
    for event in (profile, registration) if me in hosts else (registration, profile):
        reporter.report(event)
    return Joined(spec, model, outputs, hosts, host, data["layers"])


def training_for(spec: JobSpec, training: Training | TrainingOf) -> Training:
    """The training of this job: the script's, or built from the spec; it must agree with the
    spec's [training] batch sizes and its number of layers (the planner plans with those)."""
    if not isinstance(training, Training):
        job = Job(spec.name, spec.arch, spec.training.global_batch, spec.training.micro_batch)
        training = training(job)
    for name in ("global_batch", "micro_batch"):
        ours, theirs = getattr(training, name), getattr(spec.training, name)
        if ours != theirs:
            raise SpecError(f"the job spec's training.{name} is {theirs}, the script's {ours}")
    return training


def check_layer_count(spec: JobSpec, model: Trainable) -> None:
    if len(spec.layers) != model.n_layers:
        raise SpecError(
            f"the job spec's [model] has {len(spec.layers)} layers, the script's model "
            f"{model.n_layers}: plans would give workers layers that do not exist"
        )


def agree_on_corpus(client: redis.Redis, keys: Keys, digest: str) -> None:
    """Every worker of a job must read the same data: stage 0 reads a sample's inputs on one
    host and the last stage its targets on another, so two datasets (for the built-in corpus, a
    different Python patch version: it is its standard library's sources) would silently pair
    the inputs of one text with the targets of another. The first worker records the digest of
    its first micro-batch (Trainable.data_digest); any other stops."""
    agreed = _first_recorded(client, keys.corpus, digest)
    if agreed != digest:
        raise DataError(
            f"this worker's data has digest {digest} but the job's workers read {agreed}: "
            "every worker must read the same dataset (for the built-in corpus: the same Python "
            f"version; this one is {sys.version.split()[0]})"
        )


def agree_on_weights(client: redis.Redis, keys: Keys, digest: str) -> None:
    """Every worker of a job must start from the same weights: each materialises its own layers
    from its host's copy of the pretrained directory, so two different copies (another revision,
    another fine-tune) would make a model of mixed layers. The first worker records the weights'
    digest (`Layers.weights_digest`); any other stops. An empty digest names nothing: no check."""
    if not digest:
        return
    agreed = _first_recorded(client, keys.weights, digest)
    if agreed != digest:
        raise ModelError(
            f"this worker's pretrained weights have digest {digest} but the job's workers "
            f"started from weights of digest {agreed}: every worker must load the same pretrained "
            "directory (the same config.json and safetensors files on every host)"
        )


def _first_recorded(client: redis.Redis, key: str, digest: str) -> str:
    """The digest the job's first worker recorded under `key` (this one's, if it is the first)."""
    client.set(key, digest, nx=True)
    raw = client.get(key)
    return raw.decode() if isinstance(raw, bytes) else str(raw)
