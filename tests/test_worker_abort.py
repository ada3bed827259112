"""A generation aborted from another thread (what a worker on NCCL or HCCL does when a peer's
process is gone, since those backends do not fail on their own): the watch that finds the dead
peer, and a result that the abort may have cut short never being used.

gloo here: its abort leaves a one-member group working, which stands for NCCL returning an
unfinished buffer instead of an error, so only the generation's own check can refuse it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from worker_harness import builtin_model

from chameleond.cli.up import build_spec_document
from chameleond.core.decide import initial_plan
from chameleond.core.spec import parse_spec
from chameleond.jobs import load_default_spec
from chameleond.worker._backend import new_group, parse_device
from chameleond.worker._generation import Generation
from chameleond.worker._liveness import PeerWatch
from chameleond.worker._migrate import reconcile
from chameleond.worker._state import WorkerState


def test_peer_watch_reports_the_gone_peers_once_then_ends() -> None:
    answers = iter([[], [], ["w3"], ["w3", "w4"]])
    seen: list[list[str]] = []
    done = threading.Event()

    def on_gone(peers: list[str]) -> None:
        seen.append(peers)
        done.set()

    watch = PeerWatch(lambda: next(answers), on_gone, period=0.01, confirm=0)
    watch.start()
    assert done.wait(5)
    watch.join(5)
    assert seen == [["w3"]] and not watch.is_alive()


def test_peer_watch_ignores_a_peer_missing_for_less_than_confirm() -> None:
    """A live worker whose connections dropped for a moment is back before `confirm`; a dead one
    stays missing and is reported once it has been for `confirm` seconds."""
    period, confirm = 0.01, 0.2
    blip = int(0.1 / period)  # w2 missing for about 0.1 s, then back
    answers = iter([[]] * 3 + [["w2"]] * blip + [[]] * 3 + [["w4"]] * 1000)
    seen: list[tuple[list[str], float]] = []
    done = threading.Event()
    first_w4: list[float] = []

    def find_gone() -> list[str]:
        found = next(answers)
        if found == ["w4"] and not first_w4:
            first_w4.append(time.monotonic())
        return found

    def on_gone(peers: list[str]) -> None:
        seen.append((peers, time.monotonic()))
        done.set()

    watch = PeerWatch(find_gone, on_gone, period=period, confirm=confirm)
    watch.start()
    assert done.wait(10)
    watch.join(5)
    [(peers, at)] = seen
    assert peers == ["w4"]
    assert at - first_w4[0] >= confirm


def test_a_stopped_peer_watch_ends_without_a_report() -> None:
    polled = threading.Event()

    def find_gone() -> list[str]:
        polled.set()
        return []

    watch = PeerWatch(find_gone, lambda _: pytest.fail("no peer is gone"), period=0.01)
    watch.start()
    assert polled.wait(5)
    watch.stop()
    watch.join(5)
    assert not watch.is_alive()


def test_reconcile_refuses_the_rows_of_an_aborted_generation() -> None:
    spec = parse_spec(build_spec_document(
        load_default_spec(), job="t", workers=1, pp=1, bind_addresses=[], mtbf_prior_seconds=None,
    ))  # fmt: skip
    plan = initial_plan(spec)
    cpu = parse_device("cpu")
    model = builtin_model(spec.arch, spec.training.global_batch, spec.training.micro_batch)
    state = WorkerState(model, cpu.torch_device)
    gen = Generation.for_plan(plan, "w0", cpu, "i")
    gen.world_group = new_group(dist.HashStore(), 0, 1, cpu, bind_address="127.0.0.1",
                                timeout=timedelta(seconds=5))  # fmt: skip
    done = reconcile(gen, state)
    assert done.committed_step == -1 and set(state.layers) == set(plan.owned_layers("w0"))

    gen.abort("peer(s) w9 gone")
    assert gen.world_group.allreduce([torch.ones(1)]).wait()  # the group still "works"
    with pytest.raises(RuntimeError, match="generation 1 aborted: peer\\(s\\) w9 gone"):
        reconcile(gen, state)


class _SlowAbortGroup:
    """Stands for an NCCL communicator, which cannot exist on this CPU-only machine: its abort
    took 1.0 s on an H200 (docs/gpu.md)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.aborted = threading.Event()

    def abort(self) -> None:
        time.sleep(self.seconds)
        self.aborted.set()


def test_an_ended_generation_on_nccl_is_torn_down_off_the_workers_path() -> None:
    """A generation of an accelerator closes at once, its groups aborted in a thread of their
    own while the next builds; at exit the worker waits for them. On gloo (abort in
    microseconds) the groups are aborted and dropped where the generation closes."""
    from chameleond.worker._backend import DeviceChoice, wait_retired

    gen = Generation.__new__(Generation)
    gen.device = DeviceChoice("cuda", 0, "nccl")
    slow = [_SlowAbortGroup(0.5), _SlowAbortGroup(0.5)]
    gen.world_group, gen.sync_groups = slow[0], {0: slow[1]}
    t0 = time.perf_counter()
    gen.close()
    assert time.perf_counter() - t0 < 0.5  # under one abort's time, however loaded the machine
    assert gen.groups() == [] and not any(g.aborted.is_set() for g in slow)
    assert wait_retired(5.0)
    assert all(g.aborted.is_set() for g in slow)

    gloo = Generation.__new__(Generation)
    gloo.device = parse_device("cpu")
    quick = _SlowAbortGroup(0.05)
    gloo.world_group, gloo.sync_groups = quick, {}
    gloo.close()
    assert quick.aborted.is_set()  # before close returned
