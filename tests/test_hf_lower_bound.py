"""The `[hf]` extra's lower bounds are true: the Hugging Face split and the example's tokenizer
pass their tests with the oldest transformers and tokenizers the extra accepts.

The lower-bound releases (and what they need that this environment's newer ones replaced: the
1.x huggingface-hub that transformers 5.0 requires, and httpx, which it imports) are installed
with `pip install --no-deps --target` into a directory of their own, cached under
~/.cache/chameleond-lower-bound/, never into the environment (its torch stays). The tests then run
in a subprocess with that directory first on PYTHONPATH, which checks what it imported before it
runs them. Code that calls an API newer than the bound fails here (before the split built its own
mask, transformers 5.0 to 5.17 failed on `create_causal_mask`'s keywords)."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
# The oldest releases pyproject.toml's `[hf]` extra accepts, and what they need at import that
# the environment holds in another major version (huggingface-hub 2 there) or not at all (httpx).
LOWER = {"transformers": "5.0.0", "tokenizers": "0.22.0"}
NEEDED = {
    "huggingface-hub": "1.3.0",  # transformers 5.0.0 requires >=1.3.0,<2.0
    "httpx": "0.28.1",  # huggingface-hub 1.x imports it, and it httpcore and certifi
    "httpcore": "1.0.9",
    "certifi": "2025.11.12",
}
TESTS = ["tests/test_hf_split.py", "tests/test_hf_text.py"]
PIP_SECONDS = 300


def test_the_hf_extras_lower_bounds_are_the_ones_tested_here() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = dict(
        re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", r).groups()  # type: ignore[union-attr]
        for r in extra["optional-dependencies"]["hf"]
        if r.split(">=")[0].strip() in LOWER
    )
    assert bounds == LOWER


def lower_bound_site() -> Path:
    """The directory holding the lower-bound packages: built once (pip, no deps), then reused."""
    pins = sorted(f"{name}=={version}" for name, version in (LOWER | NEEDED).items())
    tag = f"{sys.implementation.cache_tag}-{platform.machine()}-{' '.join(pins)}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    site = cache / "chameleond-lower-bound" / hashlib.sha256(tag.encode()).hexdigest()[:16]
    if (site / "complete").exists():
        return site
    site.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix="building-", dir=site.parent))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--quiet"]
    cmd += ["--disable-pip-version-check", "--target", str(building), *pins]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_SECONDS)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        said = f"no answer within {PIP_SECONDS} s" if done is None else done.stderr[-2000:]
        pytest.fail(
            "could not install the [hf] extra's lower bounds to test them (this test needs a "
            f"package index pip can reach): {' '.join(cmd)}\npip: {said}",
            pytrace=False,
        )
    (building / "complete").write_text(tag + "\n")
    try:
        building.rename(site)  # whole or not at all; a concurrent run may have been first
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
    return site


# Run in the subprocess: the tests, then what they imported (in the same interpreter).
PROBE = """
import sys, pytest

class Imported:
    def pytest_sessionfinish(self):
        tok, hf = sys.modules["tokenizers"], sys.modules["transformers"]
        print("\\nimported", hf.__version__, tok.__version__, hf.__file__)

sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Imported()]))
"""


def test_split_and_tokenizer_pass_with_the_lower_bound_releases() -> None:
    site = lower_bound_site()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    out = done.stdout + done.stderr
    imported = re.search(r"^imported (\S+) (\S+) (\S+)$", out, re.MULTILINE)
    assert imported, out[-4000:]
    assert imported.groups()[:2] == (LOWER["transformers"], LOWER["tokenizers"]), out[-4000:]
    assert Path(imported.group(3)).is_relative_to(site)
    assert done.returncode == 0, out[-4000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
