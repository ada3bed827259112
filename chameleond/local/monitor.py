"""Watching a running job from outside: everything on its events and decisions streams, in order.

The monitor reads with plain XREAD (never the daemon's consumer group, so it takes nothing from
the daemon) and keeps every entry it has seen: the report is built from exactly these. It also
tracks, incrementally, which steps have committed: a step of generation g commits once every worker
of g's plan has reported it.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis

from chameleond.core.plan import PlanError, plan_from_dict
from chameleond.protocol import Keys
from chameleond.records import DecisionRecord, Entry, TransitionRecord, entry_seconds, read_record


@dataclass(frozen=True)
class Commit:
    generation: int
    step: int
    at: float
    loss: float | None


class StreamMonitor:
    def __init__(self, client: redis.Redis, job: str) -> None:
        self.client = client  # decode_responses=True
        self.keys = Keys(job)
        self.events: list[Entry] = []
        self.decisions: list[Entry] = []
        self._last_event = "0-0"
        self._last_decision = "0-0"
        self.members: dict[int, frozenset[str]] = {}  # generation -> workers of its plan
        self.plans: dict[int, dict[str, Any]] = {}  # generation -> the plan document
        self._reports: dict[tuple[int, int], set[str]] = defaultdict(set)
        self._losses: dict[tuple[int, int], list[float]] = defaultdict(list)
        self._committed: set[tuple[int, int]] = set()
        self.commits: list[Commit] = []
        self.state = "starting"
        self.generation: int | None = None
        self.policy = ""

    # -- reading -------------------------------------------------------------------------------
    def poll(self, block_ms: int = 100) -> list[Commit]:
        """Read what is new on both streams; returns the steps that committed meanwhile."""
        got = cast(
            Any,
            self.client.xread(
                {self.keys.events: self._last_event, self.keys.decisions: self._last_decision},
                count=2000,
                block=block_ms,
            ),
        )
        new_commits: list[Commit] = []
        for stream, entries in got or []:
            for entry_id, fields in entries:
                if stream == self.keys.events:
                    self._last_event = entry_id
                    self.events.append((entry_id, fields))
                    if fields.get("type") == "step":
                        new_commits += self._on_step(entry_id, fields)
                else:
                    self._last_decision = entry_id
                    self.decisions.append((entry_id, fields))
                    self._on_decision(read_record(entry_id, fields))
        return new_commits

    def _on_decision(self, r: DecisionRecord | TransitionRecord | None) -> None:
        if isinstance(r, TransitionRecord):
            self.state = r.target or self.state
        elif isinstance(r, DecisionRecord) and r.selected:
            self.policy = r.selected
            self.generation = max(self.generation or 0, r.generation)

    def _plan_members(self, generation: int) -> frozenset[str] | None:
        if generation in self.members:
            return self.members[generation]
        raw = self.client.get(self.keys.plan)
        if raw is None:
            return None
        try:
            doc = json.loads(cast(str, raw))
            plan = plan_from_dict(doc)
        except (json.JSONDecodeError, PlanError):
            return None
        self.members[plan.generation] = frozenset(plan.workers)
        self.plans[plan.generation] = doc
        if plan.generation >= (self.generation or 0):
            self.generation = plan.generation
            if plan.policy != "initial" or not self.policy:
                self.policy = plan.policy
        return self.members.get(generation)

    def _on_step(self, entry_id: str, f: Mapping[str, str]) -> list[Commit]:
        try:
            key = (int(f["generation"]), int(f["step"]))
        except (KeyError, ValueError):
            return []
        self._reports[key].add(f.get("worker", ""))
        with contextlib.suppress(ValueError):
            self._losses[key].append(float(f.get("loss", "nan")))
        members = self._plan_members(key[0])
        if key in self._committed or members is None or not members <= self._reports[key]:
            return []
        self._committed.add(key)
        losses = [x for x in self._losses[key] if x == x]
        commit = Commit(key[0], key[1], entry_seconds(entry_id), max(losses) if losses else None)
        self.commits.append(commit)
        return [commit]

    # -- views ---------------------------------------------------------------------------------
    @property
    def last_commit(self) -> Commit | None:
        return self.commits[-1] if self.commits else None

    def first_commit_on(self, generation: int) -> Commit | None:
        return next((c for c in self.commits if c.generation == generation), None)

    def read_all(self) -> None:
        """Drain both streams (after training ended, before the report)."""
        while self.poll(block_ms=1):
            pass
        # poll returns commits only; one more pass catches entries that committed nothing.
        before = len(self.events) + len(self.decisions)
        while True:
            self.poll(block_ms=1)
            after = len(self.events) + len(self.decisions)
            if after == before:
                return
            before = after
