"""SLURM-style hostlists and the `[[hosts]]` form of a job spec.

`expand_hostlist("gpu[001-128]")` names hosts; `hosts_form` turns a spec's `[[hosts]]` entries into
the workers they stand for (one per device, `{host}-{i}`), which `parse_spec` then treats as a
hand-written `workers` list (docs/spec.md, "[[hosts]]"). Plain data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chameleond.core.fields import MAX_ID_LEN, SpecError, integer, is_ident, num, table, text

Worker = tuple[str, str, int, str]  # id, host, memory_bytes, device: a WorkerSpec's fields
Cores = tuple[float, float]  # cpu_cores, step_cpu_seconds: a HostSpec's fields

MAX_NAMES = 1_000_000  # hosts one hostlist may name, and workers one spec may generate
DEVICE_KINDS = ("cpu", "cuda", "npu")
ENTRY_FIELDS = frozenset(
    {"name", "devices", "device", "memory_bytes", "cpu_cores", "step_cpu_seconds"}
)


def expand_hostlist(text: str, limit: int = MAX_NAMES) -> tuple[str, ...]:
    """The host names of a SLURM-style hostlist, in order: "a[1-3,7],b9" is a1 a2 a3 a7 b9.

    Items are comma-separated; an item holds at most one bracket group `prefix[ranges]suffix`,
    ranges being "N" or "N-M" separated by commas, and numbers are zero-padded to the width of
    their range's start ("[001-128]" is 001 to 128). Raises ValueError saying what is wrong, also
    when the list names more than `limit` hosts (counted before any name is built).
    """
    runs = [run for item in _items(text) for run in _runs(item)]
    count = sum(last - first + 1 for _, first, last, _, _ in runs)
    if count > limit:
        raise ValueError(f"{text!r} names {count} hosts, more than the limit of {limit}")
    names: list[str] = []
    for prefix, first, last, width, suffix in runs:
        if not width:  # a name without a bracket group
            names.append(prefix)
            continue
        names += (f"{prefix}{n:0{width}d}{suffix}" for n in range(first, last + 1))
    return tuple(names)


def _items(text: str) -> list[str]:
    """The top-level comma-separated items (commas inside brackets separate ranges)."""
    items, start, inside = [], 0, False
    for i, c in enumerate(text):
        if c == "[":
            if inside:
                raise ValueError(f"{text!r}: '[' inside a bracket group")
            inside = True
        elif c == "]":
            if not inside:
                raise ValueError(f"{text!r}: ']' without its '['")
            inside = False
        elif c == "," and not inside:
            items.append(text[start:i])
            start = i + 1
    if inside:
        raise ValueError(f"{text!r}: unclosed '['")
    items.append(text[start:])
    if not all(items):
        raise ValueError(f"{text!r}: an empty host name")
    return items


# One range of an item: prefix, first number, last number, zero-padded width (0: no number), suffix.
Run = tuple[str, int, int, int, str]


def _runs(item: str) -> list[Run]:
    prefix, bracket, rest = item.partition("[")
    if not bracket:
        return [(item, 0, 0, 0, "")]
    body, _, suffix = rest.partition("]")
    if "[" in suffix:
        raise ValueError(f"{item!r}: more than one bracket group")
    if not body:
        raise ValueError(f"{item!r}: empty brackets")
    runs = []
    for part in body.split(","):
        first, dash, last = part.partition("-")
        last = last if dash else first
        if not (_digits(first) and _digits(last)):
            raise ValueError(f"{item!r}: {part!r} is not a number N or a range N-M")
        if int(first) > int(last):
            raise ValueError(f"{item!r}: range {part!r} starts above its end")
        runs.append((prefix, int(first), int(last), len(first), suffix))
    return runs


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def hosts_form(entries: Sequence[Any]) -> tuple[list[Worker], dict[str, Cores]]:
    """The workers of a spec's `[[hosts]]` entries (each entry in order, each of its hosts in
    order, `devices` workers `{host}-0`, `{host}-1`, ... on each) as (id, host, memory_bytes,
    device), and the CPU share (cpu_cores, step_cpu_seconds) of every host whose entry gives
    `cpu_cores`: the fields of WorkerSpec and HostSpec. Raises SpecError naming the entry's
    field."""
    if not entries:
        raise SpecError("hosts: expected a non-empty list of [[hosts]] entries")
    workers: list[Worker] = []
    host_specs: dict[str, Cores] = {}
    entry_of: dict[str, int] = {}
    for i, raw in enumerate(entries):
        where = f"hosts[{i}]"
        entry = table(raw, where)
        unknown = sorted(str(k) for k in set(entry) - ENTRY_FIELDS)
        if unknown:
            raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}")
        hostlist = text(entry, "name", where)
        try:
            names = expand_hostlist(hostlist)
        except ValueError as e:
            raise SpecError(f"{where}.name: {e}") from None
        devices = integer(entry, "devices", where)
        device = text(entry, "device", where, "cpu")
        if device not in DEVICE_KINDS:
            raise SpecError(f"{where}.device: expected cpu, cuda or npu, got {device!r}")
        memory = integer(entry, "memory_bytes", where)
        if len(workers) + len(names) * devices > MAX_NAMES:
            raise SpecError(f"{where}: the hosts generate more than {MAX_NAMES} workers")
        host_spec = _host_spec(entry, where)
        for host in names:
            if host in entry_of:
                raise SpecError(f"{where}.name: host {host!r} is also in hosts[{entry_of[host]}]")
            entry_of[host] = i
            longest = f"{host}-{devices - 1}"
            if not is_ident(longest):
                raise SpecError(
                    f"{where}.name: worker id {longest!r} is not printable, has spaces or is "
                    f"longer than {MAX_ID_LEN} characters"
                )
            workers += [(f"{host}-{n}", host, memory, device) for n in range(devices)]
            if host_spec is not None:
                host_specs[host] = host_spec
    return workers, host_specs


def _host_spec(entry: Any, where: str) -> Cores | None:
    """The entry's CPU share (as `[hosts.NAME]` gives it), or None where it gives no cores."""
    if "cpu_cores" not in entry:
        if "step_cpu_seconds" in entry:
            raise SpecError(f"{where}.step_cpu_seconds: needs cpu_cores")
        return None
    return (
        num(entry, "cpu_cores", where),
        num(entry, "step_cpu_seconds", where, positive=False, default=0.0),
    )
