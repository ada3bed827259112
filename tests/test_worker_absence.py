"""Naming a live peer that never joins the generation's attempts (chameleond.worker._absence)."""

from __future__ import annotations

from chameleond.worker._absence import ABSENT_ATTEMPTS, Absences

PEERS = ("w0", "w2", "w3")


def test_a_peer_absent_from_attempts_in_a_row_is_named_once() -> None:
    a = Absences()
    for _ in range(ABSENT_ATTEMPTS - 1):
        assert a.abandoned(1, PEERS, ("w3",)) == []
    assert a.abandoned(1, PEERS, ("w3",)) == ["w3"]
    assert a.abandoned(1, PEERS, ("w3",)) == []  # reported already


def test_an_arrival_or_a_built_attempt_breaks_the_streak() -> None:
    a = Absences()
    a.abandoned(1, PEERS, ("w3", "w2"))
    a.abandoned(1, PEERS, ("w3",))  # w2 was only late once
    a.built(1)  # everyone joined: the generation failed later, in training
    for _ in range(ABSENT_ATTEMPTS - 1):
        assert a.abandoned(1, PEERS, ("w3",)) == []
    a.abandoned(1, PEERS, ())
    assert a.abandoned(1, PEERS, ("w3",)) == []


def test_a_new_generation_starts_counting_again() -> None:
    a = Absences()
    for _ in range(ABSENT_ATTEMPTS - 1):
        a.abandoned(1, PEERS, ("w3",))
    assert a.abandoned(2, PEERS, ("w3",)) == []
