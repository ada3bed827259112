"""sd_notify over $NOTIFY_SOCKET with a plain datagram socket (no libsystemd dependency).

Readiness (READY=1) is sent once Redis, the consumer group and HTTP are up; WATCHDOG=1 is sent from
the event loop itself, so a wedged loop stops the pings and systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

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
