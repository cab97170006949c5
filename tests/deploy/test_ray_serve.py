"""Ray Serve hosting: the manifests parse, agree and resolve, and the RayService is closed to the
network (token auth, no wildcard dashboard, no client port, read-only shared volume, Redis with
the Secret's password, NetworkPolicies that admit only Ray nodes and the operator) (fast); a
local Serve application moves prompt jobs through a rollout and a reward replica into the scored
stream and hands its heartbeats back on shutdown (slow)."""

from __future__ import annotations

import importlib
import json
import socket
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from contracts.config import ConfigError
from tests.helpers import WEIGHTS_KEY

REPO = Path(__file__).resolve().parents[2]
SERVE_YAML = REPO / "deploy" / "ray" / "serve.yaml"
RAYSERVICE_YAML = REPO / "deploy" / "ray" / "rayservice.yaml"
RAY_POLICY_YAML = REPO / "deploy" / "ray" / "network-policy.yaml"
TINY = REPO / "configs" / "tiny.yaml"


def _resolve(import_path: str) -> Any:
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _with_repo_config(args: dict[str, Any]) -> dict[str, Any]:
    return {**args, "config": str(REPO / args["config"])}


# --- manifests (fast) ---------------------------------------------------------------------------


def test_serve_yaml_is_a_valid_serve_config_whose_builder_resolves() -> None:
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from services import ray_serve

    raw = yaml.safe_load(SERVE_YAML.read_text())
    ServeDeploySchema.model_validate(raw)
    [app_cfg] = raw["applications"]
    application = _resolve(app_cfg["import_path"])(_with_repo_config(app_cfg["args"]))
    assert isinstance(application, Application)
    known = {
        d.name
        for d in (
            ray_serve.RolloutDeployment,
            ray_serve.RewardDeployment,
            ray_serve.StatusDeployment,
        )
    }
    assert {d["name"] for d in app_cfg["deployments"]} <= known
    assert raw["http_options"]["host"] == "127.0.0.1"


def test_rayservice_embeds_the_same_applications() -> None:
    from ray.serve.schema import ServeDeploySchema

    manifest = yaml.safe_load(RAYSERVICE_YAML.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)

    # Equal but for the config path: the image's baked preset (/etc/dapo/configs/...) there.
    def same_preset(apps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {**a, "args": {**a["args"], "config": Path(a["args"]["config"]).parts[-2:]}}
            for a in apps
        ]

    local = yaml.safe_load(SERVE_YAML.read_text())["applications"]
    assert same_preset(serve_config["applications"]) == same_preset(local)
    assert (
        manifest["spec"]["rayClusterConfig"]["rayVersion"]
        == importlib.import_module("ray").__version__
    )


def test_builder_options_fail_fast() -> None:
    from services.ray_serve import app

    args = _with_repo_config({"config": "configs/tiny.yaml"})
    app(
        {
            **args,
            "overrides": "rollout.group_size=4 rollout.max_response_len=8",
            "rollout_replicas": "3",
        }
    )
    autoscaled = {**args, "rollout_autoscaling": {"min_replicas": 1, "max_replicas": 4}}
    app(autoscaled)  # Serve validates the autoscaling config (and imports BacklogPolicy) here
    with pytest.raises(ConfigError, match="not both"):
        app({**autoscaled, "rollout_replicas": 2})
    with pytest.raises(ConfigError, match="group_size"):
        app({**args, "overrides": ["rollout.group_size=1"]})
    with pytest.raises(ConfigError, match="rollout_replica\n  Extra inputs"):
        app({**args, "rollout_replica": 2})


def test_backlog_policy_scales_on_the_prompt_backlog() -> None:
    from services.ray_serve import BACKLOG_METRIC, BacklogPolicy

    policy = BacklogPolicy(target_backlog_per_replica=16)

    def ctx(reports: dict[str, float] | None) -> Any:  # the fields BacklogPolicy reads
        metrics = None if reports is None else {BACKLOG_METRIC: reports}
        return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=3)

    assert policy(ctx(None)) == (3, {})  # nothing reported yet: hold
    assert policy(ctx({"r1": 40.0, "r2": 33.0})) == (3, {})  # ceil(40 / 16)
    assert policy(ctx({"r1": 0.0})) == (0, {})  # Serve raises it to min_replicas
    with pytest.raises(ValueError):
        BacklogPolicy(target_backlog_per_replica=0)


# --- the RayService's exposure (fast) ----------------------------------------------------------

RAY_CLIENT_PORT = 10001
RAY_STAGES_LABEL = {"app.kubernetes.io/component": "dapo-stages"}
KUBERAY_OPERATOR = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}},
}


SANDBOX_CONTAINER = "sandbox"


def _cluster() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(RAYSERVICE_YAML.read_text())["spec"]["rayClusterConfig"]
    return spec


def _groups() -> dict[str, dict[str, Any]]:
    """Node group -> its pod template (head, and each worker group by name)."""
    cluster = _cluster()
    return {"head": cluster["headGroupSpec"]["template"]} | {
        g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]
    }


def test_rayservice_requires_a_token_and_binds_no_wildcard() -> None:
    cluster = _cluster()
    # Token auth (Ray >= 2.52, KubeRay >= 1.5.1): the operator generates the token and passes it
    # to every Ray container and to its own dashboard calls.
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(int(x) for x in cluster["rayVersion"].split(".")[:2]) >= (2, 52)
    head = cluster["headGroupSpec"]
    # KubeRay sets dashboard-host to 0.0.0.0 when it is absent.
    host = head["rayStartParams"].get("dashboard-host")
    assert host in {"127.0.0.1", "$(POD_IP)"}, f"dashboard-host {host!r}"
    (ray_head,) = head["template"]["spec"]["containers"]
    names = [e["name"] for e in ray_head["env"]]
    assert ray_head["env"][names.index("POD_IP")]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    # The head Service lists the head container's ports: no client port, no client Service.
    ports = ray_head["ports"]
    assert RAY_CLIENT_PORT not in {p["containerPort"] for p in ports} and "client" not in {
        p["name"] for p in ports
    }
    for group, template in _groups().items():
        for c in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("RAY_AUTH_MODE", "token") == "token", f"{group}: token auth switched off"


def test_rayservice_mounts_the_shared_volume_read_only() -> None:
    for group, template in _groups().items():
        claims = {v["name"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v}
        for c in template["spec"]["containers"]:
            for m in c["volumeMounts"]:
                assert m["name"] not in claims or m.get("readOnly") is True, (
                    f"{group}: {m} is writable"
                )


def test_rayservice_pods_reach_redis_with_the_secret_password() -> None:
    from tests.deploy.test_manifests import check_redis_client_env

    for group, template in _groups().items():
        for c in template["spec"]["containers"]:
            if c["name"] == SANDBOX_CONTAINER:
                continue  # holds no secret (test_untrusted_code_runs_beside_the_ray_worker)
            check_redis_client_env(
                c["env"],
                f"rayservice {group}",
                {"DAPO_REDIS_URL_ROLLOUT": "rollout", "DAPO_REDIS_URL_REWARD": "reward"},
            )


def test_ray_pods_are_admitted_by_the_base_policies_they_need() -> None:
    """Ray pods carry the labels the base NetworkPolicies select: every node reaches Redis, the
    worker nodes (where rollout replicas run) take part in weight sync."""
    from tests.deploy.test_manifests import REDIS_CLIENT_LABEL, WEIGHT_SYNC_LABEL

    for group, template in _groups().items():
        labels = template["metadata"]["labels"]
        assert RAY_STAGES_LABEL.items() <= labels.items(), group
        assert REDIS_CLIENT_LABEL.items() <= labels.items(), group
        assert (WEIGHT_SYNC_LABEL.items() <= labels.items()) == (group != "head"), group
        # KubeRay selects the head Service on app.kubernetes.io/name=kuberay: leave it alone.
        assert "app.kubernetes.io/name" not in labels, group


def test_ray_network_policy_admits_only_ray_nodes_and_the_operator() -> None:
    policies = {
        d["metadata"]["name"]: d for d in yaml.safe_load_all(RAY_POLICY_YAML.read_text()) if d
    }
    assert {(d["kind"], d["metadata"]["namespace"]) for d in policies.values()} == {
        ("NetworkPolicy", "dapo")
    }
    opened: dict[tuple[str, str], list[tuple[str, int | None]]] = {}
    for p in policies.values():
        assert p["spec"]["policyTypes"] == ["Ingress"]
        for rule in p["spec"]["ingress"]:
            assert rule["from"] and rule["ports"], p["metadata"]["name"]
            key = (
                json.dumps(p["spec"]["podSelector"], sort_keys=True),
                json.dumps(rule["from"], sort_keys=True),
            )
            opened[key] = sorted(
                (port.get("protocol", "TCP"), port.get("port")) for port in rule["ports"]
            )
    nodes = json.dumps({"matchLabels": RAY_STAGES_LABEL}, sort_keys=True)
    head = json.dumps(
        {"matchLabels": RAY_STAGES_LABEL | {"ray.io/node-type": "head"}}, sort_keys=True
    )
    assert opened == {
        # Ray nodes among themselves: GCS, raylets, object managers and workers use many ports.
        (nodes, json.dumps([{"podSelector": {"matchLabels": RAY_STAGES_LABEL}}], sort_keys=True)): [
            ("TCP", None)
        ],
        # The operator: the dashboard (serve config, status) and the Serve proxy's health route.
        (head, json.dumps([KUBERAY_OPERATOR], sort_keys=True)): [("TCP", 8000), ("TCP", 8265)],
    }
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed"
    )
    for doc in policies.values():
        kv.validate(doc, "1.28.0", strict=True)


# --- the replica host without Serve -------------------------------------------------------------


def _overrides(redis_url: str, model_dir: Path, tmp_path: Path) -> list[str]:
    return [
        f"model.path={model_dir}",
        "rollout.engine=transformers",
        f"queue.redis_url={redis_url}",
        "rollout.group_size=4",
        "rollout.max_response_len=8",
        "reward.overlong.buffer_len=2",
        "rollout.torch_threads=1",
        "queue.heartbeat_ttl_s=5",
        f"output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
    ]


def _keys(redis_url: str, pattern: str) -> set[str]:
    import redis

    return {k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(match=pattern)}


def test_host_starts_reports_and_stops_like_the_cli_worker(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from contracts.keys import Keys
    from services.ray_serve import RewardHost

    keys = Keys()
    host = RewardHost(str(TINY), _overrides(redis_url, tiny_model_dir, tmp_path))
    try:
        status = host()
        assert (status["role"], status["alive"], status["groups"]) == ("reward", True, 0)
        host.check_health()
        assert _keys(redis_url, keys.heartbeat_pattern()) == {keys.heartbeat("reward", host.id)}
    finally:
        host.__del__()  # what Serve calls on shutdown
    assert not host.thread.is_alive()
    assert _keys(redis_url, keys.heartbeat_pattern()) == set()
    assert _keys(redis_url, keys.final_stats_pattern()) == {keys.final_stats("reward", host.id)}
    host.__del__()  # and again from the garbage collector: a no-op


def test_check_health_surfaces_a_dead_worker(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contracts.keys import Keys
    from contracts.runtime import StageLoop
    from reward.service import RewardStage
    from services.ray_serve import RewardHost, WorkerDied

    def explode() -> None:
        raise RuntimeError("verifier exploded")

    # The worker fails as the skeleton starts it (after the heartbeat, inside the stage loop).
    def failing_loop(self: RewardStage) -> StageLoop:
        return StageLoop(self.transport.keys.rollouts, start=explode)

    monkeypatch.setattr(RewardStage, "loop", property(failing_loop))
    host = RewardHost(str(TINY), _overrides(redis_url, tiny_model_dir, tmp_path))
    host.thread.join(10)
    with pytest.raises(WorkerDied, match="verifier exploded"):
        host.check_health()
    assert _keys(redis_url, Keys().heartbeat_pattern()) == set()  # the learner stops counting it
    host.__del__()


# --- a local Serve application (slow) ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_replicas_score_prompt_jobs(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from contracts.bus import StreamBus, connect
    from contracts.data import parse_row
    from contracts.keys import Keys
    from contracts.schemas import decode_scored_group
    from learner.feeder import PromptFeeder
    from services.demo.synthetic import synth_rows
    from services.ray_serve import app

    overrides = _overrides(redis_url, tiny_model_dir, tmp_path)
    bus = StreamBus(connect(redis_url), Keys(), consumer="test")
    bus.ensure_groups()
    port = _free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        namespace="dapo-test",
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "config": str(TINY),
            "overrides": overrides,
            "rollout_replicas": 1,
            "reward_replicas": 1,
        }
        serve.run(app(args), name="dapo", route_prefix="/dapo")
        assert {i["role"] for i in bus.live_instances()} == {"rollout", "reward"}

        # Issue jobs exactly as the learner does: the feeder, with admission control.
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        records = [parse_row(row, row_number=i) for i, row in enumerate(synth_rows(4, seed=1))]
        feeder = PromptFeeder(
            records,
            tokenizer,
            transport=bus,
            run_state=bus,
            telemetry=bus,
            prompt_history=bus,
            run_name="serve",
            limit=4,
            kept_ahead=4,
            max_prompt_len=64,
            shuffle=False,
            seed=0,
            job_key=WEIGHTS_KEY,  # signed as the learner signs: the reward replicas take no other
        )
        assert feeder.admit(policy_version=0) == 4

        def scored() -> list[Any] | None:
            entries: list[Any] = bus.redis.xrange(bus.keys.scored.stream)  # type: ignore[assignment]
            return entries if len(entries) == 4 else None

        entries = _wait_for("4 scored groups", scored, 90)
        groups = [decode_scored_group(fields) for _, fields in entries]
        assert sorted(g.job.group_id for g in groups) == [f"serve-{i}" for i in range(4)]
        for g in groups:
            assert len(g.rewards) == 4 and len(g.responses) == 4
            assert g.replica_id.startswith("rollout-") and g.policy_version == 0
        snap = bus.ledger()
        assert (snap.issued, snap.in_flight, snap.balanced) == (4, 4, True)

        rollout = serve.get_deployment_handle("RolloutReplica", app_name="dapo")
        status = rollout.remote().result(timeout_s=30)
        assert status["role"] == "rollout" and status["alive"] and status["groups"] == 4
        assert status["policy_version"] == 0 and 0.0 <= status["idle_fraction"] <= 1.0
        assert rollout.record_autoscaling_stats.remote().result(timeout_s=30) == {
            "prompt_backlog": 0.0
        }
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dapo", timeout=30) as resp:
            both = json.load(resp)
        assert (both["rollout"]["groups"], both["reward"]["groups"]) == (4, 4)
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()

    # Shutdown ran each replica's __del__: heartbeats deleted (or, at worst, expired), final
    # stats written.
    _wait_for(
        "heartbeats gone",
        lambda: not list(bus.redis.scan_iter(match=bus.keys.heartbeat_pattern())),
        10,
    )
    finals = {
        k.decode().split(":")[2] for k in bus.redis.scan_iter(match=bus.keys.final_stats_pattern())
    }
    assert finals == {"rollout", "reward"}
    assert bus.ledger().balanced


def test_untrusted_code_runs_beside_the_ray_worker_in_a_sandbox_container() -> None:
    """The worker nodes, where the stages' replicas run, start their tools and reward code in a
    sandbox host beside the Ray worker, as the rollout and reward pods do: the same image under
    another uid, serving the worker's uid only, no secret, sharing only the socket's volume,
    which the worker names. The head runs no replica (num-cpus 0), so no sandbox."""
    from tests.deploy.test_manifests import SANDBOX_SOCKET, check_invocation

    cluster = _cluster()
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in cluster["workerGroupSpecs"]:
        pod, where = group["template"]["spec"], f"worker group {group['groupName']}"
        ray_worker, host = (
            next(c for c in pod["containers"] if c["name"] == name)
            for name in ("ray-worker", SANDBOX_CONTAINER)
        )
        check_invocation(host["command"], where)
        worker_uid = pod["securityContext"]["runAsUser"]
        serves = ["--allow-uid", str(worker_uid)]
        assert host["command"][1:] == ["sandbox-host", "--socket", SANDBOX_SOCKET, *serves]
        assert host["image"] == ray_worker["image"], f"{where}: the worker's image, its paths"
        assert host["securityContext"]["runAsUser"] not in (0, worker_uid), where
        assert all("valueFrom" not in e for e in host["env"]), f"{where}: a secret in the sandbox"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in host["volumeMounts"]}
        assert all("emptyDir" in volumes[v] for v in mounts), f"{where}: {mounts}"
        socket_volume = next(v for v, path in mounts.items() if path == "/run/dapo-sandbox")
        worker_mounts = {m["name"]: m["mountPath"] for m in ray_worker["volumeMounts"]}
        assert worker_mounts[socket_volume] == "/run/dapo-sandbox", where
        env = {e["name"]: e.get("value") for e in ray_worker["env"]}
        assert env["DAPO_SANDBOX_SOCKET"] == SANDBOX_SOCKET, where


def test_ray_pods_run_locked_down_with_a_writable_tmp() -> None:
    """Read-only root filesystems: Ray's session directory and the caches go to an emptyDir
    /tmp; no service-account token is mounted."""
    for group, template in _groups().items():
        pod = template["spec"]
        assert pod.get("automountServiceAccountToken") is False, group
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, group
            (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], group


def test_serve_and_the_cli_build_the_rollout_replica_alike(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One factory for every host: a Serve replica gets the tools the config enables and the
    sampling seed of its name (DAPO_REPLICA_NAME, which survives a restart), as `dapo rollout`
    does. The Serve host once built its replica without tools, and seeded by process id."""
    from contracts.config import load_config
    from contracts.runtime import service_context
    from rollout import service
    from rollout.engine import REPLICA_NAME_ENV
    from services.ray_serve import RolloutHost

    seeded_by: list[str | None] = []
    real_make_engine = service.make_engine

    def make_engine(cfg: Any, *, replica_id: str | None = None) -> Any:
        seeded_by.append(replica_id)
        return real_make_engine(cfg, replica_id=replica_id)

    monkeypatch.setattr(service, "make_engine", make_engine)
    monkeypatch.setenv(REPLICA_NAME_ENV, "rollout-a")
    overrides = [
        *_overrides(redis_url, tiny_model_dir, tmp_path),
        "rollout.tools.enabled=true",
        "rollout.tools.functions=[calculator]",
    ]
    host = RolloutHost(str(TINY), overrides)
    cfg = load_config(str(TINY), overrides)
    cli = service.build_replica(cfg, service_context(cfg, "rollout", install_signals=False))
    try:
        served = host.worker
        assert isinstance(served, service.RolloutReplica)
        assert served.tools is not None and cli.tools is not None
        assert list(served.tools.sandboxes) == list(cli.tools.sandboxes) == ["calculator"]
        assert type(served.engine) is type(cli.engine)
        assert seeded_by == ["rollout-a", "rollout-a"]
    finally:
        host.__del__()
        cli.close()
