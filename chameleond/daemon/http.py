"""HTTP on aiohttp (127.0.0.1 by default): /metrics, /healthz, /readyz, /api/v1/status and plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from chameleond.core.plan import plan_to_dict

if TYPE_CHECKING:
    from chameleond.daemon.service import Service


class HttpServer:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
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
        self.service.refresh_gauges()
        body = self.service.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        ok, why = self.service.healthy()
        return web.json_response({"ok": ok, "reason": why}, status=200 if ok else 503)

    async def readyz(self, request: web.Request) -> web.Response:
        svc = self.service
        ready, why = svc.readiness()
        body = {"ready": ready, "state": svc.job.machine.phase.value, "reason": why}
        return web.json_response(body, status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.service.status())

    async def plan(self, request: web.Request) -> web.Response:
        plan = self.service.job.plan
        if plan is None:
            return web.json_response({"error": "no plan yet: waiting for workers"}, status=404)
        return web.json_response(plan_to_dict(plan))
