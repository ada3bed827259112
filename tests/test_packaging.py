"""The built wheel (not the editable install) holds every package, the packaged job spec and the
console scripts. Built offline from a clean copy of the source, so nothing stale in build/ hides
a missing file."""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chameleond",)
SKIP = {".git", ".venv", "build", "dist", "tests", "state", "report", "__pycache__",
        ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}  # fmt: skip


def build_wheel(src: Path, out: Path) -> Path:
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation",
               "--skip-dependency-check", "--outdir", str(out), str(src)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--no-index", "--wheel-dir", str(out), str(src)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = out.glob("chameleond-*.whl")
    return wheel


def test_the_wheel_holds_every_package_the_job_spec_and_the_console_scripts(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src,
        ignore=lambda _d, names: {n for n in names if n in SKIP or n.endswith(".egg-info")},
    )  # fmt: skip
    wheel = build_wheel(src, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(z.read(entry_points).decode())

    for package in PACKAGES:
        modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py")
                   if "__pycache__" not in p.parts}  # fmt: skip
        assert f"{package}/__init__.py" in modules
        assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"
    assert "chameleond/jobs/cpu-small.toml" in names
    traces = {p.relative_to(ROOT).as_posix() for p in (ROOT / "chameleond" / "traces").iterdir()
              if p.name.endswith(".csv") or p.name.startswith("LICENSE")}  # fmt: skip
    assert "chameleond/traces/oobleck-p3-trace.csv" in traces and traces <= names
    assert not any(n.startswith("tests/") for n in names)
    # The only import name it installs is the project's own (no generic `workers` or `handlers`).
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"chameleond"}
    assert dict(scripts["console_scripts"]) == {
        "chameleond": "chameleond.daemon.cli:main",
        "chameleonctl": "chameleond.cli.ctl:main",
        "chameleon-worker": "chameleond.worker._main:main",
        "chameleon-agent": "chameleond.agent.cli:main",
    }
