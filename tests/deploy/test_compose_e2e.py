"""The compose deployment for real: a private Docker engine, the images built with the legacy
builder, `docker-compose --profile cpu up` with two rollout replicas, then, while it trains: a
third replica scaled in (it joins the weight group and takes work), one replica killed (the run
goes on), the learner stopped and started (it resumes from the checkpoint it wrote on the way
out), and `down -v`. At the end the ledger balances and nothing was trained twice.

Everything is observed from outside, as an operator would: `/status` through the API port that
compose publishes on loopback, `docker-compose logs`, and the checkpoint store on the data root.

Machinery: deploy/local-docker.sh (install docker.io and friends, start dockerd with its own
state directory, build the stand-in base images and the wheelhouse, build the image, stop dockerd
by its PID and undo what it changed on the host). It needs root and apt; without them the test
skips, unless DAPO_REQUIRE_DOCKER=1 (set by .ci/run), which turns every such skip into a failure.

Figures (build, start-up, first-step and phase times, image sizes, the /status snapshots) are
printed and written to test-artifacts/compose_e2e.json.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from contracts.bus.roles import PASSWORD_ENV_PREFIX, Role
from contracts.runtime import free_port
from contracts.signing import new_weights_key
from tests.helpers import wait_for

REPO = Path(__file__).resolve().parents[2]
LOCAL_DOCKER = REPO / "deploy" / "local-docker.sh"
RUN_NAME = "compose-e2e"
TRAIN_BATCH_GROUPS = 16  # algorithm.train_batch_groups of configs/tiny.yaml: groups per step

pytestmark = [pytest.mark.slow, pytest.mark.io_bound, pytest.mark.usefixtures("tiny_cache")]


def unavailable(reason: str) -> None:
    """Skip, or fail where the CI asks for the real thing (DAPO_REQUIRE_DOCKER=1)."""
    if os.environ.get("DAPO_REQUIRE_DOCKER") == "1":
        pytest.fail(f"DAPO_REQUIRE_DOCKER=1, but {reason}")
    pytest.skip(reason)


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]


@dataclass
class Engine:
    """The private dockerd started by deploy/local-docker.sh, and how to run commands against it."""

    state: Path
    env: dict[str, str]
    docker: str
    timings: dict[str, float] = field(default_factory=dict)

    def script(self, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
        """`deploy/local-docker.sh ARGS`, timed under timings[ARGS[0]]; fails the test on error."""
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", str(LOCAL_DOCKER), *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        self.timings[args[0]] = round(time.monotonic() - started, 1)
        assert proc.returncode == 0, (
            f"local-docker.sh {' '.join(args)}:\n{tail(proc.stdout)}\n{tail(proc.stderr)}"
        )
        return proc

    def run(self, *args: str, timeout_s: float = 120) -> str:
        proc = subprocess.run(
            [self.docker, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert proc.returncode == 0, f"docker {' '.join(args)}: {proc.stderr}"
        return proc.stdout.strip()

    def logs(self, container: str) -> str:
        """A container's output (its services log to stderr)."""
        proc = subprocess.run(
            [self.docker, "logs", container],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return proc.stdout + proc.stderr

    def image_size_mb(self, image: str) -> int:
        return round(int(self.run("image", "inspect", "-f", "{{.Size}}", image)) / 1e6)


@pytest.fixture()
def engine() -> Iterator[Engine]:
    """dockerd with a fresh state directory (so every image is built cold), stopped by its PID
    and tidied away afterwards, whatever the test did."""
    if os.geteuid() != 0:
        unavailable("the compose test needs root (dockerd, iptables, apt-get)")
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        unavailable("neither dockerd nor apt-get to install it")
    state = Path(tempfile.mkdtemp(prefix="dapo-docker-"))
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "DAPO_DOCKER_STATE": str(state),
        "DOCKER_HOST": f"unix://{state}/docker.sock",
        "DOCKER_BUILDKIT": "0",
        "COMPOSE_DOCKER_CLI_BUILD": "0",
        # pip's own configuration (local wheel directories, indexes, CA bundle) for the wheelhouse.
        **{
            k: v
            for k, v in os.environ.items()
            if k.startswith(("PIP_", "XDG_")) or k in ("SSL_CERT_FILE", "DAPO_CACHE")
        },
    }
    for step, limit in (("setup", 600), ("start", 120)):
        proc = subprocess.run(
            ["bash", str(LOCAL_DOCKER), step],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
            check=False,
        )
        if proc.returncode != 0:
            shutil.rmtree(state, ignore_errors=True)
            unavailable(f"`deploy/local-docker.sh {step}` failed: {tail(proc.stderr, 1500)}")
    docker = (
        "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
    )  # Debian's client, matching its dockerd
    try:
        yield Engine(state, env, docker)
    finally:
        subprocess.run(
            ["bash", str(LOCAL_DOCKER), "purge"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=180,
            check=False,
        )
        leftover = [
            line
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if str(state) in line
        ]
        assert not state.exists() and not leftover, (
            f"dockerd's state was not tidied away: {state}, mounts {leftover}"
        )


@dataclass
class Deployment:
    """One compose project (its own name, env file, config, data root and API port)."""

    engine: Engine
    project: str
    env_file: Path
    data_root: Path
    port: int
    token: str

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> str:
        """`docker-compose ARGS` on this project; fails the test on error when `check`."""
        proc = subprocess.run(
            [
                "docker-compose",
                "--env-file",
                str(self.env_file),
                "-p",
                self.project,
                "-f",
                str(REPO / "docker-compose.yml"),
                "--profile",
                "cpu",
                *args,
            ],
            cwd=REPO,
            env=self.engine.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert proc.returncode == 0 or not check, (
            f"docker-compose {' '.join(args)}:\n{tail(proc.stdout)}\n{tail(proc.stderr)}"
        )
        return proc.stdout

    def containers(self, service: str) -> list[str]:
        """Ids of the service's running containers."""
        return self.compose("ps", "-q", service).split()

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service)

    def call(self, path: str, method: str = "GET", token: str | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            return err.code, None

    def status(self) -> dict[str, Any]:
        """/status, or {} while the API is not answering (starting, or its Redis restarting)."""
        try:
            code, body = self.call("/status", token=self.token)
        except OSError:
            return {}
        return body if code == 200 else {}


def replicas(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Live rollout instances by host (a container's host name is its id's first 12 characters)."""
    return {i["host"]: i for i in status.get("instances", []) if i["role"] == "rollout"}


def figures(status: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of a /status snapshot."""
    return {
        "step": status["step"],
        "policy_version": status["policy_version"],
        "learner_state": status["learner_state"],
        "ledger": status["ledger"],
        "counters": status["counters"],
        "rollout": {
            host: {"policy_version": i["policy_version"], "groups": i.get("groups")}
            for host, i in sorted(replicas(status).items())
        },
    }


def write_config(path: Path) -> None:
    """configs/tiny.yaml with room for the phases: steps that outlast them, a checkpoint every 5
    steps, no periodic evaluation, a killed replica noticed within seconds (heartbeat) and its
    jobs handed on within half a minute (claim)."""
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text(encoding="utf-8"))
    assert cfg["algorithm"]["train_batch_groups"] == TRAIN_BATCH_GROUPS
    cfg["run_name"], cfg["output_dir"] = RUN_NAME, f"runs/{RUN_NAME}"
    cfg["rollout"]["replicas"] = 3
    cfg["learner"]["total_steps"] = 100_000  # the test ends the run with `down`, long before
    cfg["eval"]["every_steps"] = 0
    cfg["checkpoint"] = {"every_steps": 5, "keep_last": 2}
    cfg["queue"] = {"heartbeat_ttl_s": 10, "claim_idle_s": 30}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    path.chmod(0o644)


@pytest.fixture()
def deployment(engine: Engine, tmp_path: Path) -> Deployment:
    """Env file from .env.example with a fresh token and Redis password, the test's config, and a
    host data root seeded with the tiny model and data that the `tiny_cache` fixture built (the
    `prepare` service finds them and skips the minutes of warm-start training)."""
    data_root = tmp_path / "data"
    for name in ("synth-arith-heldout", "tiny-qwen2-arith-v3"):
        shutil.copytree(REPO / "runs" / "cache" / name, data_root / "runs" / "cache" / name)
    subprocess.run(["chown", "-R", "10001:10001", str(data_root)], check=True)  # the images' user
    write_config(tmp_path / "config.yaml")
    token, password, port = secrets.token_hex(16), secrets.token_hex(16), free_port()
    text = (REPO / ".env.example").read_text(encoding="utf-8")
    assert "\nDAPO_API_TOKEN=\n" in text and "\nDAPO_REDIS_PASSWORD=\n" in text
    assert "\nDAPO_WEIGHTS_KEY=\n" in text and "\nDAPO_WEIGHTS_PUBLIC_KEY=\n" in text
    private, public = new_weights_key()
    text = (
        text.replace("\nDAPO_API_TOKEN=\n", f"\nDAPO_API_TOKEN={token}\n")
        .replace("\nDAPO_REDIS_PASSWORD=\n", f"\nDAPO_REDIS_PASSWORD={password}\n")
        .replace("\nDAPO_WEIGHTS_KEY=\n", f"\nDAPO_WEIGHTS_KEY={private}\n")
        .replace("\nDAPO_WEIGHTS_PUBLIC_KEY=\n", f"\nDAPO_WEIGHTS_PUBLIC_KEY={public}\n")
    )
    # One Redis user per role, each with its own password (contracts/bus/roles.py).
    for role in Role:
        var = f"{PASSWORD_ENV_PREFIX}{role.name}"
        assert f"\n{var}=\n" in text, var
        text = text.replace(f"\n{var}=\n", f"\n{var}={secrets.token_hex(16)}\n")
    text += (
        f"\nDAPO_CONFIG_FILE={tmp_path / 'config.yaml'}\n"
        f"DAPO_DATA_ROOT={data_root}\nDAPO_API_PORT={port}\n"
    )
    env_file = tmp_path / "env"
    env_file.write_text(text, encoding="utf-8")
    return Deployment(engine, f"dapoe2e{secrets.token_hex(3)}", env_file, data_root, port, token)


def test_compose_up_scale_out_kill_and_learner_restart(
    engine: Engine, deployment: Deployment, artifacts_dir: Path
) -> None:
    started = time.monotonic()
    report: dict[str, Any] = {"timings_s": engine.timings, "status": {}}
    t = engine.timings

    # ---- images: stand-in bases, the wheelhouse, the CPU image (cold: dockerd's state is new) ----
    engine.script("base-images")
    engine.script("wheelhouse")
    engine.script("build")
    t["build_cold"] = t.pop("build")
    engine.script("build")  # every layer from the cache
    t["build_warm"] = t.pop("build")
    report["image_mb"] = {
        image: engine.image_size_mb(image)
        for image in ("dapo-services:cpu", "python:3.11-slim-bookworm", "redis:7.4-alpine")
    }
    user = engine.run("image", "inspect", "-f", "{{.Config.User}}", "dapo-services:cpu")
    assert user.split(":")[0] not in {"", "0", "root"}, f"the image runs as {user!r}"

    dep = deployment
    try:
        # ---- up: two rollout replicas; training steps advance -----------------------------------
        up_at = time.monotonic()
        dep.compose("up", "-d", "--scale", "rollout=2")
        t["compose_up"] = round(time.monotonic() - up_at, 1)
        api = engine.run("port", dep.containers("api")[0], "8000")
        assert api == f"127.0.0.1:{dep.port}", f"the API is published on {api}, not on loopback"
        wait_for(
            "the first training step",
            lambda: dep.status().get("step", 0) >= 1,
            timeout_s=420,
            every_s=1,
        )
        t["up_to_first_step"] = round(time.monotonic() - up_at, 1)
        first = dep.status()["step"]
        before = wait_for(
            "steps advancing with two replicas",
            lambda: (s := dep.status()) and s["step"] >= first + 3 and len(replicas(s)) == 2 and s,
            timeout_s=180,
            every_s=1,
        )
        assert all(r["groups"] > 0 for r in replicas(before).values()), replicas(before)
        report["status"]["before_scale_out"] = figures(before)

        # ---- scale out to three: the newcomer joins the weight group and takes work ----------
        original = set(dep.containers("rollout"))
        scale_at = time.monotonic()
        dep.compose("up", "-d", "--scale", "rollout=3")
        (newcomer,) = set(dep.containers("rollout")) - original
        host = newcomer[:12]
        after_scale = wait_for(
            "the third replica generating",
            lambda: (
                (s := dep.status())
                and (r := replicas(s).get(host))
                and (r.get("groups") or 0) > 0
                and s
            ),
            timeout_s=240,
            every_s=1,
        )
        t["scale_out_to_work"] = round(time.monotonic() - scale_at, 1)
        wait_for(
            "a broadcast to three replicas",
            lambda: "to 3 replicas" in dep.logs("learner"),
            timeout_s=120,
            every_s=2,
        )
        wait_for(
            "the third replica receiving a broadcast",
            lambda: "received policy version" in engine.logs(newcomer),
            timeout_s=60,
            every_s=2,
        )
        assert len(replicas(after_scale)) == 3 and after_scale["step"] > before["step"]
        report["status"]["after_scale_out"] = figures(after_scale)

        # ---- kill one of the first two: the run goes on with the others ----------------------
        victim = sorted(original)[0]
        engine.run("kill", victim)
        killed_at = dep.status()["step"]
        after_kill = wait_for(
            "training on after the kill",
            lambda: (
                (s := dep.status())
                and s["step"] >= killed_at + 5
                and victim[:12] not in replicas(s)
                and s
            ),
            timeout_s=240,
            every_s=1,
        )
        assert len(replicas(after_kill)) == 2 and host in replicas(after_kill)
        report["status"]["after_kill"] = figures(after_kill)

        # ---- the API's token is the env file's: mutating routes take it and refuse the rest ----
        assert dep.call("/checkpoints", "POST")[0] == 401
        assert dep.call("/checkpoints", "POST", token="not-the-token")[0] == 403
        assert dep.call("/checkpoints", "POST", token=dep.token)[0] == 202

        # ---- the reward stage's untrusted code runs in reward-sandbox, not beside its secrets --
        probe = (
            "import json; from sandbox.pool import Sandbox\n"
            "with Sandbox('sandbox.builtin_tools:python', workers=1, timeout_s=20) as box:\n"
            "    print(json.dumps([box.call(code).text for code in ("
            "'import os; print(os.getuid(), sorted(os.environ))', "
            "'import socket; socket.create_connection((\"redis\", 6379), timeout=2)')]))"
        )
        out = dep.compose("exec", "-T", "reward", "python", "-c", probe, timeout_s=120)
        identity, network = json.loads(out.strip().splitlines()[-1])
        assert identity.startswith("10002 "), f"the worker runs as {identity!r}"
        assert "DAPO_REDIS_URL" not in identity and "PASSWORD" not in identity, identity
        assert network.startswith("error:"), f"the worker reached the network: {network!r}"
        report["sandbox_probe"] = {"identity": identity, "network": network}

        # ---- stop and start the learner: it resumes from the checkpoint it wrote on the way out
        stop_at = time.monotonic()
        dep.compose("stop", "learner", timeout_s=240)
        t["learner_stop"] = round(time.monotonic() - stop_at, 1)
        stopped = wait_for(
            "the learner shown down",
            lambda: (s := dep.status()) and s["learner_state"] == "down" and s,
            timeout_s=60,
            every_s=1,
        )
        at = stopped["step"]
        assert (dep.data_root / "runs" / RUN_NAME / "checkpoints" / f"step_{at}").is_dir(), (
            f"no checkpoint of step {at}, where the learner stopped"
        )
        start_at = time.monotonic()
        dep.compose("start", "learner")
        resumed = wait_for(
            "the learner training again",
            lambda: (
                (s := dep.status()) and s["step"] >= at + 3 and s["learner_state"] != "down" and s
            ),
            timeout_s=240,
            every_s=1,
        )
        t["learner_restart_to_3_steps"] = round(time.monotonic() - start_at, 1)
        assert f"restored checkpoint step {at} " in dep.logs("learner"), (
            "the learner did not resume from its checkpoint"
        )
        report["status"]["learner_stopped"] = figures(stopped)
        report["status"]["after_learner_restart"] = figures(resumed)

        # ---- the ledger balances; nothing was trained twice -----------------------------------
        # The learner's step and the ledger's trained count are written one after the other:
        # read until a snapshot falls between two steps.
        final = wait_for(
            "a snapshot between steps",
            lambda: (
                (s := dep.status())
                and s["ledger"]["trained"] == TRAIN_BATCH_GROUPS * s["step"]
                and s
            ),
            timeout_s=60,
            every_s=0.2,
        )
        report["status"]["final"] = figures(final)
        ledger, counters = final["ledger"], final["counters"]
        assert ledger["balanced"] and ledger["dead"] == 0, ledger
        assert (
            counters.get("trained_twice", 0) == 0
            and counters.get("replica_version_regressions", 0) == 0
        ), counters
    finally:
        # Not checked here: a failure above must not be hidden behind one of these.
        (artifacts_dir / "compose_e2e_logs.txt").write_text(
            dep.compose("logs", "--no-color", "--tail", "300", timeout_s=60, check=False),
            encoding="utf-8",
        )
        down_at = time.monotonic()
        dep.compose("down", "-v", "-t", "30", timeout_s=300, check=False)
        t["compose_down"] = round(time.monotonic() - down_at, 1)
        t["test_total"] = round(time.monotonic() - started, 1)
        (artifacts_dir / "compose_e2e.json").write_text(
            json.dumps(report, indent=2), encoding="utf-8"
        )
        print(json.dumps(report, indent=2))
    assert not engine.run("ps", "-aq"), "containers left after down"
