"""The peers a worker believes gone: the daemon's notices (`PeerNotices`), and the watch that
aborts a generation on them (`PeerWatch`).

The daemon lists the job's worker connections and announces the processes whose connections
closed (chameleond/daemon/connwatch.py) on `Keys.liveness_channel`, keeping the recent ones under
`Keys.gone`. The plan watcher (chameleond/worker/_link.py) subscribes and hands each notice here;
a worker thus never lists Redis clients itself, and learns of a peer's death within the daemon's
`peer_watch_seconds` and a publish. A notice is evidence for naming a peer in a fault only after
the worker's own collective failed (chameleond/worker/_attribution.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from chameleond.auth import AuthError, Keyring

log = logging.getLogger("chameleon.worker")
# A peer the notices call gone stays gone this long in a row before PeerWatch aborts the
# generation (a live worker whose connections dropped is announced live again within a
# heartbeat and the daemon's period).
PEER_GONE_CONFIRM_SECONDS = 1.5
# How long a survivor whose collective failed waits for the notice that names the dead peer:
# the daemon's period (0.1 s by default, up to 20 listing round trips at scale), its listing
# and the publish, with a margin.
NOTICE_WAIT_SECONDS = 1.0


class PeerNotices:
    """The worker incarnations announced gone, and the ids whose newest notice is a death."""

    def __init__(self, job: str, keyring: Keyring | None = None) -> None:
        self.job = job
        self.keyring = keyring
        self._cond = threading.Condition()
        self._gone: set[tuple[str, str]] = set()
        self._dead_ids: set[str] = set()  # the newest notice about this id announced it gone

    def take(self, raw: bytes | str) -> bool:
        """Apply one notice (a channel message, or the Keys.gone document); False when it is
        not one the job's daemon signed, or unreadable (then ignored)."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if self.keyring is not None:
                self.keyring.verify_doc("liveness", self.job, doc)
            gone = _pairs(doc.get("gone", []))
            live = _pairs(doc.get("live", []))
        except (ValueError, AuthError) as e:
            log.warning("ignoring a liveness notice: %s", e)
            return False
        with self._cond:
            self._gone |= gone
            self._gone -= live
            self._dead_ids |= {w for w, _ in gone}
            self._dead_ids -= {w for w, _ in live}
            self._cond.notify_all()
        return True

    def gone(self, peers: Mapping[str, str | None]) -> list[str]:
        """The peers announced gone: a peer known by incarnation when that process was (a new
        process under the same id does not keep it alive); one known by id only when the newest
        notice about the id was a death."""
        with self._cond:
            return self._gone_locked(peers)

    def wait_gone(self, peers: Mapping[str, str | None], timeout: float) -> list[str]:
        """`gone(peers)`, waiting up to `timeout` seconds for a notice that names one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (found := self._gone_locked(peers)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            return found

    def _gone_locked(self, peers: Mapping[str, str | None]) -> list[str]:
        return sorted(
            w
            for w, inc in peers.items()
            if ((w, inc) in self._gone if inc else w in self._dead_ids)
        )


def _pairs(items: Any) -> set[tuple[str, str]]:
    if not isinstance(items, list):
        raise ValueError("gone/live must be lists")
    out = set()
    for item in items:
        if not (isinstance(item, list) and len(item) == 2):
            raise ValueError(f"{item!r} is not [worker, incarnation]")
        out.add((str(item[0]), str(item[1])))
    return out


class PeerWatch(threading.Thread):
    """Calls `on_gone` once with the peers `find_gone` returns (asked every `period` seconds),
    once they have been gone for `confirm` seconds in a row, until stopped.

    gloo fails a survivor's pending operation within milliseconds of a peer's death, because the
    kernel closes the dead process's sockets. NCCL and HCCL do not: the survivors' device work
    waits until a timeout. A worker on those backends runs this watch for the life of a
    generation and aborts the generation's groups when a member's process is announced gone. A
    live worker whose Redis connections drop for a moment is announced live again once it
    reconnects (its next heartbeat): a peer counts as gone only when it stays gone for
    `confirm` seconds, so the blip does not cost the generation. `find_gone` reads the notices
    the worker holds: no Redis command.
    """

    def __init__(
        self,
        find_gone: Callable[[], list[str]],
        on_gone: Callable[[list[str]], None],
        period: float = 0.05,
        confirm: float = PEER_GONE_CONFIRM_SECONDS,
    ) -> None:
        super().__init__(name="peer-watch", daemon=True)
        self._find_gone = find_gone
        self._on_gone = on_gone
        self._period = period
        self._confirm = confirm
        self._stop_event = threading.Event()

    def run(self) -> None:
        missing: dict[str, float] = {}  # peer -> when it was first seen gone, in a row
        while not self._stop_event.wait(self._period):
            found = self._find_gone()
            now = time.monotonic()
            missing = {w: missing.get(w, now) for w in found}
            confirmed = sorted(w for w, since in missing.items() if now - since >= self._confirm)
            if confirmed:
                self._on_gone(confirmed)
                return

    def stop(self) -> None:
        self._stop_event.set()
