"""A fault's cause as the decisions record it (chameleond.handlers.cause): short and readable,
the raw error kept beside it."""

from __future__ import annotations

import pytest

from chameleond.handlers.cause import MAX_CHARS, readable

# What five survivors reported when a peer was killed with SIGKILL (gloo on CPU, torch 2.13).
GLOO_CLOSED = (
    "CollectiveFailed: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:553] Connection closed by peer [127.0.0.1]:14761. This is typically caused by a "
    "remote worker crashing. Check the logs of the remote worker before reporting an error. "
    "GLHF! \U0001f3d6\ufe0f"
)
GLOO_RESET = (
    "CollectiveFailed: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:537] Read error [127.0.0.1]:18848: Connection reset by peer. This is typically "
    "caused by a remote worker hanging or bugs in the application. Check the logs of the remote "
    "worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)
NCCL_EXITED = (
    "CollectiveFailed: DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:317, remote process exited or there was a network error, NCCL version 2.21.5"
    "\nncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.\nLast error:\nsocket recv failed"
)


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (GLOO_CLOSED, "connection closed (gloo)"),
        (GLOO_RESET, "connection reset (gloo)"),
        (NCCL_EXITED, "remote process exited (nccl)"),
        (
            "GenerationAborted: generation 3 aborted: peer(s) w2 gone",
            "generation 3 aborted: peer(s) w2 gone",
        ),
        ("StoreAborted: \n  rendezvous cut short\nby the abort", "rendezvous cut short"),
    ],
)
def test_a_raw_error_becomes_a_short_cause_and_its_detail(raw: str, cause: str) -> None:
    assert readable(raw) == (cause, raw)


@pytest.mark.parametrize(
    "text",
    ["ECC error on HBM", "left the job", "heartbeat lapse: none for 3.2 s (timeout 3 s)",
     "not registered when the initial plan was made", "operator"],
)  # fmt: skip
def test_a_readable_cause_is_kept_as_it_is(text: str) -> None:
    assert readable(text) == (text, "")


def test_a_long_or_odd_text_is_cut_to_one_printable_line() -> None:
    cause, detail = readable("x" * 500)
    assert len(cause) == MAX_CHARS and cause.endswith("...") and detail == "x" * 500
    cause, _ = readable("\x1b[31mred\x1b[0m alert \u2620")
    assert cause.isprintable() and "\x1b" not in cause and "\u2620" not in cause
    assert readable("")[0] == "reported failed" and readable("   \n ")[0] == "reported failed"
