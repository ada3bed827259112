"""The policies' names: what made a plan, and how the daemon chooses among the candidates.

String enums, so JSON, metrics labels and the protocol carry the same words as before
("reroute", "dynamic", ...) while the code names them once.
"""

from __future__ import annotations

from enum import StrEnum


class Policy(StrEnum):
    """What made a plan: the first plan, one of the two candidates, or a restore from a checkpoint
    (a layer lost every copy)."""

    INITIAL = "initial"
    REROUTE = "reroute"
    DYNAMIC = "dynamic"
    RESTORE = "restore"
    DROP = "drop"


# The two candidates every decision weighs (PAPER.md section 3).
CANDIDATES = (Policy.REROUTE, Policy.DYNAMIC)


class Selection(StrEnum):
    """How a decision picks among the candidates: the higher score, or always one policy."""

    ADAPTIVE = "adaptive"
    REROUTE = "reroute"
    DYNAMIC = "dynamic"

    @property
    def force(self) -> Policy | None:
        """The policy this selection forces (None: the selector decides)."""
        return None if self is Selection.ADAPTIVE else Policy(self.value)
