"""The selector: the published score example, the break-even D, the online D estimator and the
window to the next fault or return."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chameleond.core import selector
from chameleond.core.selector import break_even_seconds, estimate_mtbf, fault_events, score


def test_published_example() -> None:
    # B = 10; rerouting: t_step 2 s, no transition; dynamic: t_step 1 s, 10 s transition.
    assert score(10, 2.0, 0.0, 15.0) == pytest.approx(5.0)
    assert score(10, 1.0, 10.0, 15.0) == pytest.approx(10 / 3)
    assert score(10, 2.0, 0.0, 40.0) == pytest.approx(5.0)
    assert score(10, 1.0, 10.0, 40.0) == pytest.approx(7.5)
    assert break_even_seconds(2.0, 0.0, 1.0, 10.0) == pytest.approx(20.0)
    assert score(10, 2.0, 0.0, 20.0) == pytest.approx(score(10, 1.0, 10.0, 20.0))


def test_unusable_when_the_transition_outlasts_the_window() -> None:
    assert score(10, 1.0, 10.0, 10.0) == 0.0
    assert score(10, 1.0, 10.0, 5.0) == 0.0
    assert score(10, 2.0, 3.0, math.inf) == 5.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1.0, 0.0, 10.0), "global_batch"),
        ((10, 0.0, 0.0, 10.0), "step_seconds"),
        ((10, math.nan, 0.0, 10.0), "step_seconds"),
        ((10, 1.0, -1.0, 10.0), "transition_seconds"),
        ((10, 1.0, 0.0, 0.0), "mtbf_seconds"),
        ((10, 1.0, 0.0, math.nan), "mtbf_seconds"),
    ],
)
def test_score_rejects_bad_input(args: tuple[int, float, float, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        score(*args)


@given(st.floats(0.1, 100.0), st.floats(0.0, 100.0), st.floats(0.1, 100.0), st.floats(0.0, 100.0))
def test_break_even_is_where_the_scores_cross(sa: float, ta: float, sb: float, tb: float) -> None:
    d = break_even_seconds(sa, ta, sb, tb)
    if d is None:
        return
    assert score(1, sa, ta, d) == pytest.approx(score(1, sb, tb, d), rel=1e-6, abs=1e-12)
    # Above the crossing the faster step wins.
    fast, slow = ((sa, ta), (sb, tb)) if sa < sb else ((sb, tb), (sa, ta))
    assert score(1, *fast, 2 * d) >= score(1, *slow, 2 * d)


def test_no_crossing_when_one_candidate_dominates() -> None:
    assert break_even_seconds(1.0, 0.0, 2.0, 5.0) is None  # faster and no transition
    assert break_even_seconds(1.0, 3.0, 1.0, 5.0) is None  # same step


def test_mtbf_with_no_faults_is_the_prior_plus_exposure() -> None:
    assert estimate_mtbf([], now=0.0, started=0.0, prior_seconds=3600.0) == 3600.0
    assert estimate_mtbf([], now=1800.0, started=0.0, prior_seconds=3600.0) == 5400.0
    # A heavier prior moves less with the same quiet exposure.
    assert estimate_mtbf([], 1800.0, 0.0, 3600.0, prior_weight=4.0) == (4 * 3600 + 1800) / 4


def test_mtbf_follows_the_observed_rate() -> None:
    # 100 faults, one every 60 s: the estimate approaches 60 s whatever the prior said.
    faults = [60.0 * (i + 1) for i in range(100)]
    d = estimate_mtbf(faults, now=6000.0, started=0.0, prior_seconds=3.1 * 3600)
    assert d == pytest.approx((3.1 * 3600 + 6000) / 101)
    assert 60 < d < 200


def test_a_burst_counts_as_one_event() -> None:
    burst = [100.0, 100.0, 100.2, 100.9, 101.5]  # one host going down, reported by 5 devices
    assert fault_events(burst) == [100.0, 101.5]  # 101.5 is 1.5 s after the event: a new one
    assert fault_events(burst, burst_seconds=5.0) == [100.0]
    one = estimate_mtbf([100.0], 1000.0, 0.0, 3600.0)
    assert estimate_mtbf(burst, 1000.0, 0.0, 3600.0, burst_seconds=5.0) == one
    # A zero window still folds faults stamped at the same instant (one event, several reports).
    assert estimate_mtbf(burst, 1000.0, 0.0, 3600.0, burst_seconds=0.0) == (3600 + 1000) / 5


def test_faults_outside_the_window() -> None:
    # Before `started`: another run's history. After `now`: clock skew, the window extends to it.
    assert estimate_mtbf([-50.0], 100.0, 0.0, 3600.0) == 3700.0
    assert estimate_mtbf([110.0], 100.0, 0.0, 3600.0) == (3600 + 110) / 2


@given(
    st.lists(st.floats(0.0, 1e6), max_size=30),
    st.floats(0.0, 1e6),
    st.floats(1.0, 1e6),
    st.floats(0.01, 100.0),
)
def test_mtbf_falls_with_a_new_event_and_grows_with_quiet_time(
    faults: list[float], now: float, prior: float, weight: float
) -> None:
    now = max([now, *faults])
    d = estimate_mtbf(faults, now, 0.0, prior, weight)
    assert d > 0
    quiet = estimate_mtbf(faults, now + 100.0, 0.0, prior, weight)
    assert quiet > d
    # At the same moment, one more fault event (well apart from the others) means a shorter D.
    t = max([now, *faults]) + 10.0
    assert estimate_mtbf([*faults, t], t, 0.0, prior, weight) < estimate_mtbf(
        faults, t, 0.0, prior, weight
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"now": 0.0, "started": 10.0}, "before started"),
        ({"prior_seconds": 0.0}, "prior_seconds"),
        ({"prior_weight": -1.0}, "prior_weight"),
        ({"fault_times": [math.nan]}, "not a time"),
        ({"now": math.inf}, "not a time"),
        ({"burst_seconds": -1.0}, "burst_seconds"),
    ],
)
def test_mtbf_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "fault_times": [], "now": 100.0, "started": 0.0, "prior_seconds": 3600.0,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        estimate_mtbf(**args)  # type: ignore[arg-type]


def test_window_without_enough_repairs_seen_is_the_time_to_the_next_fault() -> None:
    assert selector.window_seconds(8000.0, [], [100.0]) == 8000.0
    assert selector.window_seconds(8000.0, [14400.0] * 3, []) == 8000.0  # nobody is out
    # Out longer than every repair seen: not expected back.
    assert selector.window_seconds(8000.0, [3600.0] * 3, [4000.0]) == 8000.0
    # Fewer than RETURN_SUPPORT repairs lasted longer than the time out: no return expected.
    assert selector.RETURN_SUPPORT == 3
    assert selector.window_seconds(8000.0, [14400.0, 14400.0, 60.0], [100.0]) == 8000.0


def test_a_return_due_soon_ends_the_window() -> None:
    """Hosts come back after 4 h; one has been out 13,253 s, so it returns in 1,147 s:
    E[min(T_fault, 1147)] with faults of mean 8,000 s is 8000 (1 - e^(-1147/8000))."""
    d = selector.window_seconds(8000.0, [14400.0] * 3, [13253.0, 10.0])
    assert d == pytest.approx(8000.0 * (1 - math.exp(-1147.0 / 8000.0)), rel=1e-12)
    assert 1060 < d < 1147
    # The residual is the mean over the repairs longer than the time out: (600+1600+1100) / 3.
    d = selector.window_seconds(math.inf, [1000.0, 2000.0, 1500.0, 100.0], [400.0])
    assert d == pytest.approx(1100.0)
    # A return far off barely shortens it.
    assert selector.window_seconds(60.0, [14400.0] * 3, [0.0]) == pytest.approx(60.0, rel=1e-9)


def test_a_hosts_workers_back_from_one_fault_are_one_repair() -> None:
    """Eight workers out within a second of each other and back a few seconds apart: one repair
    event of their mean time out; another host's, out at another time, is a second."""
    host = [(100.0 + 0.1 * i, 3600.0 + i) for i in range(8)]
    assert selector.repair_events([*host, (5000.0, 60.0)]) == [3603.5, 60.0]
    # One host's repair is one event: short of RETURN_SUPPORT, no return is expected from it.
    assert selector.window_seconds(8000.0, selector.repair_events(host), [10.0]) == 8000.0
    with pytest.raises(ValueError, match="repair_seconds"):
        selector.repair_events([(1.0, -2.0)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.0, [], []), "mtbf_seconds"),
        ((10.0, [-1.0], []), "repair_seconds"),
        ((10.0, [1.0], [math.nan]), "down_for"),
    ],
)
def test_window_rejects_bad_input(
    args: tuple[float, list[float], list[float]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        selector.window_seconds(*args)
