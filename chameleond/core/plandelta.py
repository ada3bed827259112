"""A plan as a delta from the one before it: what a worker holding generation g-1 reads to learn
generation g. Plain data in, plain data out.

A fault answered by rerouting changes a few routing weights, the excluded workers, the estimates
and the cause of a plan whose document is 1.2 MB at 8,192 devices (145 KB packed): every worker
reading it whole would take 1.2 GB out of Redis. The delta is a few KB.

A delta is {"base": g-1, "generation": g, "digest": D, "set": [[path, value], ...],
"del": [path, ...]}: a path is the list of keys and indices from the document's root to the
member that changed. Lists (or tuples, in a document made in memory) of the same length are
compared member by member, others are set whole. `digest` is the SHA-256 of the new document's
canonical JSON (sorted keys, no spaces: the text a plan's signature is made over): a delta
applied to anything but its base gives another digest and is refused, so a worker never holds a
plan the daemon did not publish.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

Path = list[str | int]


class DeltaError(ValueError):
    """A delta that does not apply to the document given (another base, a malformed delta)."""


def digest(doc: Mapping[str, Any]) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_delta(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The delta that makes `new` (generation g) from `old` (the plan before it)."""
    sets: list[list[Any]] = []
    dels: list[Path] = []
    _diff(old, new, [], sets, dels)
    return {
        "base": old.get("generation"),
        "generation": new.get("generation"),
        "digest": digest(new),
        "set": sets,
        "del": dels,
    }


def _diff(a: Any, b: Any, path: Path, sets: list[list[Any]], dels: list[Path]) -> None:
    if type(a) is type(b) and a == b:  # compared in C; only what differs is walked
        return
    if isinstance(a, tuple) and isinstance(b, tuple | list) and list(a) == list(b):
        return  # a document made in memory (tuples) against one read back (lists)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() - b.keys():
            dels.append([*path, k])
        for k, v in b.items():
            if k in a:
                _diff(a[k], v, [*path, k], sets, dels)
            else:
                sets.append([[*path, k], v])
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, [*path, i], sets, dels)
    else:
        sets.append([path, b])


def parse_delta(text: bytes | str) -> dict[str, Any]:
    """A delta's JSON text as read back; DeltaError when it is not a JSON object."""
    try:
        delta = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DeltaError(f"a delta that does not decode: {e}") from None
    if not isinstance(delta, dict):
        raise DeltaError("a delta that is not a JSON object")
    return delta


def apply_delta(base: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """The document `delta` makes from `base`; DeltaError unless it is the one the daemon
    published (its digest), and `base` the plan it was made from."""
    if not isinstance(delta, Mapping) or delta.get("base") != base.get("generation"):
        raise DeltaError("a delta from another plan")
    sets, dels = delta.get("set"), delta.get("del")
    if not isinstance(sets, list) or not isinstance(dels, list):
        raise DeltaError("a delta without its 'set' and 'del' lists")
    doc: Any = dict(base)  # the base is left as it is: what a path changes is copied first
    copied = {id(doc)}
    try:
        for path in dels:
            parent, key = _parent(doc, path, copied)
            del parent[key]
        for item in sets:
            path, value = item
            if not path:
                doc = value
                continue
            parent, key = _parent(doc, path, copied)
            parent[key] = value
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise DeltaError(f"a delta that does not apply: {e!r}") from None
    if not isinstance(doc, dict) or digest(doc) != delta.get("digest"):
        raise DeltaError("the plan it makes is not the one published (digest)")
    return doc


def _parent(doc: Any, path: Any, copied: set[int]) -> tuple[Any, Any]:
    """The container of `path`'s member, and its key; the containers on the way are copies."""
    if not isinstance(path, list) or not path:
        raise ValueError(f"bad path {path!r}")
    node = doc
    for key in path[:-1]:
        child = node[_key(node, key)]
        if id(child) not in copied:
            if not isinstance(child, dict | list | tuple):
                raise TypeError(f"{key!r} holds no members")
            child = dict(child) if isinstance(child, dict) else list(child)
            node[key] = child
            copied.add(id(child))
        node = child
    return node, _key(node, path[-1])


def _key(node: Any, key: Any) -> Any:
    if isinstance(node, list) and (not isinstance(key, int) or isinstance(key, bool)):
        raise ValueError(f"bad index {key!r}")
    return key
