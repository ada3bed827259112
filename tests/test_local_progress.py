"""Live progress: an updating line on a terminal, plain lines without control codes elsewhere."""

from __future__ import annotations

import io
import re

from chameleond.local.progress import ProgressView

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def test_plain_output_has_lines_and_no_control_codes() -> None:
    out = io.StringIO()  # not a terminal
    view = ProgressView(out, min_interval=0.0)
    assert not view.tty
    view.update(state="training", generation=1, steps_total=4)
    for step in range(4):
        view.update(step=step, loss=5.0 - step, samples_per_second=20.0 + step)
    view.note("fault: kill -9 w4\x1b[31m")
    view.update(state="transitioning", generation=2, policy="reroute")
    view.close()
    text = out.getvalue()
    assert not CONTROL.search(text.replace("\n", ""))
    lines = text.splitlines()
    assert any(line.startswith("step 3/4  loss 2.0000") for line in lines)
    assert "fault: kill -9 w4[31m" in lines
    assert lines[-1].endswith("plan generation 2 (reroute)")


def test_plain_output_is_throttled_but_keeps_state_changes() -> None:
    out = io.StringIO()
    view = ProgressView(out, min_interval=3600.0)
    view.update(state="training", generation=1)
    for step in range(50):
        view.update(step=step)
    view.update(state="transitioning")
    view.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first state, then the state change (which carries step 49)
    assert lines[1].startswith("step 49") and "state transitioning" in lines[1]


def test_terminal_rewrites_one_line() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True)
    view.update(state="training", step=1)
    view.update(step=2)
    view.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.count("\r") == 2 and "\x1b[K" in text
