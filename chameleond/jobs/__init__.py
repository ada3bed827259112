"""Job descriptions packaged with chameleond: the default is the small CPU job the workers train."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from chameleond.core.spec import JobSpec, load_spec

DEFAULT_SPEC = "cpu-small.toml"


def default_spec_path() -> Path:
    """Filesystem path of the packaged default spec (chameleond/jobs/cpu-small.toml)."""
    return Path(str(resources.files(__package__).joinpath(DEFAULT_SPEC)))


def load_default_spec() -> JobSpec:
    return load_spec(default_spec_path())


def load_spec_named(name: str) -> JobSpec:
    """A packaged job by file name, e.g. "cpu-mixed.toml" (the default of `chameleonctl up`)."""
    return load_spec(Path(str(resources.files(__package__).joinpath(name))))


__all__ = ["DEFAULT_SPEC", "default_spec_path", "load_default_spec", "load_spec_named"]
