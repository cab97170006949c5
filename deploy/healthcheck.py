#!/usr/bin/env python
"""Container health check for the queue workers: `dapo-healthcheck KIND [--config FILE]`.

Exits 0 when a service of KIND (rollout, reward, gatekeeper, learner) running on *this* host
has a live heartbeat in Redis, else 1 with the reason on stderr. Services start beating only
after their start-up work (a rollout replica after loading its model), so this says "started
and registered": the images install it as `dapo-healthcheck`, docker-compose uses it as the
healthcheck of the workers and Kubernetes as their startupProbe.

It is deliberately not a Kubernetes livenessProbe: it depends on Redis, and restarting every
worker while Redis is briefly away would throw away their work. A worker whose process dies
ends its container anyway, and a hung worker's heartbeat expires, which `dapo status` and the
API's /status show. The heartbeat thread also does not prove the work loop is progressing
(see contracts/runtime.py).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence

ROLES = ("rollout", "reward", "gatekeeper", "learner")
DEFAULT_CONFIG = "/etc/dapo/config.yaml"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dapo-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=ROLES)
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})"
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="Redis socket timeout in seconds"
    )
    args = parser.parse_args(argv)

    import redis

    from contracts.bus import open_bus
    from contracts.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        sys.stderr.write(f"dapo-healthcheck: {exc}\n")
        return 1
    url = cfg.redis_url_for(args.role)
    if not url:
        sys.stderr.write("dapo-healthcheck: no Redis URL (queue.redis_url or DAPO_REDIS_URL)\n")
        return 1
    host = socket.gethostname()
    bus = open_bus(
        url,
        cfg.queue.namespace,
        "healthcheck",
        retries=0,
        pause_when_full=False,
        socket_timeout=args.timeout,
    )
    try:
        mine = [i for i in bus.live_instances(args.role) if i.get("host") == host]
    except redis.RedisError as exc:
        sys.stderr.write(f"dapo-healthcheck: redis unreachable: {exc}\n")
        return 1
    finally:
        bus.close()
    if not mine:
        sys.stderr.write(f"dapo-healthcheck: no live {args.role} heartbeat from host {host}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
