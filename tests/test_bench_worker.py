"""chameleonctl bench worker: how a faulted run is compared with the failure-free run."""

from __future__ import annotations

from chameleond.bench.worker import compare_runs

CLEAN = {0: {1: 6.9}, 1: {1: 6.8}, 2: {1: 6.7}, 3: {1: 6.6}}


def test_equal_runs_match_exactly() -> None:
    faulted = {0: {1: 6.9}, 1: {1: 6.8}, 2: {2: 6.7}, 3: {2: 6.6}}
    out = compare_runs(CLEAN, faulted, 4, global_batch=12)
    assert out == {
        "loss_match": 0.0,
        "samples_skipped": 0,
        "samples_repeated": 0,
        "steps_compared": 4,
        "failure_free_missing": [],
    }


def test_the_largest_difference_over_every_reported_loss() -> None:
    faulted = {0: {1: 6.9}, 1: {1: 6.8 + 3e-6}, 2: {2: 6.7 - 5e-6}, 3: {2: 6.6}}
    assert abs(compare_runs(CLEAN, faulted, 4, 12)["loss_match"] - 5e-6) < 1e-12


def test_a_missing_step_is_skipped_samples_and_a_step_in_two_generations_repeated() -> None:
    faulted = {0: {1: 6.9}, 2: {1: 6.7, 2: 6.75}, 3: {2: 6.6}}
    out = compare_runs(CLEAN, faulted, 4, global_batch=12)
    assert out["samples_skipped"] == 12  # step 1
    assert out["samples_repeated"] == 12  # step 2, committed in generations 1 and 2
    assert abs(out["loss_match"] - 0.05) < 1e-9
    assert out["steps_compared"] == 3


def test_steps_the_failure_free_run_lacks_are_named() -> None:
    out = compare_runs({0: {1: 6.9}}, {0: {1: 6.9}, 1: {1: 6.8}}, 2, 12)
    assert out["failure_free_missing"] == [1] and out["steps_compared"] == 1
