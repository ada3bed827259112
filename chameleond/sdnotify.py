"""sd_notify over $NOTIFY_SOCKET with a plain datagram socket (no libsystemd dependency).

chameleond sends readiness (READY=1) once Redis, the consumer group and HTTP are up, and WATCHDOG=1
from its event loop itself, so a wedged loop stops the pings and systemd restarts the service.
chameleon-worker sends READY=1 once its Redis answers and pings from a thread of its own (a hung
training thread is the daemon's to find: its peers stop reaching it). Stdlib only: the worker
imports this without the daemon's dependencies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time

log = logging.getLogger("chameleond.systemd")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        # An abstract socket is written with a leading '@' and addressed with a leading NUL.
        self.address = "\0" + path[1:] if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_seconds = int(usec) / 1e6 if watchdog_for_us else 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, *lines: str) -> bool:
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.sendall("\n".join(lines).encode())
            return True
        except OSError as e:  # systemd gone or socket misconfigured: never fatal for the daemon
            log.warning("sd_notify to %r failed: %s", self.address, e)
            return False

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=draining in-flight events")

    async def watchdog(self) -> None:
        """Ping at half the watchdog interval, from the event loop (runs until cancelled)."""
        if not self.watchdog_seconds or not self.address:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_seconds / 2)

    def watchdog_thread(self) -> threading.Thread | None:
        """Ping at half the watchdog interval from a daemon thread (for a process without an
        event loop); None when systemd asked for no watchdog."""
        if not self.watchdog_seconds or not self.address:
            return None
        period = self.watchdog_seconds / 2

        def ping() -> None:
            while True:
                self.notify("WATCHDOG=1")
                time.sleep(period)

        t = threading.Thread(target=ping, name="sd-watchdog", daemon=True)
        t.start()
        return t
