"""`queue`, `api` and `tracking`: how a run's services reach Redis, and how the run is driven and
watched (its HTTP API, its metric trackers)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_serializer

from contracts.config.base import PositiveInt, Section
from contracts.keys import NAMESPACE_PATTERN

REDIS_URL_ENV = "DAPO_REDIS_URL"
"""Where the Redis URL is read when `queue.redis_url` is not set (`DapoConfig.redis_url`)."""


class QueueConfig(Section):
    redis_url: str | None = None
    """redis://[user:password@]host:port/db. None: `DAPO_REDIS_URL`, else `dapo run` embeds a
    server with a generated password. Prefer the environment variable for credentials: a dump of
    the config (config.yaml, trainer.json, trackers) shows this URL with the password masked."""

    @field_serializer("redis_url")
    def _without_password(self, url: str | None) -> str | None:
        return None if url is None else redact_url(url)

    namespace: str = Field("dapo", pattern=rf"^{NAMESPACE_PATTERN}$")
    """Prefix of every Redis key, so several runs can share a server. Letters, digits, `_`, `.`
    and `-` only: it goes into Redis ACL key patterns and SCAN patterns, where `*`, `?` or `[`
    would reach another run's keys (a fresh run deletes `<namespace>:*`)."""
    block_ms: PositiveInt = 1000
    """How long a consumer blocks on an empty stream before checking for shutdown."""
    claim_idle_s: float = Field(300.0, gt=0)
    """Pending entries idle longer than this are reclaimed from any other consumer; must exceed
    the slowest legitimate step of any stage. A consumer whose heartbeat is gone loses its
    entries sooner, once they sat two `heartbeat_ttl_s` (`Transport.reclaim`)."""
    max_deliveries: PositiveInt = 3
    """An entry delivered this many times is dead-lettered instead of retried."""
    heartbeat_ttl_s: float = Field(30.0, gt=0)
    """A service whose heartbeat key expired is considered gone: the learner stops counting on
    it, and the stages take over its pending entries after two TTLs."""


_SECRET_QUERY_KEYS = ("password", "passwd", "pass", "token", "secret", "key", "auth")


def redact_url(url: str) -> str:
    """`url` with every secret replaced by `***`: the password of the user part and the value of
    any query parameter named like one (redis-py reads `?password=`). What logs, dumps and status
    show. A URL that does not parse is shown as `<unparseable URL>`, not echoed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    query = "&".join(
        f"{name}=***"
        if sep and name.lower().rstrip("_") in _SECRET_QUERY_KEYS
        else f"{name}{sep}{value}"
        for name, sep, value in (p.partition("=") for p in parts.query.split("&") if p)
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


class ApiConfig(Section):
    host: str = "127.0.0.1"
    """Bind address; loopback unless deliberately opened."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """0 = pick a free port."""
    token_env: str = "DAPO_API_TOKEN"
    """Environment variable holding the bearer token for mutating routes (unset = disabled)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names the API answers (any port); any other gets 400. None = the loopback
    names (localhost, 127.0.0.1, ::1) when `host` is a loopback address, so a web page that
    rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read or drive a local run; any name
    when the API listens beyond loopback (list the names clients use to close that too)."""


class TrackingConfig(Section):
    tensorboard: bool = True
    """Write per-step metrics as TensorBoard event files under `<output_dir>/tensorboard`."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (`pip install '.[wandb]'`, and
    `WANDB_API_KEY` in the environment or `wandb login`)."""
    log_completions_every: Annotated[int, Field(ge=0)] = 10
    """Every N training steps, log a sample of the step's completions (prompt, response, reward)
    as a text table (TensorBoard's Text tab, a W&B table); 0 = never."""
    completions_per_log: PositiveInt = 4
    """Completions in each sample, one per group, taken from different groups where there are
    enough."""
