"""A plan as a delta from the one before it: what a worker holding generation g-1 reads to learn
generation g. Plain data in, plain data out.

A fault answered by rerouting changes a few routing weights, the excluded workers, the estimates
and the cause of a plan whose document is 1.2 MB at 8,192 devices: every worker reading it whole
took 1.2 GB out of Redis (145 KB packed), and still takes 25 MB in its compact form
(core/plancompact.py: 3 KB). The delta is under 1 KB. A plan with other pipelines gets none: its
delta is larger than its compact form (daemon/commits.py).

A delta is {"base": g-1, "generation": g, "digest": D, "set": [[path, value], ...],
"del": [path, ...], "splice": [[path, start, stop, items], ...]}: a path is the list of keys and
indices from the document's root to the member that changed. Lists (or tuples, in a document
made in memory) of the same length are compared member by member; a list that grew or shrank is
spliced, its members from `start` to `stop` replaced by `items` (a worker out of a sync group of
512: its place, not the 511 others), and a splice is applied after the sets. `digest` is the
SHA-256 of the new document's canonical JSON (sorted keys, no spaces: the text a plan's
signature is made over): a delta applied to anything but its base gives another digest and is
refused, so a worker never holds a plan the daemon did not publish. A worker that holds the job's
keyring checks the made plan's signature instead (`check_digest=False`), which is made over the
same text: one serialisation of a plan of 8,192 devices (about 20 ms), not two.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

Path = list[str | int]


class DeltaError(ValueError):
    """A delta that does not apply to the document given (another base, a malformed delta)."""


def digest(doc: Mapping[str, Any]) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def plan_delta(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The delta that makes `new` (generation g) from `old` (the plan before it)."""
    ops = _Ops()
    _diff(old, new, [], ops)
    return {
        "base": old.get("generation"),
        "generation": new.get("generation"),
        "digest": digest(new),
        "set": ops.sets,
        "del": ops.dels,
        "splice": ops.splices,
    }


class _Ops:
    def __init__(self) -> None:
        self.sets: list[list[Any]] = []
        self.dels: list[Path] = []
        self.splices: list[list[Any]] = []


def _diff(a: Any, b: Any, path: Path, ops: _Ops) -> None:
    # Compared in C, only what differs is walked; so 1 and 1.0 pass for the same, as they never
    # are in a plan (its fields are typed), and the digest would refuse the delta if they were.
    if type(a) is type(b) and a == b:
        return
    if isinstance(a, tuple) and isinstance(b, tuple | list) and list(a) == list(b):
        return  # a document made in memory (tuples) against one read back (lists)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() - b.keys():
            ops.dels.append([*path, k])
        for k, v in b.items():
            if k in a:
                _diff(a[k], v, [*path, k], ops)
            else:
                ops.sets.append([[*path, k], v])
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                _diff(x, y, [*path, i], ops)
            return
        head = _common(a, b, range(min(len(a), len(b))))
        most = min(len(a), len(b)) - head
        tail = _common(a, b, range(-1, -most - 1, -1))
        if head or tail:
            ops.splices.append([path, head, len(a) - tail, list(b[head : len(b) - tail])])
        else:
            ops.sets.append([path, b])
    else:
        ops.sets.append([path, b])


def _common(a: Sequence[Any], b: Sequence[Any], at: range) -> int:
    """How many of `at`'s positions, taken in order, hold the same member in `a` and `b`."""
    n = 0
    for i in at:
        if not _same(a[i], b[i]):
            break
        n += 1
    return n


def _same(x: Any, y: Any) -> bool:
    """Equal as JSON: of one type (a tuple as a list), so 1 and 1.0 or True are not the same."""
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(map(_same, x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(v, y[k]) for k, v in x.items())
    return type(x) is type(y) and x == y


def parse_delta(text: bytes | str) -> dict[str, Any]:
    """A delta's JSON text as read back; DeltaError when it is not a JSON object."""
    try:
        delta = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DeltaError(f"a delta that does not decode: {e}") from None
    if not isinstance(delta, dict):
        raise DeltaError("a delta that is not a JSON object")
    return delta


def apply_delta(
    base: Mapping[str, Any], delta: Mapping[str, Any], *, check_digest: bool = True
) -> dict[str, Any]:
    """The document `delta` makes from `base`; DeltaError unless `base` is the plan it was made
    from and, with `check_digest`, the document is the one the daemon published (its digest;
    without it, the caller verifies the document's signature)."""
    if not isinstance(delta, Mapping) or delta.get("base") != base.get("generation"):
        raise DeltaError("a delta from another plan")
    sets, dels, splices = delta.get("set"), delta.get("del"), delta.get("splice", [])
    if not isinstance(sets, list) or not isinstance(dels, list) or not isinstance(splices, list):
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
        for item in splices:
            path, start, stop, items = item
            _spliced(doc, path, copied)[_index(start) : _index(stop)] = _items(items)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise DeltaError(f"a delta that does not apply: {e!r}") from None
    if not isinstance(doc, dict) or (check_digest and digest(doc) != delta.get("digest")):
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


def _spliced(doc: Any, path: Any, copied: set[int]) -> list[Any]:
    """The list at `path`, a copy of it in `doc`, that a splice changes."""
    if not isinstance(path, list):
        raise ValueError(f"bad path {path!r}")
    if not path:
        raise TypeError("a document is no list")
    parent, key = _parent(doc, path, copied)
    node = parent[key]
    if id(node) in copied and isinstance(node, list):
        return node
    if not isinstance(node, list | tuple):
        raise TypeError(f"{path!r} is no list")
    node = parent[key] = list(node)
    copied.add(id(node))
    return node


def _index(i: Any) -> int:
    if not isinstance(i, int) or isinstance(i, bool) or i < 0:
        raise ValueError(f"bad index {i!r}")
    return i


def _items(items: Any) -> list[Any]:
    if not isinstance(items, list):
        raise ValueError(f"splice items are no list: {items!r}")
    return items
