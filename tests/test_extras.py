"""A command that needs an optional part which is not installed names the extra that brings it
(chameleond.extras); tests/test_packaging_base.py checks the same on a real install without them."""

from __future__ import annotations

import pytest

from chameleond import extras
from chameleond.cli import ctl


def test_the_installed_extras_are_found() -> None:
    for extra in ("worker", "local"):
        assert extras.missing(extra) == []
        extras.require(extra, "this test")


def test_a_missing_part_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(extras.EXTRAS, "worker", ("torch", "chameleond_no_such_module"))
    with pytest.raises(extras.MissingExtra, match=r"no_such_module, which is not installed: pip"):
        extras.require("worker", "this test")
    assert ctl.main(["up", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "chameleonctl up: starting workers needs chameleond_no_such_module, which is not "
        "installed: pip install 'chameleond[worker]'"
    )
