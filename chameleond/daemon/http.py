"""HTTP on aiohttp (127.0.0.1 by default): the status page at /, /metrics, /healthz, /readyz,
/api/v1/status and plan.

The endpoints read what they are given and nothing else of the daemon: the job (never changed
here), the configuration, the metrics, the daemon's `Health`, and a Redis client for the page's
view of the job's streams."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from chameleond.core.plan import plan_to_dict
from chameleond.daemon import page, views
from chameleond.daemon.config import Config
from chameleond.daemon.health import Health
from chameleond.daemon.metrics import Metrics
from chameleond.jobstate.job import Job
from chameleond.protocol import Keys
from chameleond.records import read_decisions


class HttpServer:
    def __init__(
        self, job: Job, cfg: Config, metrics: Metrics, health: Health, client: aioredis.Redis
    ) -> None:
        self.job, self.cfg, self.gauges, self.health = job, cfg, metrics, health
        self.client = client
        self.keys = Keys(cfg.job)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.page)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/api/v1/status", self.status)
        app.router.add_get("/api/v1/plan", self.plan)
        return app

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def metrics(self, request: web.Request) -> web.Response:
        views.refresh_gauges(self.job, self.gauges, self.cfg)
        body = self.gauges.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        ok, why = self.health.healthy()
        return web.json_response({"ok": ok, "reason": why}, status=200 if ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        ready, why = self.health.readiness()
        body = {
            "ready": ready,
            "job": self.cfg.job,
            "state": self.job.machine.phase.value,
            "reason": why,
        }
        return web.json_response(body, status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def plan(self, request: web.Request) -> web.Response:
        plan = self.job.plan
        if plan is None:
            return web.json_response({"error": "no plan yet: waiting for workers"}, status=404)
        return web.json_response(plan_to_dict(plan))

    async def page(self, request: web.Request) -> web.Response:
        data = page.PageData(self._status(), self.job.plan)
        client, keys = self.client, self.keys
        if not self.health.standby_for:
            try:
                data.events = _text(await client.xrevrange(keys.events, count=PAGE_EVENTS))
                data.dead = _text(await client.xrevrange(keys.dead, count=PAGE_EVENTS))
                records = _text(await client.xrevrange(keys.decisions, count=200))
                data.decisions = read_decisions(records)[:PAGE_DECISIONS]
            except (RedisError, OSError) as e:
                data.errors.append(f"Redis unreadable: {e}")
        return web.Response(text=page.render(data), content_type="text/html", charset="utf-8")

    def _status(self) -> dict[str, Any]:
        return views.status(self.job, self.cfg, standby_for=self.health.standby_for)


PAGE_EVENTS = 10
PAGE_DECISIONS = 5


def _text(entries: Any) -> list[tuple[str, dict[str, str]]]:
    """XREVRANGE's reply (bytes: the daemon's client does not decode) as text; an entry with no
    fields (deleted meanwhile) keeps its id."""

    def s(b: bytes | str | None) -> str:
        return b.decode(errors="replace") if isinstance(b, bytes) else str(b)

    return [(s(i), {s(k): s(v) for k, v in (f or {}).items()}) for i, f in entries or []]
