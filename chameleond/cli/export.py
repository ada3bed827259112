"""Export a job's checkpoint as a Hugging Face model directory (docs/operations.md).

`chameleonctl export --checkpoint DIR --hf OUT [--step N]` takes the newest step (or step N)
whose checkpoint files in DIR (the workers' `--checkpoint-dir`) together hold every layer, gathers
the model's tensors by their names (optimizer state left out), builds the Hugging Face class the
checkpoint names (`hf_class`, with its `hf_config`: recorded by models from
chameleond.worker.hf), loads the tensors into it, and writes OUT with `save_pretrained`
(safetensors), which `AutoModelForCausalLM.from_pretrained(OUT)` loads.

Exit status 2, with one line saying why, for a directory without a complete step, a checkpoint
without hf_class/hf_config (a model not from chameleond.worker.hf), or a tensor the class does not
expect or misses. Needs the `worker` and `hf` extras.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chameleond.extras import require

if TYPE_CHECKING:
    import torch

    from chameleond.worker._checkpoint import Listing


class ExportError(Exception):
    """The checkpoint cannot be exported; the message says why, naming the file or tensor."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        metavar="DIR",
        help="the workers' checkpoint directory (chameleon-worker --checkpoint-dir)",
    )
    parser.add_argument(
        "--hf",
        required=True,
        type=Path,
        metavar="OUT",
        help="write a Hugging Face model directory here (config.json, model.safetensors)",
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="export step N (default: the newest step whose files hold every layer)",
    )


def run(args: argparse.Namespace) -> int:
    require("worker", "chameleonctl export")
    require("hf", "chameleonctl export --hf")
    try:
        step, layers = complete_step(args.checkpoint, args.step)
        metadata, tensors = model_tensors(layers)
        hf_class = write_hf(metadata, tensors, args.hf)
    except ExportError as e:
        print(f"chameleonctl export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} as {hf_class} to {args.hf}")
    return 0


def complete_step(directory: Path, step: int | None = None) -> tuple[int, dict[int, Listing]]:
    """The newest step (or `step`) whose readable files in `directory`, written for one model,
    together hold every layer: the step, and for each layer the file to read it from."""
    from chameleond.worker import _checkpoint as checkpoint

    if not directory.is_dir():
        raise ExportError(f"{directory}: not a directory")
    steps = sorted({s for per in checkpoint.written(directory).values() for s in per})
    if not steps:
        raise ExportError(f"{directory}: no checkpoint files (*-STEP.safetensors)")
    if step is not None and step not in steps:
        raise ExportError(f"{directory}: no checkpoint of step {step} (steps: {_list(steps)})")
    for s in reversed(steps) if step is None else [step]:
        by_model: dict[str, dict[int, Listing]] = {}
        for path in sorted(directory.glob(f"*-{s:09d}{checkpoint.SUFFIX}")):
            try:
                listed = checkpoint.list_file(path)
            except (OSError, ValueError):
                continue  # a file cut short, or not a checkpoint: the others may cover it
            held = by_model.setdefault(listed.model, {})
            for i in listed.layouts:
                held.setdefault(i, listed)
        for held in by_model.values():
            n = next(iter(held.values())).n_layers
            if held.keys() >= set(range(n)):
                return s, {i: held[i] for i in range(n)}
    which = f"step {step}" if step is not None else "no step"
    raise ExportError(
        f"{directory}: {which} has readable checkpoint files that together hold every layer "
        f"(steps: {_list(steps)})"
    )


def model_tensors(layers: dict[int, Listing]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The checkpoint's metadata and the model's tensors by name (no optimizer state)."""
    from chameleond.worker import _safetensors as fmt

    tensors: dict[str, torch.Tensor] = {}
    for i, listed in layers.items():
        names = list(listed.layouts[i]["module"].values())
        try:
            got = fmt.read_tensors(listed.path, listed.header, names)
        except (OSError, ValueError, KeyError) as e:
            raise ExportError(f"{listed.path}: layer {i} unreadable ({e})") from None
        for name, t in got.items():
            if name in tensors:
                raise ExportError(f"tensor {name}: held by two layers ({listed.path}, layer {i})")
            tensors[name] = t
    return dict(next(iter(layers.values())).header.metadata), tensors


def write_hf(metadata: dict[str, str], tensors: dict[str, torch.Tensor], out: Path) -> str:
    """Build the checkpoint's Hugging Face class from its config on the meta device, load
    `tensors` into it and `save_pretrained` it to `out`; the class's name."""
    import torch

    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: not a directory")
    hf_class, hf_config = metadata.get("hf_class"), metadata.get("hf_config")
    if not hf_class or not hf_config:
        raise ExportError(
            "the checkpoint records no hf_class/hf_config: its model was not built by "
            "chameleond.worker.hf, and only such a model can be exported with --hf"
        )
    cls = _hf_class(hf_class)
    try:
        config = cls.config_class.from_dict(json.loads(hf_config))
    except (ValueError, TypeError, KeyError) as e:
        raise ExportError(f"hf_config of {hf_class}: unusable ({e})") from None
    with torch.device("meta"):
        model = cls(config)
    expected = model.state_dict()
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        raise ExportError(
            f"tensor {unexpected[0]} is not one {hf_class} expects{_more(unexpected)}"
        )
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ExportError(
            f"{hf_class} expects tensor {missing[0]}, which the checkpoint does not hold"
            f"{_more(missing)} (frozen parameters are not checkpointed)"
        )
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ExportError(
                f"tensor {name}: shape {list(t.shape)} in the checkpoint, {hf_class} expects "
                f"{list(expected[name].shape)}"
            )
    model.load_state_dict(tensors, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    try:
        model.save_pretrained(out)
    except OSError as e:
        raise ExportError(f"{out}: cannot write ({e.strerror or e})") from None
    return hf_class


def _hf_class(name: str) -> Any:
    """The transformers model class `name` ("GPT2LMHeadModel", or a dotted path)."""
    import transformers

    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module) if module else transformers, attr)
    except (ImportError, AttributeError):
        found = None
    if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
        raise ExportError(f"hf_class {name!r} is not a transformers model class")
    return found


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _list(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[-10:])
    return shown if len(steps) <= 10 else f"..., {shown}"
