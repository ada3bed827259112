"""The performance model: step time, gradient sync time and peak memory of a plan (PAPER.md 4-5).

Step time = the 1F1B makespan of the plan's routed schedule + the gradient sync of its groups +
the slowest worker's optimizer update; on hosts whose CPU cores more workers share than there are
cores (`spec.hosts`), never less than that step simulated with the cores shared; plus the commit
vote (a ring all-reduce of a few bytes over every executing worker: 2(n-1) latencies).

* Makespan: `schedule.build_schedule(...).makespan`, the exact longest path over the dependency
  graph, with stage durations summed from the per-layer profile (embedding and head are layers) and
  point-to-point transfers of the stage's last-layer output on the link between the two executors
  (zero on the same worker). Pipelines that share no executor are independent, so the makespan is
  taken per connected group of pipelines; an un-rerouted pipeline goes through `pipeline_seconds`,
  the same longest path specialised to one pipeline and memoised by its shape.
* Sync: a ring all-reduce per sync group, 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency, on the
  slower link when the group spans hosts; groups of one colouring round run concurrently (the round
  lasts as long as its slowest group), rounds run one after another.
* Update: each executing owner steps its layers' optimizer once per step, after the commit vote;
  the next step's pipelines wait for the slowest.
* Shared host: workers whose device is the host's CPU compete for its cores. `shared_seconds`
  runs the schedule with processor sharing (core/sharing.py): k runnable workers on a host of C
  cores each compute at min(1, C/k) of full speed, so one worker's bubbles are filled by the
  others' work, and cores idle only while fewer workers than cores can run (an uneven plan whose
  short pipelines finish first). Each worker's per-step CPU beyond its layers (messages,
  collectives, the commit vote) is spread over its ops; the updates after the vote share the
  cores too. With more workers than cores (a local CPU job) this, not the critical path, is the
  step time.
* Speed: each op's compute (forward, backward, the update) is divided by the speed of the worker
  that executes it (`WorkerSpec.speed`, 1.0 but for a slow worker), so a throttled worker slows
  exactly the ops it runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence
from itertools import repeat

from chameleond.core.layertable import LayerTable
from chameleond.core.plan import Pipeline, SyncGroup, executors
from chameleond.core.roster import roster
from chameleond.core.schedule import (
    BACKWARD,
    FORWARD,
    CommSeconds,
    Op,
    OpSeconds,
    Schedule,
    build_schedule,
)
from chameleond.core.sharing import shared_jobs_seconds, shared_makespan
from chameleond.core.spec import JobSpec, LinkSpec

Routing = Sequence[Sequence[Sequence[str]]]
# One pipeline's forward, backward and wire seconds per stage, and its micro-batches.
PathKey = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], int]
# Durations are clamped like schedule.py does, so both give the same longest path.
_MIN_SECONDS = 1e-12
VOTE_BYTES = (
    24  # per worker: [loss, 1, newest generation seen] as float64 (chameleond/worker/_loop.py)
)


def _longest_path(
    forward: Sequence[float], backward: Sequence[float], comm: Sequence[float], n_micro: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Start and end of every forward and backward op (index stage * N_m + micro-batch).

    Each op starts after the previous op of its stage and after the op it waits for on the
    neighbouring stage plus the wire. Each slot's 1F1B queue (`slot_queue`) is its warm-up
    forwards, then for j = 0 .. N_m - 1: F(s, warm_s + j) while there is one, and B(s, j). So
    after the warm-ups, sweep j runs every stage's j-th turn, last stage first: B(s, j) waits
    for B(s + 1, j) of this sweep, F(s, warm_s + j) for stage s - 1's turn of the sweep before
    (warm_(s-1) = warm_s + 1 wherever stage s still has forwards). B(s, m) needs no wait for
    F(s, m): that ran earlier on the same stage.
    """
    n = len(forward)
    fwd = [max(x, _MIN_SECONDS) for x in forward]
    bwd = [max(x, _MIN_SECONDS) for x in backward]
    size = n * n_micro
    f_start, f_end, b_start, b_end = [0.0] * size, [0.0] * size, [0.0] * size, [0.0] * size
    warm = [min(n - s - 1, n_micro) for s in range(n)]
    free = [0.0] * n
    for s in range(n):
        for i in range(s * n_micro, s * n_micro + warm[s]):
            ready = free[s]
            if s:
                arrives = f_end[i - n_micro] + comm[s - 1]
                if arrives > ready:
                    ready = arrives
            f_start[i] = ready
            free[s] = f_end[i] = ready + fwd[s]
    for j in range(n_micro):
        for s in range(n - 1, -1, -1):
            ready = free[s]
            if warm[s] + j < n_micro:
                i = s * n_micro + warm[s] + j
                if s:
                    arrives = f_end[i - n_micro] + comm[s - 1]
                    if arrives > ready:
                        ready = arrives
                f_start[i] = ready
                ready = f_end[i] = ready + fwd[s]
            i = s * n_micro + j
            if s + 1 < n:
                arrives = b_end[i + n_micro] + comm[s]
                if arrives > ready:
                    ready = arrives
            b_start[i] = ready
            free[s] = b_end[i] = ready + bwd[s]
    return f_start, f_end, b_start, b_end


def pipeline_seconds(
    forward: Sequence[float], backward: Sequence[float], comm: Sequence[float], n_micro: int
) -> float:
    """Longest path of one pipeline whose slots each have their own worker.

    forward[s], backward[s]: seconds of stage s per micro-batch; comm[s]: seconds on the wire
    between stage s and s+1 (activations forward, their gradients backward, same size).
    """
    return max(stage_finishes(forward, backward, comm, n_micro), default=0.0)


def stage_finishes(
    forward: Sequence[float], backward: Sequence[float], comm: Sequence[float], n_micro: int
) -> list[float]:
    """When each stage of one pipeline ends its last backward (its gradients are complete).

    `_longest_path`'s sweeps reduced to what this asks, with the same floating-point operations
    on the same values, so the same bits: no op table, only each stage's free time and latest
    forward; B(s, j) takes B(s + 1, j) from the stage just swept (`below`). A stage's last op is
    a backward, so its free time at the end is when its gradients are complete.
    """
    n = len(forward)
    if n_micro <= 0 or not forward:
        return [0.0] * n
    fwd = [max(x, _MIN_SECONDS) for x in forward]
    bwd = [max(x, _MIN_SECONDS) for x in backward]
    warm = [min(n - s - 1, n_micro) for s in range(n)]
    free = [0.0] * n
    latest = [0.0] * (n + 1)  # latest[s + 1]: end of stage s's latest forward; latest[0]: none
    before: list[float] = []  # the previous stage's warm-up forward ends
    for s in range(n):
        t, c, f, ends = 0.0, comm[s - 1] if s else 0.0, fwd[s], []
        for m in range(warm[s]):
            if s:
                a = before[m] + c
                if a > t:
                    t = a
            t += f
            ends.append(t)
        free[s] = latest[s + 1] = t
        before = ends
    turns = [
        (s, fwd[s], bwd[s], comm[s - 1] if s else 0.0, comm[s] if s + 1 < n else 0.0, warm[s])
        for s in range(n - 1, -1, -1)
    ]
    for j in range(n_micro):
        below = 0.0
        for s, f, b, c_up, c_down, w in turns:
            t = free[s]
            if w + j < n_micro:
                a = latest[s] + c_up
                if a > t:
                    t = a
                t += f
                latest[s + 1] = t
            a = below + c_down
            if a > t:
                t = a
            t += b
            free[s] = below = t
    return free


def overlapped_sync_end(
    ready: Sequence[float], seconds: Sequence[float], rounds: Sequence[int]
) -> float:
    """End of the gradient sync when each group starts as soon as its gradients are complete
    (`ready`: the latest last-backward among its workers) and colouring rounds stay in order:
    a group starts at max(its ready time, the end of the previous round); a round ends with its
    last group."""
    end = 0.0
    for r in sorted(set(rounds)):
        end = max(max(end, ready[i]) + seconds[i] for i, c in enumerate(rounds) if c == r)
    return end


class Estimator:
    """The model for one job spec; memoises pipeline times by shape across calls."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.table = LayerTable(spec)
        workers = roster(spec)
        self._host, self._memory, self._speed = workers.host, workers.memory, workers.speed
        self._memo: dict[PathKey, list[float]] = {}
        self._shapes: dict[tuple[tuple[tuple[int, int, float], ...], tuple[int, ...], int],
                           list[float]] = {}  # fmt: skip
        # The failure-free longest path of rerouted pipelines, by shape: a job's pipelines of one
        # length and micro-batch count on links alike are timed once per decision.
        self._ideal: dict[PathKey, tuple[list[float], list[float], list[float], list[float]]] = {}

    def link(self, a: str, b: str) -> LinkSpec:
        return self.spec.intra_host if self._host[a] == self._host[b] else self.spec.inter_host

    def transfer_seconds(self, pipe: Pipeline, boundary: int, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        nbytes = self.table.output_bytes(pipe.stages[boundary].end_layer)
        return self.link(src, dst).transfer_seconds(nbytes)

    # -- step time -------------------------------------------------------------------------

    def makespan(self, pipelines: Sequence[Pipeline], routing: Routing) -> float:
        """The 1F1B longest path of one step over all pipelines (build_schedule's makespan)."""
        return max(self.finishes(pipelines, routing).values(), default=0.0)

    def finishes(self, pipelines: Sequence[Pipeline], routing: Routing) -> dict[str, float]:
        """When each executing worker ends its last op of the step."""
        out: dict[str, float] = {}
        for group in _coupled(pipelines, routing):
            if len(group) == 1:
                pipe = pipelines[group[0]]
                times = self._own_pipeline(pipe, routing[group[0]])
                if times is not None:
                    for st, end in zip(pipe.stages, times, strict=True):
                        out[st.worker] = end
                    continue
            out.update(self._schedule([pipelines[p] for p in group], group, routing))
        return out

    def _own_pipeline(self, pipe: Pipeline, rt: Sequence[Sequence[str]]) -> list[float] | None:
        """Each stage's end, for a pipeline whose slots each run every micro-batch on their own
        worker, one worker per slot; None for any other (it is scheduled with its routing)."""
        # What the times depend on: each stage's layers and speed, each boundary's link (none
        # between two stages of one worker), the micro-batches; cheaper to key than the times.
        host, v = self._host, self._speed
        spans: list[tuple[int, int, float]] = []
        links: list[int] = []
        before = None
        for st, run in zip(pipe.stages, rt, strict=True):
            w = st.worker
            if run.count(w) != len(run):
                return None  # rerouted
            spans.append((st.first_layer, st.end_layer, v[w]))
            if before is not None:
                links.append(0 if before == w else 1 if host[before] == host[w] else 2)
            before = w
        if len({st.worker for st in pipe.stages}) < len(spans):
            return None  # a worker of several slots runs them in one queue
        shape = (tuple(spans), tuple(links), pipe.micro_batches)
        found = self._shapes.get(shape)
        if found is None:
            found = self._shapes[shape] = self._own_pipeline_times(pipe)
        return found

    def _own_pipeline_times(self, pipe: Pipeline) -> list[float]:
        t, v = self.table, self._speed
        fwd = tuple(
            t.forward_seconds(s.first_layer, s.end_layer) / v[s.worker] for s in pipe.stages
        )
        bwd = tuple(
            t.backward_seconds(s.first_layer, s.end_layer) / v[s.worker] for s in pipe.stages
        )
        comm = tuple(
            self.transfer_seconds(pipe, s, pipe.stages[s].worker, pipe.stages[s + 1].worker)
            for s in range(len(pipe.stages) - 1)
        )
        key = (fwd, bwd, comm, pipe.micro_batches)
        if key not in self._memo:
            self._memo[key] = stage_finishes(fwd, bwd, comm, pipe.micro_batches)
        return self._memo[key]

    def _schedule(
        self, pipes: Sequence[Pipeline], index: Sequence[int], routing: Routing
    ) -> dict[str, float]:
        """build_schedule's makespan for rerouted pipelines, without building its Op lists.

        The same two passes: each pipeline's failure-free ("ideal") longest path, then every
        executor running its ops in order of ideal start, with the real executors' links and
        speeds (the ideal pass, as build_schedule's, at the owners' speeds).
        """
        t, host, v = self.table, self._host, self._speed
        intra, inter = self.spec.intra_host, self.spec.inter_host
        keyed: list[tuple[float, float, int, int, int, int]] = []
        per = []
        for k, pipe in enumerate(pipes):
            n, nm = len(pipe.stages), pipe.micro_batches
            fwd = [t.forward_seconds(st.first_layer, st.end_layer) for st in pipe.stages]
            bwd = [t.backward_seconds(st.first_layer, st.end_layer) for st in pipe.stages]
            owners = [st.worker for st in pipe.stages]
            comm = [self.transfer_seconds(pipe, s, owners[s], owners[s + 1]) for s in range(n - 1)]
            own_f = tuple(x / v[w] for x, w in zip(fwd, owners, strict=True))
            own_b = tuple(x / v[w] for x, w in zip(bwd, owners, strict=True))
            key = (own_f, own_b, tuple(comm), nm)
            if key not in self._ideal:
                self._ideal[key] = _longest_path(own_f, own_b, comm, nm)
            f_start, f_end, b_start, b_end = self._ideal[key]
            for i in range(n * nm):
                s, m = divmod(i, nm)
                keyed.append((f_start[i], f_end[i], k, s, 0, m))
                keyed.append((b_start[i], b_end[i], k, s, 1, m))
            wire = [t.output_bytes(st.end_layer) for st in pipe.stages[:-1]]
            per.append(
                (
                    nm,
                    fwd,
                    bwd,
                    [intra.transfer_seconds(b) for b in wire],
                    [inter.transfer_seconds(b) for b in wire],
                    routing[index[k]],
                    [0.0] * (n * nm),
                    [0.0] * (n * nm),
                )
            )
        keyed.sort()
        free: dict[str, float] = {}
        for _, _, k, s, kind, m in keyed:
            nm, fwd, bwd, c_intra, c_inter, rt, f_end, b_end = per[k]
            w = rt[s][m]
            i = s * nm + m
            ready = free.get(w, 0.0)
            if kind == 0:
                if s > 0:
                    up = rt[s - 1][m]
                    c = (
                        0.0
                        if up == w
                        else c_intra[s - 1]
                        if host[up] == host[w]
                        else c_inter[s - 1]
                    )
                    ready = max(ready, f_end[i - nm] + c)
                end = f_end[i] = ready + max(fwd[s] / v[w], _MIN_SECONDS)
            else:
                ready = max(ready, f_end[i])
                if s + 1 < len(rt):
                    down = rt[s + 1][m]
                    c = 0.0 if down == w else c_intra[s] if host[down] == host[w] else c_inter[s]
                    ready = max(ready, b_end[i + nm] + c)
                end = b_end[i] = ready + max(bwd[s] / v[w], _MIN_SECONDS)
            free[w] = end
        return free

    def schedule(self, pipelines: Sequence[Pipeline], routing: Routing) -> Schedule:
        """`build_schedule` with this model's op and transfer times: the order the workers run,
        whose makespan `makespan` computes without building it."""
        return build_schedule(pipelines, routing, *self._timing(pipelines))

    def _timing(self, pipelines: Sequence[Pipeline]) -> tuple[OpSeconds, CommSeconds]:
        t = self.table

        def op_seconds(p: int, s: int, kind: str, w: str) -> float:
            st = pipelines[p].stages[s]
            if kind == FORWARD:
                return t.forward_seconds(st.first_layer, st.end_layer) / self._speed[w]
            return t.backward_seconds(st.first_layer, st.end_layer) / self._speed[w]

        def comm(p: int, s: int, _kind: str, src: str, dst: str) -> float:
            return self.transfer_seconds(pipelines[p], s, src, dst)

        return op_seconds, comm

    def sync_seconds(self, groups: Sequence[SyncGroup]) -> float:
        """Gradient all-reduce: ring per group; a round lasts its slowest group; rounds add up."""
        by_round: dict[int, float] = {}
        for g in groups:
            by_round[g.round] = max(by_round.get(g.round, 0.0), self.group_sync_seconds(g))
        return sum(by_round.values())

    def group_sync_seconds(self, g: SyncGroup) -> float:
        """One group's ring all-reduce of its layers' gradients."""
        if len(g.workers) <= 1:
            return 0.0
        hosts = {self._host[w] for w in g.workers}
        link = self.spec.intra_host if len(hosts) == 1 else self.spec.inter_host
        nbytes = sum(self.spec.layers[layer].param_bytes for layer in g.layers)
        return ring_allreduce_seconds(len(g.workers), nbytes, link)

    def compute_and_sync_seconds(
        self, pipelines: Sequence[Pipeline], routing: Routing, groups: Sequence[SyncGroup]
    ) -> float:
        """Makespan then sync; with `training.overlap_sync`, each group's all-reduce starts when
        its workers have ended their last op, overlapping upstream stages' backward passes."""
        if not self.spec.training.overlap_sync:
            return self.makespan(pipelines, routing) + self.sync_seconds(groups)
        finish = self.finishes(pipelines, routing)
        ready = [max(map(finish.get, g.workers, repeat(0.0)), default=0.0) for g in groups]
        seconds = [self.group_sync_seconds(g) for g in groups]
        end = overlapped_sync_end(ready, seconds, [g.round for g in groups])
        return max(max(finish.values(), default=0.0), end)

    def update_seconds(self, pipelines: Sequence[Pipeline], routing: Routing) -> float:
        """The slowest optimizer update: each owner that executes steps its own layers."""
        per = self._update_per_worker(pipelines, routing)
        return max(per.values(), default=0.0)

    def _update_per_worker(
        self, pipelines: Sequence[Pipeline], routing: Routing
    ) -> dict[str, float]:
        running = executors(routing)
        out: dict[str, float] = {}
        for pipe in pipelines:
            for st in pipe.stages:
                if st.worker in running:
                    u = (
                        self.table.update_seconds(st.first_layer, st.end_layer)
                        / self._speed[st.worker]
                    )
                    out[st.worker] = out.get(st.worker, 0.0) + u
        return out

    def shared_seconds(self, pipelines: Sequence[Pipeline], routing: Routing) -> float:
        """The step's ops and the optimizer updates after them, simulated with each shared host's
        cores shared among its runnable workers (core/sharing.py); 0 when no host listed in
        `spec.hosts` has more of the plan's executing workers than cores.

        Each executing worker on a shared host also spends `step_cpu_seconds` per step beyond its
        layers (messages, collectives, the step loop), spread evenly over its ops.
        """
        shared = self._shared(pipelines, routing)
        return shared[0] if shared else 0.0

    def busy_fraction(self, pipelines: Sequence[Pipeline], routing: Routing) -> dict[str, float]:
        """Per shared host, the fraction of its cores the plan keeps busy over `shared_seconds`:
        its workers' CPU work per step over (cores x that time). 1 on a saturated host; less
        where the plan leaves cores idle (an uneven plan's short pipelines done early). A worker
        that measures the cores the job got while this plan ran measures that fraction of the
        cores it may share (chameleond/handlers/profile.py divides it out)."""
        shared = self._shared(pipelines, routing)
        if not shared or shared[0] <= 0:
            return {}
        seconds, work = shared
        hosts = self.spec.hosts
        return {h: min(1.0, w / (hosts[h].cpu_cores * seconds)) for h, w in work.items()}

    def _shared(
        self, pipelines: Sequence[Pipeline], routing: Routing
    ) -> tuple[float, dict[str, float]] | None:
        """(the shared step's seconds, CPU work per step of each shared host), or None when no
        host is shared by more executing workers than it has cores."""
        hosts, host_of = self.spec.hosts, self._host
        executing = executors(routing)
        crowd = Counter(host_of[w] for w in executing if host_of[w] in hosts)
        if all(n <= hosts[h].cpu_cores for h, n in crowd.items()):
            return None
        cores = {h: hosts[h].cpu_cores for h in crowd}
        op_seconds, comm = self._timing(pipelines)
        ops = build_schedule(pipelines, routing, op_seconds, comm).ops
        beyond = {
            w: hosts[host_of[w]].step_cpu_seconds / len(q) if host_of[w] in hosts else 0.0
            for w, q in ops.items()
        }

        def work(op: Op) -> float:
            return op_seconds(op.pipeline, op.stage, op.kind, op.worker) + beyond[op.worker]

        updates: dict[str, list[float]] = {}
        for w, u in self._update_per_worker(pipelines, routing).items():
            updates.setdefault(host_of[w], []).append(u)
        seconds = shared_makespan(ops, work, comm, host_of, cores) + max(
            (shared_jobs_seconds(u, cores.get(h)) for h, u in updates.items()), default=0.0
        )
        busy = dict.fromkeys(cores, 0.0)
        for w, q in ops.items():
            if host_of[w] in busy:
                busy[host_of[w]] += sum(work(op) for op in q)
        for h, per_worker in updates.items():
            if h in busy:
                busy[h] += sum(per_worker)
        return seconds, busy

    def vote_seconds(self, routing: Routing) -> float:
        """The commit vote: an all-reduce of a few numbers per worker over every executing worker,
        once per step; its cost is the link latency of the ring's 2(n-1) hops."""
        executing = executors(routing)
        hosts = {self._host[w] for w in executing}
        link = self.spec.intra_host if len(hosts) <= 1 else self.spec.inter_host
        return ring_allreduce_seconds(len(executing), VOTE_BYTES * len(executing), link)

    def step_seconds(
        self, pipelines: Sequence[Pipeline], routing: Routing, groups: Sequence[SyncGroup]
    ) -> float:
        """The critical path (makespan, gradient sync, update) or, on shared hosts, the step with
        their cores shared, whichever is longer; plus the commit vote, during which nobody
        computes."""
        critical = self.compute_and_sync_seconds(pipelines, routing, groups) + self.update_seconds(
            pipelines, routing
        )
        return max(critical, self.shared_seconds(pipelines, routing)) + self.vote_seconds(routing)

    # -- memory ----------------------------------------------------------------------------

    def peak_memory(
        self, pipelines: Sequence[Pipeline], routing: Routing, excluded: Collection[str] = ()
    ) -> dict[str, int]:
        """Peak bytes per worker: owned state + stashed activations of every stream it executes.

        A rerouting peer executes k micro-batches of a failed slot besides its own; those stash at
        most min(N_pp - s, k) activations of that stage. Summing the per-stream peaks bounds the
        merged order's peak from above (each stream alone never exceeds its own peak).
        """
        t = self.table
        out: dict[str, int] = {}
        slot: dict[tuple[int, int, int], int] = {}  # (layers, stashed micro-batches) -> bytes
        for p, pipe in enumerate(pipelines):
            n = len(pipe.stages)
            for s, st in enumerate(pipe.stages):
                a, b, owner, executing = st.first_layer, st.end_layer, st.worker, routing[p][s]
                if owner not in excluded and executing.count(owner) == len(executing):
                    # The owner runs every micro-batch of its slot (most slots).
                    key = (a, b, min(n - s, len(executing)))
                    own = slot.get(key)
                    if own is None:
                        own = slot[key] = t.state_bytes(a, b) + key[2] * t.activation_bytes(a, b)
                    out[owner] = out.get(owner, 0) + own
                    continue
                if owner not in excluded:
                    out[owner] = out.get(owner, 0) + t.state_bytes(a, b)
                counts: dict[str, int] = {}
                for w in executing:
                    counts[w] = counts.get(w, 0) + 1
                for w, k in counts.items():
                    out[w] = out.get(w, 0) + min(n - s, k) * t.activation_bytes(a, b)
        return out

    def over_memory(self, memory: dict[str, int]) -> str | None:
        """The first worker whose peak exceeds its device memory, as a reason, or None."""
        if not memory:
            return None
        # The first of the largest overshoots, in `memory`'s order.
        w = max(memory, key=lambda w: memory[w] - self._memory[w])
        if memory[w] > self._memory[w]:
            return f"worker {w} needs {memory[w]} bytes, has {self._memory[w]} (out of memory)"
        return None


def ring_allreduce_seconds(n: float, nbytes: float, link: LinkSpec) -> float:
    """Ring all-reduce of `nbytes` over n workers: 2(n-1) steps of nbytes/n, each paying latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_second + 2 * (n - 1) * (
        link.latency_seconds
    )


def closed_form_seconds(n_stages: int, n_micro: int, t_f: float, t_b: float) -> float:
    """Symmetric uniform 1F1B pipeline: (N_pp + N_m - 1)(t_f + t_b)."""
    return (n_stages + n_micro - 1) * (t_f + t_b)


def reroute_bound_seconds(
    n_stages: int,
    n_micro: int,
    n_pipelines: int,
    failed_per_stage: Sequence[int],
    t_f: float,
    t_b: float,
) -> float:
    """PAPER.md section 4's conservative rerouting estimate; inf when a stage lost every replica.

    Each surviving peer of stage i takes N_m * F_i / (N_dp - F_i) extra micro-batch slots, added
    to the pipeline as if none of them fitted in a bubble.
    """
    extra = 0.0
    for f in failed_per_stage:
        if f >= n_pipelines:
            return math.inf
        extra += n_micro * f / (n_pipelines - f)
    return (n_stages + n_micro - 1 + extra) * (t_f + t_b)


def _coupled(pipelines: Sequence[Pipeline], routing: Routing) -> list[list[int]]:
    """Pipelines that share an executor, directly or through others (union-find)."""
    parent = list(range(len(pipelines)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_seen: dict[str, int] = {}
    for p in range(len(pipelines)):
        for stage in routing[p]:
            # Most stages run on their owner alone.
            for w in (stage[0],) if stage.count(stage[0]) == len(stage) else set(stage):
                q = first_seen.setdefault(w, p)
                if q != p:
                    parent[find(p)] = find(q)
    groups: dict[int, list[int]] = {}
    for p in range(len(pipelines)):
        groups.setdefault(find(p), []).append(p)
    return list(groups.values())


__all__ = [
    "BACKWARD",
    "FORWARD",
    "Estimator",
    "LayerTable",
    "closed_form_seconds",
    "overlapped_sync_end",
    "pipeline_seconds",
    "reroute_bound_seconds",
    "ring_allreduce_seconds",
    "stage_finishes",
]
