"""What the daemon shows: /api/v1/status, the progress record and the Prometheus gauges.

Read-only views of the job: nothing here changes it, so the HTTP handlers and the periodic gauge
refresh can call them at any time.
"""

from __future__ import annotations

import time
from typing import Any

from chameleond.daemon.config import Config
from chameleond.daemon.metrics import Metrics, TrainingFigures
from chameleond.jobstate.job import Job


def progress(job: Job) -> dict[str, Any]:
    """The last step the job committed, its measured throughput and what the workers reported
    about it, and the newest evaluation (persisted every second; `chameleonctl status` reads it).
    A figure no report named is None."""
    meter = job.meter
    last = meter.last
    return {
        "at": time.time(),
        "generation": meter.generation,
        "step": meter.step,
        "samples_per_second": meter.samples_per_second,
        "tokens_per_second": meter.tokens_per_second,
        "loss": meter.last_loss,
        "grad_norm": last.grad_norm if last else None,
        "learning_rate": last.learning_rate if last else None,
        "loss_scale": last.loss_scale if last else None,
        "eval_loss": meter.eval_loss,
        "eval_step": meter.eval_step if meter.eval_loss is not None else None,
    }


def training_figures(job: Job) -> TrainingFigures:
    meter = job.meter
    last = meter.last
    return TrainingFigures(
        loss=meter.last_loss,
        grad_norm=last.grad_norm if last else None,
        learning_rate=last.learning_rate if last else None,
        loss_scale=last.loss_scale if last else None,
        eval_loss=meter.eval_loss,
        tokens_per_second=meter.tokens_per_second,
        trained_samples=meter.trained_samples,
        trained_tokens=meter.trained_tokens,
        skipped_samples=meter.skipped_samples,
        overflow_steps=meter.overflow_steps,
    )


def status(job: Job, cfg: Config, *, standby_for: str = "") -> dict[str, Any]:
    """/api/v1/status; a daemon standing by names the leader (the job is the leader's to show)."""
    if standby_for:
        return {"job": cfg.job, "standby": True, "leader": standby_for}
    now = time.time()
    m = job.machine
    timeout = job.heartbeat_timeout(cfg.heartbeat_timeout_seconds)
    states = job.worker_states(now, timeout)
    workers = {}
    for wid, state in sorted(states.items()):
        rec = job.workers[wid]
        age = round(now - rec.last_heartbeat, 3) if rec.last_heartbeat else None
        workers[wid] = {
            "state": state,
            "liveness": job.liveness(rec, now, timeout),
            "host": rec.host,
            "device": rec.device,
            "memory_bytes": rec.memory_bytes,
            "heartbeat_age_seconds": age,
        }
    fu = job.follow_up
    return {
        "job": cfg.job,
        "state": m.phase.value,
        "generation": m.generation,
        "attempt": job.attempt(),
        "policy": cfg.policy,
        "plan_policy": job.plan.policy if job.plan else None,
        "workers": workers,
        "failed": sorted(m.failed),
        # Registrations from outside the spec waiting for their profile (bounded, expiring).
        "registrations_waiting": job.waiting_registrations(now),
        "pending_faults": dict(sorted(m.pending_faults.items())),
        "waiting_faults": [
            {**f, "age_seconds": round(now - f["received_at"], 3) if f["received_at"] else None}
            for f in job.waiting_faults()
        ],
        "faults_waited_seconds": dict(sorted(job.waited.items())),
        "workers_registered": job.registered_spec_workers(),
        "workers_needed": cfg.min_workers or len(job.base_spec.workers),
        "awaiting_ready": sorted(m.awaiting_ready),
        "last_decision": job.last_decision,
        "follow_up": None
        if fu is None
        else {
            "after_generation": fu.after_generation,
            "policy": fu.plan.policy,
            "after_seconds": fu.after_seconds,
            "waiting_for_step": sorted(m.awaiting_step),
        },
        "mtbf_seconds": job.mtbf(now),
        "window_seconds": job.window(now),
        "progress": progress(job),
        "estimated_samples_per_second": job.plan.samples_per_second if job.plan else None,
        "model_samples_per_second": _model_throughput(job),
        # A new plan's communicator rebuild as the planner prices it, and as measured per backend.
        "rebuild_seconds": job.spec.rebuild_seconds,
        "rebuild_measured_seconds": {b: s for b, (_, s) in sorted(job.rebuilds.newest.items())},
        # The link figures the planner prices transfers with, and the measured pairs behind them.
        "links": job.links_view(),
        # Fail-slow workers (jobstate/slowness.py): their speed and since when, and how long an
        # episode is expected to last (what a slow-worker decision scores over).
        "slow": {
            w: {"speed": s.speed, "since": s.since}
            for w, s in sorted(job.slowness.workers.items())
            if s.slow
        },
        "slow_expected_seconds": job.slowness.expected_seconds(cfg.slow_episode_prior_seconds),
        "slow_mitigation": cfg.slow_mitigation,
    }


def _model_throughput(job: Job) -> float | None:
    step = job.model_step_seconds(time.time())
    return job.plan.global_batch / step if job.plan and step else None


def refresh_gauges(job: Job, metrics: Metrics, cfg: Config) -> None:
    metrics.set_phase(job.machine.phase)
    metrics.generation.set(job.machine.generation)
    metrics.attempt.set(job.attempt())
    timeout = job.heartbeat_timeout(cfg.heartbeat_timeout_seconds)
    metrics.set_workers(job.worker_states(time.time(), timeout))
    metrics.training_throughput.set(job.meter.samples_per_second)
    metrics.set_training(training_figures(job))
    metrics.estimated_throughput.set(job.plan.samples_per_second if job.plan else 0.0)
    metrics.model_throughput.set(_model_throughput(job) or 0.0)
    now = time.time()
    metrics.expected_fault_seconds.set(job.mtbf(now))
    metrics.decision_window_seconds.set(job.window(now))
    metrics.set_speeds(job.workers, job.slowness.speeds())
    metrics.set_slow_episodes(job.slowness.detected, job.slowness.recovered)
    newest = job.checkpoints.newest(len(job.base_spec.layers))
    metrics.checkpoint_step.set(-1 if newest is None else newest)
