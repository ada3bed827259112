"""The figures of `chameleonctl bench peers`, from each system's own logs, and its chart.

Both systems' runs are brought to one form: the committed steps in commit order (`Commit`), each
with the samples it trained (the sample ids its logs name, and the exact count), its mean loss and
the workers or replica groups whose work it holds. The model's history is the chain of the last
commit of each step: a step committed again (after a restore, or a job that started over) replaces
the earlier commit of that step and of every step after it. A failure-free run of the same job
trains, at step s, the samples of the positions [s*B, (s+1)*B) (`want(s)`); against those:

* samples_lost: samples of the history's steps that its commits did not train (a step dropped, a
  replica group's share missing);
* samples_repeated: samples its commits trained beyond them (counted once per extra time);
* samples_discarded: samples committed and later thrown away (a history cut by a recommit);
* resume_seconds: the kill to the first step committed after it without the victim's work (a
  step whose all-reduce the victim finished before it died may commit just after the kill);
* rejoin_seconds: the victim's return (its process started again) to the first committed step
  that holds its work;
* goodput: the history's samples per second, over the whole run (the run's first commit to its
  last) and over the fault window (kill to return);
* final_loss: the mean loss of the history's last FINAL_STEPS steps; loss_vs_failure_free: its
  relative difference from the same steps of the system's failure-free run.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FINAL_STEPS = 5


@dataclass(frozen=True)
class Commit:
    step: int
    at: float  # unix seconds
    count: int  # samples trained (exact)
    ids: tuple[int, ...]  # the ids the logs name: all of them where len(ids) == count
    loss: float | None
    members: frozenset[str]


@dataclass
class Run:
    commits: list[Commit]  # in commit order
    kill_at: float | None = None
    return_at: float | None = None
    victim: str = ""
    notes: list[str] = field(default_factory=list)


def _chains(commits: Sequence[Commit]) -> list[tuple[float, dict[int, Commit]]]:
    """After each commit, in time order: the model's history then (step -> its commit); a step
    committed again cuts the history there."""
    chain: dict[int, Commit] = {}
    out: list[tuple[float, dict[int, Commit]]] = []
    for c in sorted(commits, key=lambda c: c.at):
        chain = {s: x for s, x in chain.items() if s < c.step}
        chain[c.step] = c
        out.append((c.at, chain))
    return out


def history(commits: Sequence[Commit]) -> list[Commit]:
    """The model's history: the last commit of each step, of the chain the last commit ends."""
    chains = _chains(commits)
    return sorted(chains[-1][1].values(), key=lambda c: c.step) if chains else []


def progress(commits: Sequence[Commit]) -> list[tuple[float, int]]:
    """(time, samples in the model's history then) after each commit."""
    return [(at, sum(c.count for c in chain.values())) for at, chain in _chains(commits)]


def accounting(chain: Sequence[Commit], want: Callable[[int], list[int]]) -> tuple[int, int]:
    """(lost, repeated) of the history against the failure-free samples of its steps."""
    lost = repeated = 0
    for c in chain:
        wanted = collections.Counter(want(c.step))
        if len(c.ids) == c.count:  # every share logged: the ids themselves
            got = collections.Counter(c.ids)
            lost += sum((wanted - got).values())
            repeated += sum((got - wanted).values())
        else:  # a worker killed right after the commit left no line: its count only
            lost += max(0, wanted.total() - c.count)
            repeated += max(0, c.count - wanted.total())
    return lost, repeated


def _rate(chain: Sequence[Commit], start: float, end: float) -> float | None:
    if end <= start:
        return None
    return sum(c.count for c in chain if start < c.at <= end) / (end - start)


def _final(chain: Sequence[Commit], steps: Sequence[int]) -> float | None:
    by_step = {c.step: c.loss for c in chain}
    losses = [by_step.get(s) for s in steps]
    if not losses or any(x is None for x in losses):
        return None
    return statistics.fmean(x for x in losses if x is not None)


def figures(run: Run, failure_free: Run | None, want: Callable[[int], list[int]]) -> dict[str, Any]:
    """Every figure of one run (the module's docstring says what each is)."""
    chain = history(run.commits)
    lost, repeated = accounting(chain, want)
    after = [
        c.at
        for c in run.commits
        if run.kill_at is not None and c.at > run.kill_at and run.victim not in c.members
    ]
    back = [
        c.at
        for c in run.commits
        if run.return_at is not None and c.at > run.return_at and run.victim in c.members
    ]
    steps = [c.step for c in chain[-FINAL_STEPS:]]
    final = _final(chain, steps)
    reference = _final(history(failure_free.commits), steps) if failure_free else None
    window = None
    if run.kill_at is not None and run.return_at is not None:
        window = _rate(chain, run.kill_at, run.return_at)
    return {
        "steps": len(chain),
        "resume_seconds": min(after) - run.kill_at if after and run.kill_at else None,
        "rejoin_seconds": min(back) - run.return_at if back and run.return_at else None,
        "goodput": {
            "whole": _rate(chain, min(c.at for c in run.commits), chain[-1].at) if chain else None,
            "fault_window": window,
        },
        "samples_trained": sum(c.count for c in chain),
        "samples_lost": lost,
        "samples_repeated": repeated,
        "samples_discarded": sum(c.count for c in run.commits) - sum(c.count for c in chain),
        "final_loss": final,
        "loss_vs_failure_free": (
            final / reference - 1 if final is not None and reference else None
        ),
        "notes": run.notes,
    }


def draw(runs: dict[str, Run], path: Path, title: str) -> None:
    """Samples in each run's model over time, the clock at each run's kill; kill and return
    marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    returns: list[float] = []
    for name, run in runs.items():
        if run.kill_at is None:
            continue
        points = progress(run.commits)
        xs, ys = [t - run.kill_at for t, _ in points], [n for _, n in points]
        ax.plot(xs, ys, lw=1.6, drawstyle="steps-post", label=name)
        if run.return_at is not None:
            returns.append(run.return_at - run.kill_at)
    marks = [(0.0, "kill -9", "tab:red")]
    if returns:
        marks.append((statistics.median(returns), "return", "tab:green"))
    for at, what, colour in marks:
        ax.axvline(at, color=colour, ls="--", lw=1)
        ax.annotate(what, (at, 0.0), xycoords=("data", "axes fraction"), xytext=(3, 6),
                    textcoords="offset points", fontsize=8, color=colour)  # fmt: skip
    ax.set_xlabel("seconds since the kill")
    ax.set_ylabel("samples in the model (committed)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, loc="left")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
