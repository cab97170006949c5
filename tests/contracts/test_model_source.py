"""`model.path` resolved to a local directory (contracts.model_source): a local path as
it is, an `hf://OWNER/NAME` model as its snapshot in the Hugging Face cache, by `dapo run` and
by each service started on its own (`dapo rollout`, `dapo reward`, `dapo learner`). Downloads
are injected; the real `snapshot_download` is run offline against a cache laid out here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import contracts.model_source as model_source
from contracts.config import ConfigError, DapoConfig
from contracts.model_source import MODEL_FILES, fetch_model, with_local_model
from tests.helpers import model_config

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_snapshot(hub_cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """The layout huggingface_hub writes: models--OWNER--NAME/{refs/main, snapshots/COMMIT/...}."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


class FakeDownload:
    """`snapshot_download` that records its arguments and returns a snapshot with a config."""

    def __init__(self, hub_cache: Path) -> None:
        self.hub_cache = hub_cache
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        repo = self.hub_cache / f"models--{kwargs['repo_id'].replace('/', '--')}"
        snapshot = repo / "snapshots" / COMMIT
        if not snapshot.exists():
            cached_snapshot(self.hub_cache, kwargs["repo_id"], {"config.json": "{}"})
        return str(snapshot)


def test_a_hub_model_resolves_to_its_snapshot_with_only_the_model_files(tmp_path: Path) -> None:
    download = FakeDownload(tmp_path / "hub")
    cfg = model_config(tmp_path, "hf://Qwen/Qwen2.5-0.5B-Instruct", revision="v1", dtype="bfloat16")
    local = with_local_model(cfg, download)
    assert download.calls == [
        {"repo_id": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "v1", "allow_patterns": MODEL_FILES}
    ]
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / COMMIT
    assert local.model.path == str(snapshot)
    assert local.model.model_dump(exclude={"path"}) == cfg.model.model_dump(exclude={"path"})
    assert local.model_dump(exclude={"model"}) == cfg.model_dump(exclude={"model"})


def test_a_local_directory_is_never_downloaded(tmp_path: Path) -> None:
    download = FakeDownload(tmp_path / "hub")
    cfg = model_config(tmp_path, str(tmp_path / "model"))
    assert with_local_model(cfg, download) is cfg and download.calls == []
    with pytest.raises(ConfigError, match="is not an hf://OWNER/NAME model"):
        fetch_model(cfg.model, download)


def test_a_snapshot_without_config_is_refused(tmp_path: Path) -> None:
    snapshot = cached_snapshot(tmp_path / "hub", "org/weights-only", {"model.safetensors": ""})
    with pytest.raises(ConfigError, match=r"has no config.json \(not a transformers model\)"):
        fetch_model(
            model_config(tmp_path, "hf://org/weights-only").model, lambda **_: str(snapshot)
        )


def test_the_real_download_finds_a_cached_model_offline(tmp_path: Path) -> None:
    """huggingface_hub's own `snapshot_download`, offline: a model another process already put
    in the shared cache is found there, nothing is fetched, and a missing one fails clearly."""
    snapshot = cached_snapshot(
        tmp_path / "hf" / "hub", "org/tiny", {"config.json": '{"model_type": "qwen2"}'}
    )
    code = (
        "import json, sys\n"
        "from contracts.config import ConfigError, build_config\n"
        "from contracts.model_source import fetch_model\n"
        "out = []\n"
        "for path in ('hf://org/tiny', 'hf://org/absent'):\n"
        "    cfg = build_config({'model': {'path': path}, 'data': {'train_path': 'x.jsonl'},\n"
        "                        'rollout': {'max_response_len': 16},\n"
        "                        'reward': {'overlong': {'buffer_len': 4}}})\n"
        "    try:\n"
        "        out.append(fetch_model(cfg.model))\n"
        "    except ConfigError as exc:\n"
        "        out.append(str(exc))\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    found, missing = json.loads(proc.stdout)
    assert Path(found) == snapshot
    assert missing.startswith("model.path='hf://org/absent': downloading org/absent")


class Resolved(Exception):
    """Raised by the test's stand-in for a service's first step after resolving the model."""

    def __init__(self, cfg: DapoConfig) -> None:
        super().__init__(cfg.model.path)
        self.cfg = cfg


def _stop_with_cfg(cfg: DapoConfig, *args: Any, **kwargs: Any) -> Any:
    raise Resolved(cfg)


class NoSignals:
    """The learner's StopFlag, without touching this test process's signal handlers."""

    def install(self) -> NoSignals:
        return self


@pytest.mark.parametrize("service", ["rollout", "reward", "learner"])
def test_a_service_started_on_its_own_resolves_an_hf_model_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    """`dapo rollout|reward|learner` with `model.path: hf://...` (compose, Kubernetes) load the
    cache's snapshot: what they hand on is the local directory, before anything else runs."""
    download = FakeDownload(tmp_path / "hub")
    monkeypatch.setattr(model_source, "_hub_download", download)
    if service == "learner":
        import learner.service as module

        # its first steps: signal handlers, then the process group, which gets the config
        monkeypatch.setattr(module, "StopFlag", NoSignals)
        monkeypatch.setattr(module, "init_distributed", _stop_with_cfg)
    elif service == "rollout":
        import rollout.service as module

        monkeypatch.setattr(module, "service_context", _stop_with_cfg)
    else:
        import reward.service as module

        monkeypatch.setattr(module, "service_context", _stop_with_cfg)
    with pytest.raises(Resolved) as resolved:
        module.main(model_config(tmp_path, "hf://org/model", revision="main"))
    assert [c["repo_id"] for c in download.calls] == ["org/model"]
    assert resolved.value.cfg.model.path == str(
        tmp_path / "hub" / "models--org--model" / "snapshots" / COMMIT
    )
