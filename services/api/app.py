"""`dapo api`: the control plane (FastAPI). Reads state from Redis and the checkpoint store.

Routes (OpenAPI schema at /openapi.json):

    GET  /healthz                         the process is alive
    GET  /readyz                          Redis reachable and the learner heartbeat fresh (else 503)
    GET  /status                          run state, ledger, depths, throughput, instances
    GET  /metrics                         the same as Prometheus text
    GET  /metrics/history                 per-step metric records (the dashboard's data)
    GET  /checkpoints                     committed checkpoints
    GET  /checkpoints/{step}              one checkpoint
    POST /checkpoints                     save at the next step boundary (202)
    POST /checkpoints/{step}/restore      the learner restarts from it (202)
    POST /pause, POST /resume             stop / restart taking training steps
    GET  /                                the live dashboard (its script and style sheet are
                                          /dashboard.js and /dashboard.css)

Mutating routes (every method but GET, HEAD and OPTIONS) need `Authorization: Bearer <token>`
where the token is the value of the environment variable named by `api.token_env` (default
DAPO_API_TOKEN): no header -> 401, a wrong token -> 403, and with no token configured the
mutating routes are disabled (403), never open. The token is checked from the headers before any
byte of the body is read, and a body over `MAX_BODY_BYTES` is refused with 413. The learner
carries out requests at its next step boundary (control hash in Redis).

Every response (but a bare 500 from the server-error handler) carries a Content-Security-Policy
that allows scripts, styles and fetches from this origin only (no inline script, no framing), and
`X-Content-Type-Options: nosniff`. There is no interactive /docs page: it would run inline script
and scripts from a CDN.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path as FsPath
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.bus import StreamBus, open_bus
from contracts.bus.roles import Role
from contracts.checkpoint_store import get_checkpoint, list_checkpoints
from contracts.config import ConfigError, DapoConfig
from contracts.schemas import CheckpointRequest as CheckpointControl
from contracts.schemas import PauseRequest, RestoreRequest
from services.api.status import prometheus_text, run_status

MAX_BODY_BYTES = 64 * 1024
"""Largest request body accepted (413 above it). The API's bodies are a few JSON fields; the
limit keeps a client from making the process buffer megabytes before it is refused."""

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing; every other method needs the bearer token."""

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
"""Sent with every response. With it a string that did end up parsed as HTML still could not run
script (no inline script or event handlers) nor load anything from elsewhere. It does NOT make
building the page from data with innerHTML safe: the dashboard never does that."""

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep: bool = Field(False, description="Exempt this checkpoint from retention.")


class Accepted(BaseModel):
    accepted: bool = True
    request: str
    detail: str


MIN_TOKEN_CHARS = 32
"""A bearer token shorter than this is refused at start: the mutating routes restore and pause
the run, and a short token can be guessed (the API has no rate limit of its own)."""


def check_token_strength(token_env: str) -> None:
    """Raise ConfigError when `token_env` holds a token too short to keep the mutating routes
    closed (unset or empty: those routes are disabled, which is allowed)."""
    token = os.environ.get(token_env)
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{token_env} is {len(token)} characters; an API token needs at least "
            f"{MIN_TOKEN_CHARS} (generate one: openssl rand -hex 32)"
        )


AUDIT = logging.getLogger("dapo.audit")
"""One line per accepted mutation: who (the client's address and which token) and what."""


def token_id(authorization: str | None) -> str:
    """A short fingerprint of the bearer token a request presented (never the token itself):
    after a rotation the audit log tells the old token's requests from the new one's."""
    token = (authorization or "").partition(" ")[2]
    return hashlib.sha256(token.encode()).hexdigest()[:12] if token else "none"


def audit(request: Request, what: str) -> None:
    client = request.client
    who = f"{client.host}:{client.port}" if client else "unknown client"
    AUDIT.info(
        "mutation by %s (token %s): %s",
        who,
        token_id(request.headers.get("authorization")),
        what,
    )


def token_refusal(authorization: str | None, token_env: str) -> HTTPException | None:
    """Why a mutating request is refused (401 no token, 403 wrong or none configured), or None."""
    expected = os.environ.get(token_env)
    if not expected:
        return HTTPException(403, f"mutating routes are disabled: set {token_env} to enable them")
    if authorization is None:
        return HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
        return HTTPException(403, "invalid bearer token")
    return None


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class GuardedBodies:
    """ASGI middleware in front of every route: for a mutating method the token is checked from
    the headers before the body is touched (FastAPI itself reads and parses a body before it runs
    a route's dependencies); then a body over `limit` is refused with 413, by Content-Length
    before reading and by counting while reading a chunked one. An accepted body (at most `limit`
    bytes) is buffered and handed to the app.

    Refusals close the connection, so an unread body is never drained. This does NOT bound how
    slowly a client may send (that is the server's timeouts' job).
    """

    def __init__(
        self, app: ASGIApp, *, refuse: Callable[[str | None], HTTPException | None], limit: int
    ) -> None:
        self.app, self.refuse, self.limit = app, refuse, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = (
            None if scope["method"] in SAFE_METHODS else self.refuse(headers.get("authorization"))
        )
        declared = headers.get("content-length")
        if (
            refusal is None
            and declared is not None
            and (not declared.isdigit() or int(declared) > self.limit)
        ):
            refusal = (
                _too_large(self.limit)
                if declared.isdigit()
                else HTTPException(400, "malformed Content-Length")
            )
        if refusal is None:
            try:
                body = await _read_body(receive, self.limit)
            except _ClientGone:
                return
            except _BodyTooLarge:
                refusal = _too_large(self.limit)
        if refusal is not None:
            reply = JSONResponse(
                {"detail": refusal.detail},
                refusal.status_code,
                headers={**(refusal.headers or {}), "Connection": "close"},
            )
            await reply(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body over {limit} bytes")


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # after the body, the server's own messages (a disconnect)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(cfg: DapoConfig) -> frozenset[str] | None:
    """The Host names the API answers (`api.allowed_hosts`), or None for any."""
    if cfg.api.allowed_hosts is not None:
        return frozenset(h.lower() for h in cfg.api.allowed_hosts)
    if cfg.api.host in LOOPBACK_NAMES or cfg.api.host.startswith("127."):
        return frozenset(LOOPBACK_NAMES)
    return None


def host_name(header: str) -> str:
    """The name of a Host header without its port: `[::1]:8000` -> `::1`, `a.b:80` -> `a.b`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.partition(":")[0]


class HostCheck:
    """ASGI middleware: a request whose Host header names none of `allowed` gets 400, and so
    does one with more than one Host header (a proxy and the app could each read another)."""

    def __init__(self, app: ASGIApp, *, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            hosts = Headers(scope=scope).getlist("host")
            name = host_name(hosts[0] if hosts else "")
            refusal = None
            if len(hosts) > 1:
                refusal = "more than one Host header"
            elif self.allowed is not None and name not in self.allowed:
                refusal = f"Host {name!r} is not served here"
            if refusal is not None:
                await PlainTextResponse(refusal, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """ASGI middleware: adds `SECURITY_HEADERS` to every response that does not set them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


def _asset(name: str) -> str:
    return resources.files("services.api").joinpath(name).read_text()


def create_app(cfg: DapoConfig) -> FastAPI:
    """The API: status and metrics for anyone who reaches it; checkpoints and operator requests
    behind the bearer token; the dashboard. Each concern is a router of its own."""
    check_token_strength(cfg.api.token_env)
    url = cfg.redis_url_for(Role.API)
    if not url:
        raise ValueError("the API needs a Redis URL (queue.redis_url or DAPO_REDIS_URL)")
    # Retries bounded, writes refused when Redis is full: answer 503, don't hang.
    bus = open_bus(url, cfg.queue.namespace, "api", retries=2, pause_when_full=False)
    app = FastAPI(
        title="DAPO control plane", version="1", description=__doc__, docs_url=None, redoc_url=None
    )
    app.add_middleware(
        GuardedBodies,
        refuse=lambda header: token_refusal(header, cfg.api.token_env),
        limit=MAX_BODY_BYTES,
    )
    app.add_middleware(HostCheck, allowed=allowed_hosts(cfg))
    app.add_middleware(SecurityHeaders)  # added last: outermost, so refusals carry the headers too

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        # GuardedBodies has refused the request already; kept so the schema documents the header.
        refusal = token_refusal(authorization, cfg.api.token_env)
        if refusal is not None:
            raise refusal

    @app.exception_handler(redis.RedisError)
    async def _redis_down(_: Request, exc: redis.RedisError) -> PlainTextResponse:
        return PlainTextResponse(f"redis unavailable: {exc}", status_code=503)

    auth = [Depends(require_token)]
    app.include_router(_status_routes(bus, cfg.queue.heartbeat_ttl_s))
    app.include_router(_checkpoint_routes(bus, cfg.checkpoint_dir, auth))
    app.include_router(_control_routes(bus, auth))
    app.include_router(_dashboard_routes())
    return app


def _status_routes(bus: StreamBus, heartbeat_ttl_s: float) -> APIRouter:
    """Liveness, readiness, the run's status, Prometheus metrics, the metrics history."""
    router = APIRouter()

    @router.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @router.get("/readyz")
    def readyz() -> dict[str, Any]:
        try:
            bus.ping()
        except redis.RedisError as exc:
            raise HTTPException(503, f"redis unreachable: {exc}") from None
        status = run_status(bus, heartbeat_ttl_s=heartbeat_ttl_s)
        if status["learner_state"] == "down":
            raise HTTPException(503, "learner heartbeat missing or stale")
        return {"ready": True, "learner_state": status["learner_state"]}

    @router.get("/status")
    def status() -> dict[str, Any]:
        return run_status(bus, heartbeat_ttl_s=heartbeat_ttl_s)

    @router.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        text = prometheus_text(run_status(bus, heartbeat_ttl_s=heartbeat_ttl_s))
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @router.get("/metrics/history")
    def metrics_history(
        limit: Annotated[int, Query(ge=1, le=100_000)] = 2000,
    ) -> list[dict[str, Any]]:
        return bus.recent_metrics(limit)

    return router


def _checkpoint_routes(bus: StreamBus, store: FsPath, auth: list[Any]) -> APIRouter:
    """The committed checkpoints; a checkpoint or a restore requested (token)."""
    router = APIRouter()

    @router.get("/checkpoints")
    def checkpoints() -> list[dict[str, Any]]:
        return [c.as_dict() for c in list_checkpoints(store)]

    @router.get("/checkpoints/{step}")
    def checkpoint(step: Annotated[int, Path(ge=0)]) -> dict[str, Any]:
        info = get_checkpoint(store, step)
        if info is None:
            raise HTTPException(404, f"no committed checkpoint for step {step}")
        return info.as_dict()

    @router.post("/checkpoints", status_code=202, dependencies=auth)
    def save_checkpoint(request: Request, body: CheckpointRequest | None = None) -> Accepted:
        keep = bool(body and body.keep)
        bus.post_control(CheckpointControl(keep=keep))
        audit(request, f"checkpoint requested (keep={keep})")
        return Accepted(
            request="checkpoint", detail="saved at the next step boundary; see GET /checkpoints"
        )

    @router.post("/checkpoints/{step}/restore", status_code=202, dependencies=auth)
    def restore(request: Request, step: Annotated[int, Path(ge=0)]) -> Accepted:
        if get_checkpoint(store, step) is None:
            raise HTTPException(404, f"no committed checkpoint for step {step}")
        bus.post_control(RestoreRequest(step=step))
        audit(request, f"restore of step {step} requested")
        return Accepted(
            request="restore",
            detail=f"the learner restarts from step {step} at its next step boundary",
        )

    return router


def _control_routes(bus: StreamBus, auth: list[Any]) -> APIRouter:
    """Pause and resume training (token)."""
    router = APIRouter()

    @router.post("/pause", status_code=202, dependencies=auth)
    def pause(request: Request) -> Accepted:
        bus.post_control(PauseRequest())
        audit(request, "pause requested")
        return Accepted(request="pause", detail="training pauses at the next step boundary")

    @router.post("/resume", status_code=202, dependencies=auth)
    def resume(request: Request) -> Accepted:
        bus.clear_control("pause")
        audit(request, "resume requested")
        return Accepted(request="resume", detail="training resumes")

    return router


def _dashboard_routes() -> APIRouter:
    """The dashboard: one page, its script and its style, read once."""
    router = APIRouter()
    page, script, style = _asset("dashboard.html"), _asset("dashboard.js"), _asset("dashboard.css")

    @router.get("/", response_class=HTMLResponse)
    def dashboard() -> str:
        return page

    @router.get("/dashboard.js", include_in_schema=False)
    def dashboard_script() -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8")

    @router.get("/dashboard.css", include_in_schema=False)
    def dashboard_style() -> Response:
        return Response(style, media_type="text/css; charset=utf-8")

    return router


def main(cfg: DapoConfig, host: str | None = None, port: int | None = None) -> int:
    import uvicorn

    if host:  # the address it listens on decides which Host names it answers (HostCheck)
        cfg = cfg.model_copy(update={"api": cfg.api.model_copy(update={"host": host})})
    app = create_app(cfg)
    uvicorn.run(
        app,
        host=cfg.api.host,
        port=port if port is not None else cfg.api.port,
        log_level="warning",
    )
    return 0
