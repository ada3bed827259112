"""The installed packages of chameleond's extras (torch, transformers, torch-npu, ...) against
what pyproject.toml's extras require: one check per extra."""

from __future__ import annotations

import importlib.metadata as metadata
import re
from functools import partial

from chameleond import extras as optional
from chameleond.cli.doctor.check import Check, timed
from chameleond.extras import install_hint

# The extras whose packages the doctor compares with what is installed (pyproject.toml).
EXTRAS = ("worker", "hf", "npu", "local")


def extras() -> list[Check]:
    try:
        required = metadata.requires("chameleond") or []
    except metadata.PackageNotFoundError:
        return [Check("packages", "skip", "chameleond is not installed as a package here")]
    return [timed(f"extra {extra}", partial(_extra, required, extra)) for extra in EXTRAS]


def _extra(required: list[str], extra: str, check: Check) -> None:
    wanted = []
    for line in required:
        spec, _, marker = line.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", marker):
            name, constraint = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", spec).groups()  # type: ignore[union-attr]
            wanted.append((name, constraint.strip()))
    found, absent, off = [], [], []
    for name, constraint in wanted:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            absent.append(name)
            continue
        found.append(f"{name} {version}")
        check.figures[name] = version
        if not satisfies(version, constraint):
            off.append(f"{name} {version} where the extra requires {constraint}")
    if not found or set(optional.missing(extra)) == set(optional.EXTRAS[extra]):
        check.verdict = "skip"
        check.detail = f"not installed ({install_hint(extra)})"
    elif off or absent:
        check.verdict = "warn"
        gaps = off + ([f"missing {', '.join(absent)} ({install_hint(extra)})"] if absent else [])
        check.detail = "; ".join(gaps)
    else:
        check.detail = ", ".join(found)


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: 2.13.0+cpu -> (2, 13, 0)."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group().split(".")) if m else ()


def satisfies(version: str, constraint: str) -> bool:
    """`version` meets every clause of `constraint` (==, !=, >=, <=, >, <; release numbers only)."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in constraint.split(","))):
        op, want_text = re.match(r"(==|!=|>=|<=|>|<|~=)?\s*(.*)", clause).groups()  # type: ignore[union-attr]
        want = release(want_text)
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        ok = {
            "==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b,
            "~=": a >= b, None: True,
        }[op]  # fmt: skip
        if not ok:
            return False
    return True
