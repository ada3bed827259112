"""Measure every layer's cost on this worker's device, for the planner's performance model.

Two measurements, both sent as `profile` events:

* At start-up (`profile_model`), each layer alone, for one micro-batch: forward, backward and
  optimizer-update seconds (median of a few timed repetitions after a warm-up), parameter bytes, the
  bytes of the user's optimizer state, activation bytes (the tensors autograd saves for backward,
  parameters excluded) and output bytes (what the layer sends to the next stage, summed over the
  activation's tensors; zero for the head).
  Layers are built one at a time, so profiling needs the memory of one layer, not of the model.

* In training (`TrainingMeter`), the same seconds measured on the real steps of the running plan,
  reported every few steps, so the planner's later decisions use what a step really costs here.

On the CPU, seconds are CPU time, not wall time: the workers of a local job share the host's cores,
so an op's wall time includes the time it waited for a core while its peers ran. The estimator
models that sharing itself (the host's CPU work over its cores), which needs each op's CPU cost.
A CPU worker also reports its host: the cores it may use, how many of them the job's workers there
keep busy (see `host_report`), and, from training, the CPU a step costs it beyond its layers'
forward, backward and update (sends, receives, gradient all-reduce, the commit vote: mostly on
gloo's threads), which the estimator adds per worker. On an accelerator, seconds are the device's:
the start-up profile synchronizes the device around each timed part, and in training the meter
reads device events (see `TrainingMeter`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from chameleond.protocol import PROFILE_EVERY_STEPS, profile_every_steps, profile_phase
from chameleond.worker._activation import Activation, flatten, nbytes, split_aux, unflatten
from chameleond.worker._layer import LayerState
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import Batch

REPEATS = 3
# In training: a profile every REPORT_STEPS steps, and not more often than REPORT_SECONDS. Short
# enough that a plan of a few steps (one fault to the next) reports how its ops really cost in
# training: the start-up profile runs each layer alone, in warm caches, and puts them 10 to 25%
# below that on a shared host; the daemon's next decision then plans from the training figures.
REPORT_STEPS = PROFILE_EVERY_STEPS
REPORT_SECONDS = 0.5

Clock = Callable[[], float]


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels: on an accelerator a timer read right after a launch
    measures the launch, not the kernel."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        # `torch.npu` exists once torch_npu is imported, which an npu worker did at start
        # (backend.check_device); looked up here so that nothing imports torch_npu elsewhere.
        getattr(torch, "npu").synchronize(device)  # noqa: B009 - absent from torch's stubs


def op_clock(device: torch.device) -> Clock:
    """CPU time of this thread on the CPU (see the module docstring); wall time on accelerators."""
    return time.thread_time if device.type == "cpu" else time.perf_counter


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_report(host: str, cpu_share: float, workers_on_host: int) -> dict[str, Any]:
    """The `host` object of a profile: {"name", "cores", "busy_cores"} (TrainingMeter adds
    "step_cpu_seconds").

    busy_cores = this process's CPU seconds per wall second x the job's workers on the host,
    measured while they all compete for the cores: with more workers than cores, that is what the
    job gets of the host (other processes take the rest). With no more workers than cores they do
    not compete and the job may use every core.
    """
    cores = host_cores()
    busy = cpu_share * workers_on_host if workers_on_host > cores else float(cores)
    return {"name": host, "cores": cores, "busy_cores": round(max(busy, 1e-3), 4)}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile_layer(
    model: Trainable,
    index: int,
    x: Activation,
    batch: Batch,
    device: torch.device,
    repeats: int = REPEATS,
) -> tuple[dict[str, Any], Activation]:
    """One layer's costs on input `x` (the real micro-batch's activation at this layer): the median
    of `repeats` timed repetitions after an untimed one; and its output (without its aux loss),
    the next layer's input. The backward runs from a gradient of ones on each floating output,
    plus the aux loss's (or, at the head, the loss's) weighted by the micro-batch's samples."""
    layer = LayerState(model, index, device)
    param_ptrs = {p.data_ptr() for p in layer.module.parameters()}
    last = index == model.n_layers - 1
    structure, inputs = flatten(x)
    micro_batch = inputs[0].shape[0]
    clock = op_clock(device)

    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            saved.append(_tensor_bytes(t))
        return t

    fwd: list[float] = []
    bwd: list[float] = []
    upd: list[float] = []
    out_bytes = 0
    out = x
    for rep in range(repeats + 1):
        inp = unflatten(
            structure,
            [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs],
        )
        saved.clear()
        _sync(device)
        t0 = clock()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), model.autocast(device):
            out, aux = split_aux(layer.module(inp), f"layer {index}")
            loss = model.loss_sum(out, batch, micro_batch) if last else None
        _sync(device)
        t1 = clock()
        roots = [] if last else [t for t in flatten(out)[1] if t.requires_grad]
        seeds = [torch.ones_like(t) for t in roots]
        for objective in (loss, None if aux is None else aux * micro_batch):
            if objective is not None and objective.requires_grad:
                roots.append(objective)
                seeds.append(torch.ones_like(objective))
        if roots:
            torch.autograd.backward(roots, seeds)
        _sync(device)
        t2 = clock()
        layer.apply_update(micro_batch, rep)  # a real step of the user's optimizer
        _sync(device)
        t3 = clock()
        if rep:  # the first repetition warms up allocator, kernels and the optimizer state
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
        out_bytes = 0 if last else nbytes(out)
    layer.check_movable()  # with the state of a real step of the user's optimizer
    activation_bytes = sum(saved)
    # What the user's optimizer holds: SGD with momentum 1x the parameters, AdamW 2x (+ its steps).
    optimizer_bytes = sum(
        _tensor_bytes(v)
        for st in layer.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    data = {
        "name": model.layer_name(index, layer.module),
        "forward_seconds": statistics.median(fwd or [0.0]),
        "backward_seconds": statistics.median(bwd or [0.0]),
        "update_seconds": statistics.median(upd or [0.0]),
        "param_bytes": sum(_tensor_bytes(p) for p in layer.module.parameters()),
        "optimizer_bytes": optimizer_bytes,
        "activation_bytes": activation_bytes,
        "output_bytes": out_bytes,
    }
    out_structure, outs = flatten(out)
    return data, unflatten(out_structure, [t.detach() for t in outs])


def profile_model(
    model: Trainable,
    micro_batch: int,
    device: torch.device,
    host: str = "",
    workers_on_host: int = 1,
    start: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """The `profile` event's JSON data: {"layers": [...]} in layer order (+ "host" on the CPU).

    Each layer runs on the real first micro-batch of the job, its input being the previous layer's
    output, so shapes, activations and the loss are the model's own. A first pass over the layers,
    not timed, pays the process's one-time costs (torch's lazy initialisation: over a second of
    CPU on the development machine, against tens of milliseconds for the timed pass). Then
    `start()` returns when the timed pass may begin: on a shared CPU host, once the job's other
    workers there are ready too (startup.py), so each op is measured while they compete for the
    cores, as in training, and the CPU share measured here is the one they get then.
    """
    batch = model.batch(0, 0, model.training.global_batch, micro_batch, device)

    def measure(repeats: int) -> list[dict[str, Any]]:
        x: Activation = model.inputs(batch)
        layers = []
        for i in range(model.n_layers):
            data, x = profile_layer(model, i, x, batch, device, repeats)
            layers.append(data)
        return layers

    measure(0)
    start()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    layers = measure(REPEATS)
    data: dict[str, Any] = {"layers": layers, "micro_batch": micro_batch, "device": str(device)}
    if device.type == "cpu" and host:
        share = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
        data["host"] = host_report(host, share, workers_on_host)
    return data


class TrainingMeter:
    """Per-layer seconds measured on the real steps of one plan generation.

    The step runner brackets each op (`begin`, `inputs_ready`, `op`) and the commit its optimizer
    update (`begin`, `update`); an op's seconds are split among its layers in proportion to their
    start-up profile. On the CPU an op costs the CPU time of its thread from `begin`. On an
    accelerator a kernel launch returns before the kernel runs, so the meter records device events
    instead, from `inputs_ready` (the stream has waited for the op's receive by then, which is not
    the op's cost), and reads them when a report is due. `step_done` returns a profile event's data
    every REPORT_STEPS steps (REPORT_SECONDS at least), then starts a new window, so each report
    describes the recent steps of the running plan only. Windows after the first are longer in
    a large job (protocol.profile_every_steps: the job's profiles share a rate), and the second is
    longer by the worker's phase (protocol.profile_phase), so that the workers of a job report at
    different steps from then on.
    """

    def __init__(
        self,
        startup: Sequence[dict[str, Any]],
        device: torch.device,
        micro_batch: int,
        host: str,
        workers_on_host: int,
        generation: int = 0,
        worker: str = "",
        members: int = 1,
        wall_clock: Clock = time.perf_counter,
    ) -> None:
        self.startup = startup
        # A plan's first report comes after REPORT_STEPS steps (its links, the first figures of
        # the plan), the next ones every `profile_every_steps` of the plan's `members` at the
        # pace measured, the second later by the worker's phase (protocol.profile_phase): from
        # then on the job's workers report at different steps.
        self.worker = worker
        self.members = members
        self.reports = 0
        self.due = REPORT_STEPS
        self.generation = generation  # the plan measured, named in each report (0: none)
        self.device = device
        self.micro_batch = micro_batch
        self.host = host
        self.workers_on_host = workers_on_host
        self.on_cpu = device.type == "cpu"
        self.clock = time.thread_time  # on the CPU
        self.wall_clock = wall_clock
        self._started: Any = None
        self._wall_started = 0.0
        self.restart()

    def restart(self) -> None:
        """A new window (after a generation's first step, which pays for its warm-up)."""
        n = len(self.startup)
        self.forward = [0.0] * n
        self.backward = [0.0] * n
        self.micro_batches = [0] * n  # forward/backward executions per layer
        self.updated = [0.0] * n
        self.steps = 0
        self.op_seconds = 0.0
        self.op_wall_seconds = 0.0  # on the CPU: the same ops' wall time, their inputs arrived
        self.update_seconds = 0.0
        self.fastest_vote = math.inf  # the shortest commit vote of the window (wall seconds)
        self._events: list[tuple[str, tuple[int, ...], Any, Any]] = []  # accelerators, unread
        self.wall0 = self.wall_clock()
        self.cpu0 = time.process_time()

    def _now(self) -> Any:
        if self.on_cpu:
            return self.clock()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        """An op, or the commit's update, begins."""
        self._started = self._now()
        self._wall_started = self.wall_clock()

    def inputs_ready(self) -> None:
        """The op's input has arrived: on an accelerator its time counts from here, and so does
        its wall time on the CPU."""
        self._wall_started = self.wall_clock()
        if not self.on_cpu:
            self._started = self._now()

    def op(self, forward: bool, layers: Sequence[int]) -> None:
        """One forward or backward of a stage's layers has run."""
        self._measured("forward" if forward else "backward", layers)

    def update(self, layers: Sequence[int]) -> None:
        """The commit's optimizer update of these layers has run."""
        self._measured("update", layers)

    def _measured(self, what: str, layers: Sequence[int]) -> None:
        if self.on_cpu:
            if what != "update":
                self.op_wall_seconds += self.wall_clock() - self._wall_started
            self._add(what, layers, self.clock() - self._started)
        else:
            self._events.append((what, tuple(layers), self._started, self._now()))

    def _add(self, what: str, layers: Sequence[int], seconds: float) -> None:
        if what == "update":
            self.update_seconds += seconds
            for i, s in self._split(layers, seconds, "update_seconds"):
                self.updated[i] += s
            return
        self.op_seconds += seconds
        sums = self.forward if what == "forward" else self.backward
        for i, s in self._split(layers, seconds, f"{what}_seconds"):
            sums[i] += s
            if what == "forward":
                self.micro_batches[i] += 1

    def _split(self, layers: Sequence[int], seconds: float, key: str) -> list[tuple[int, float]]:
        weights = [max(float(self.startup[i][key]), 1e-12) for i in layers]
        total = sum(weights)
        return [(i, seconds * w / total) for i, w in zip(layers, weights, strict=True)]

    def vote(self, seconds: float) -> None:
        """A step's commit vote: the shortest of a window is about the all-reduce alone (this
        worker reached it last), time in which nobody computes."""
        self.fastest_vote = min(self.fastest_vote, seconds)

    def step_done(self) -> dict[str, Any] | None:
        """Count a committed step; the profile data when one is due, else None."""
        self.steps += 1
        wall = self.wall_clock() - self.wall0
        if self.steps < self.due or wall < REPORT_SECONDS:
            return None
        for what, ids, start, end in self._events:
            end.synchronize()
            self._add(what, ids, start.elapsed_time(end) / 1000.0)  # milliseconds
        self._events.clear()
        if self.op_seconds <= 0:
            return None
        cpu = time.process_time() - self.cpu0
        layers = []
        for i, base in enumerate(self.startup):
            n = self.micro_batches[i]
            if not n:
                continue
            layers.append(
                {
                    **base,
                    "index": i,
                    "forward_seconds": self.forward[i] / n,
                    "backward_seconds": self.backward[i] / n,
                    "update_seconds": self.updated[i] / self.steps,
                }
            )
        data: dict[str, Any] = {
            "layers": layers,
            "micro_batch": self.micro_batch,
            "device": str(self.device),
            "source": "training",
            "steps": self.steps,
            "seconds_per_step": wall / self.steps,
        }
        if self.generation:
            data["generation"] = self.generation
        if self.on_cpu:
            # How much longer the ops took on the wall clock than on the CPU: the cores they
            # waited for, and any pause of the process (a throttled or stopped worker). The
            # slowness detector compares workers by their ops' wall time (jobstate/slowness.py).
            data["wall_per_cpu"] = round(self.op_wall_seconds / self.op_seconds, 4)
        if self.device.type == "cpu" and self.host:
            # The cores the job gets while it computes: the estimator adds the vote apart.
            vote = self.fastest_vote if math.isfinite(self.fastest_vote) else 0.0
            computing = max(wall - self.steps * vote, wall / 2)
            host = host_report(self.host, cpu / computing, self.workers_on_host)
            # What the process spent beyond its layers: messages and collectives, which run on
            # gloo's threads, the commit vote, the step loop.
            beyond = cpu - self.op_seconds - self.update_seconds
            host["step_cpu_seconds"] = round(max(beyond, 0.0) / self.steps, 6)
            data["host"] = host
        every = max(REPORT_STEPS, profile_every_steps(self.members, wall / self.steps))
        self.restart()
        self.reports += 1
        self.due = every + (profile_phase(self.worker, every) if self.reports == 1 else 0)
        return data
