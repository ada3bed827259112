"""Naming a live peer that never builds the generation.

A generation that fails with every process alive is built again (WorkerRuntime.follow_plans). When
one member hangs (a kernel that never returns, a deadlock in its training thread), its process and
its Redis connections live on and its heartbeats go on, so nothing names it, and the others would
build the generation again for ever. The rendezvous of each attempt records who joined
(chameleond.worker._rendezvous): a member absent from ABSENT_ATTEMPTS attempts in a row, each given
up after --group-timeout, is reported failed. One attempt is not evidence: a member still blocked in
the failed step's collective can arrive after the first attempt was given up."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

ABSENT_ATTEMPTS = 3


@dataclass
class Absences:
    """Per generation, how many attempts in a row each member was absent from."""

    generation: int = 0
    streak: dict[str, int] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    def built(self, generation: int) -> None:
        """Every member joined an attempt of `generation`."""
        self.generation, self.streak, self.reported = generation, {}, set()

    def abandoned(
        self, generation: int, peers: Iterable[str], absent: Collection[str]
    ) -> list[str]:
        """An attempt of `generation` was given up with `absent` not joined; the peers to report
        failed now (each once)."""
        if generation != self.generation:
            self.built(generation)
        due = []
        for w in peers:
            self.streak[w] = self.streak.get(w, 0) + 1 if w in absent else 0
            if self.streak[w] >= ABSENT_ATTEMPTS and w not in self.reported:
                due.append(w)
        self.reported.update(due)
        return due
