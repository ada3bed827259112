"""chameleond: adaptive fault tolerance for pipeline x data-parallel training."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("chameleond")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def version_text(prog: str) -> str:
    """What `--version` prints."""
    return f"{prog} {__version__}"
