"""`dapo api`: the control plane (FastAPI). Reads state from Redis and the checkpoint store.

Routes (OpenAPI at /docs and /openapi.json):

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
    GET  /                                the live dashboard

Mutating routes need `Authorization: Bearer <token>` where the token is the value of the
environment variable named by `api.token_env` (default DAPO_API_TOKEN): no header -> 401, a wrong
token -> 403, and with no token configured the mutating routes are disabled (403), never open.
The learner carries out requests at its next step boundary (control hash in Redis).
"""

from __future__ import annotations

import hmac
import os
from importlib import resources
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from services.contracts.bus import open_bus
from services.contracts.checkpoint_store import get_checkpoint, list_checkpoints
from services.contracts.config import DapoConfig
from services.contracts.schemas import CheckpointRequest as CheckpointControl
from services.contracts.schemas import PauseRequest, RestoreRequest
from services.shell.status import prometheus_text, run_status


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep: bool = Field(False, description="Exempt this checkpoint from retention.")


class Accepted(BaseModel):
    accepted: bool = True
    request: str
    detail: str


def create_app(cfg: DapoConfig) -> FastAPI:
    url = cfg.redis_url
    if not url:
        raise ValueError("the API needs a Redis URL (queue.redis_url or DAPO_REDIS_URL)")
    bus = open_bus(url, cfg.queue.namespace, "api", retries=2, pause_when_full=False)  # answer 503, don't hang
    store = cfg.checkpoint_dir
    app = FastAPI(title="DAPO control plane", version="1", description=__doc__)

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        expected = os.environ.get(cfg.api.token_env)
        if not expected:
            raise HTTPException(403, f"mutating routes are disabled: set {cfg.api.token_env} to enable them")
        if authorization is None:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected.encode()):
            raise HTTPException(403, "invalid bearer token")

    auth = [Depends(require_token)]

    @app.exception_handler(redis.RedisError)
    async def _redis_down(_: Request, exc: redis.RedisError) -> PlainTextResponse:
        return PlainTextResponse(f"redis unavailable: {exc}", status_code=503)

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/readyz")
    def readyz() -> dict[str, Any]:
        try:
            bus.ping()
        except redis.RedisError as exc:
            raise HTTPException(503, f"redis unreachable: {exc}") from None
        status = run_status(bus, heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s)
        if status["learner_state"] == "down":
            raise HTTPException(503, "learner heartbeat missing or stale")
        return {"ready": True, "learner_state": status["learner_state"]}

    @app.get("/status")
    def status() -> dict[str, Any]:
        out = run_status(bus, heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s)
        out["paused"] = "pause" in bus.control_requests()
        return out

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return prometheus_text(run_status(bus, heartbeat_ttl_s=cfg.queue.heartbeat_ttl_s))

    @app.get("/metrics/history")
    def metrics_history(limit: Annotated[int, Query(ge=1, le=100_000)] = 2000) -> list[dict[str, Any]]:
        return bus.recent_metrics(limit)

    @app.get("/checkpoints")
    def checkpoints() -> list[dict[str, Any]]:
        return [c.as_dict() for c in list_checkpoints(store)]

    @app.get("/checkpoints/{step}")
    def checkpoint(step: Annotated[int, Path(ge=0)]) -> dict[str, Any]:
        info = get_checkpoint(store, step)
        if info is None:
            raise HTTPException(404, f"no committed checkpoint for step {step}")
        return info.as_dict()

    @app.post("/checkpoints", status_code=202, dependencies=auth)
    def save_checkpoint(body: CheckpointRequest | None = None) -> Accepted:
        bus.post_control(CheckpointControl(keep=bool(body and body.keep)))
        return Accepted(request="checkpoint", detail="saved at the next step boundary; see GET /checkpoints")

    @app.post("/checkpoints/{step}/restore", status_code=202, dependencies=auth)
    def restore(step: Annotated[int, Path(ge=0)]) -> Accepted:
        if get_checkpoint(store, step) is None:
            raise HTTPException(404, f"no committed checkpoint for step {step}")
        bus.post_control(RestoreRequest(step=step))
        return Accepted(request="restore", detail=f"the learner restarts from step {step} at its next step boundary")

    @app.post("/pause", status_code=202, dependencies=auth)
    def pause() -> Accepted:
        bus.post_control(PauseRequest())
        return Accepted(request="pause", detail="training pauses at the next step boundary")

    @app.post("/resume", status_code=202, dependencies=auth)
    def resume() -> Accepted:
        bus.clear_control("pause")
        return Accepted(request="resume", detail="training resumes")

    @app.get("/", response_class=HTMLResponse)
    def dashboard() -> str:
        return resources.files("services.shell").joinpath("dashboard.html").read_text()

    return app


def main(cfg: DapoConfig, host: str | None = None, port: int | None = None) -> int:
    import uvicorn

    app = create_app(cfg)
    uvicorn.run(app, host=host or cfg.api.host, port=port if port is not None else cfg.api.port, log_level="warning")
    return 0
