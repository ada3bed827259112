"""The policies' names: what made a plan, and how the daemon chooses among the candidates.

String enums, so JSON, metrics labels and the protocol carry the same words as before
("reroute", "dynamic", ...) while the code names them once.
"""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    """What made a plan: the first plan, one of the candidates, or a restore from a checkpoint
    (a layer lost every copy)."""

    INITIAL = "initial"
    REROUTE = "reroute"
    DYNAMIC = "dynamic"
    RESTORE = "restore"
    DROP = "drop"  # the pipelines that lost a worker left out: a smaller batch (core.drop)
    # Candidates of a slow-worker decision (core.slowdecide) that no plan is made by: the current
    # plan kept at the slow pace, and the decision made as if the slow workers had failed (its
    # plan's policy is that decision's: reroute, dynamic or drop).
    KEEP = "keep"
    EXCLUDE = "exclude"


# The candidates every decision weighs, in the order a Decision lists them: the two of PAPER.md
# section 3, and drop where the job accepts a smaller batch (`training.min_global_batch`).
CANDIDATES = (Policy.REROUTE, Policy.DYNAMIC, Policy.DROP)
# The candidates of a slow-worker decision, in the order it lists them (and breaks ties): keep,
# the weighted reroute (a `reroute` plan), re-partition (a `dynamic` plan), exclude.
SLOW_CANDIDATES = (Policy.KEEP, Policy.REROUTE, Policy.DYNAMIC, Policy.EXCLUDE)


class Selection(StrEnum):
    """How a decision picks among the candidates: the higher score, or always one policy."""

    ADAPTIVE = "adaptive"
    REROUTE = "reroute"
    DYNAMIC = "dynamic"
    DROP = "drop"

    @property
    def force(self) -> Policy | None:
        """The policy this selection forces (None: the selector decides)."""
        return None if self is Selection.ADAPTIVE else Policy(self.value)
