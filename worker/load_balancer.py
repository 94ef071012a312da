"""RunPod's load-balancing endpoints: requests come straight to the worker's own HTTP server
(https://ENDPOINT_ID.api.runpod.ai/<path>), with no queue in front of it and no retry behind it.

- The server binds PORT (and PORT_HEALTH, when it is another port) at once, before the model loads, which runs on a
  thread meanwhile. `GET /ping` answers 204 while the engine starts, 200 once it serves, and 503 if it could not
  start (the process then exits, as a queue worker that cannot start does): RunPod counts the cold start from the
  first 204 to the first 200 and routes to a worker only while it answers 200.
- Once the engine serves, every route of the local endpoint (worker/server.py) answers, the OpenAI ones at `/v1/...`
  as well as `/openai/v1/...`, with its API key rule. Before, they answer 503 with Retry-After.
- A generation request past the worker's concurrency (worker/concurrency.py) gets a 429 with Retry-After at once:
  held, it would only run into RunPod's 5.5-minute limit.
- SIGTERM: uvicorn stops accepting connections and the running requests get the grace period (worker/shutdown.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from worker.settings import Settings

log = logging.getLogger("worker")

PING = "/ping"
DEFAULT_PORT = 80  # what RunPod sets PORT and PORT_HEALTH to when the endpoint does not
LOAD_BALANCER_PREFIXES = ("/v1", "/openai/v1", "/v2/{endpoint_id}/openai/v1")
STARTING, READY, FAILED = "starting", "ready", "failed"
PING_STATUS = {STARTING: 204, READY: 200, FAILED: 503}


def endpoint_type(settings: Settings) -> str:
    """ "queue" (RunPod hands the worker jobs), "load_balancer" (the worker serves HTTP on PORT) or "local" (neither:
    `python handler.py` runs one test job): ENDPOINT_TYPE, else what RunPod's environment says."""
    if settings.endpoint_type != "auto":
        return settings.endpoint_type
    if settings.on_runpod:
        return "queue"
    return "load_balancer" if settings.port is not None else "local"


class LoadBalancerApp:
    """The ASGI app in front of the worker's: /ping from the start, the rest once `serve(app)` hands it over.
    Paths other than /ping on a separate health port are not served there (404)."""

    def __init__(self, port: int, health_port: int) -> None:
        self.port, self.health_port = port, health_port
        self.state = STARTING
        self.app: Callable | None = None

    def serve(self, app: Callable) -> None:
        self.app, self.state = app, READY

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == PING:
            await _respond(send, PING_STATUS[self.state])
            return
        server_port = (scope.get("server") or (None, None))[1]
        if self.health_port != self.port and server_port == self.health_port:
            await _respond(send, 404, {"error": {"message": f"only {PING} is served on this port"}})
            return
        if self.app is None:
            from worker.openai.errors import WorkerStarting, error_body

            starting = "The worker is loading its model; retry shortly." if self.state == STARTING else None
            body = error_body(WorkerStarting(starting or "The worker could not start its model."))
            await _respond(send, 503, body, retry_after_s=5)
            return
        await self.app(scope, receive, send)


async def _lifespan(receive: Callable, send: Callable) -> None:
    """Nothing to set up or tear down here: the engine starts on its own thread, and stops with the process."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _respond(send: Callable, status: int, body: Any = None, retry_after_s: int | None = None) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-length", str(len(payload)).encode())]
    if body is not None:
        headers.append((b"content-type", b"application/json"))
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve_load_balancer(start: Callable[[], bool], handler: Callable, settings: Settings, host: str = "0.0.0.0") -> int:
    """Binds PORT (and PORT_HEALTH) now, answers /ping while `start()` builds the engine on a thread, then serves
    the worker's routes until SIGTERM; returns the process's exit status (2: the engine could not start)."""
    import uvicorn

    port = settings.port or DEFAULT_PORT
    health_port = settings.port_health or port
    front = LoadBalancerApp(port, health_port)
    sockets = [_bind(host, p) for p in dict.fromkeys((port, health_port))]
    config = uvicorn.Config(
        front,
        log_level="info",
        timeout_graceful_shutdown=settings.shutdown_grace_s + 3,  # type: ignore[arg-type]  # typed int, takes float
    )
    server = uvicorn.Server(config)
    log.info("load-balancing worker: serving on port %d, /ping on port %d while the model loads", port, health_port)

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def load() -> None:
            if not start():
                front.state = FAILED
                loop.call_soon_threadsafe(setattr, server, "should_exit", True)
                return
            from worker.server import create_app

            app = create_app(handler, settings, openai_prefixes=LOAD_BALANCER_PREFIXES, refuse_when_full=True)
            loop.call_soon_threadsafe(front.serve, app)

        threading.Thread(target=load, name="engine-start", daemon=True).start()
        await server.serve(sockets=sockets)

    asyncio.run(run())
    return 2 if front.state == FAILED else 0
