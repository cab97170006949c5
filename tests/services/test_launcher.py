"""`dapo run`'s own console and its prepare step, without starting the services.

- The progress line shows the pace (steps/s, time left) as tqdm formats it, from the steps it saw.
- An `hf://` model is downloaded once (the download injected: nothing can be downloaded here) and
  the services get the local snapshot and `HF_HUB_OFFLINE=1`; a local directory is used as is.
- The console shows each log line of the prepare step once.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

import services.data.prepare as prepare_step
import services.run.launcher as launcher
from contracts.bus import LedgerSnapshot
from contracts.config import ConfigError
from contracts.model_source import MODEL_FILES
from services.data.prepare import prepare
from services.run.progress import Progress
from services.run.supervisor import Service
from tests.helpers import model_config

REPO = Path(__file__).resolve().parents[2]


class FakeBus:
    """What the progress line reads, with the learner's step set by the test."""

    def __init__(self) -> None:
        self.step = 0

    def learner_state(self) -> dict[str, str]:
        return {"state": "training", "step": str(self.step)}

    def last_metrics(self) -> dict[str, Any]:
        return {"critic/rewards/mean": 0.25, "rollout/acc_mean": 0.5, "gate/pass_rate": 0.75}

    def eval_history(self) -> list[tuple[int, float, float]]:
        return [(0, 0.2, 0.0)]

    def ledger(self) -> LedgerSnapshot:
        return LedgerSnapshot(issued=40, trained=30, filtered=5, stale=0, dead=0, in_flight=5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(total: int, quiet: bool = False) -> tuple[Progress, FakeBus, Clock, io.StringIO]:
    bus, clock, out = FakeBus(), Clock(), io.StringIO()
    return Progress(bus, total, quiet, clock=clock, stream=out), bus, clock, out  # type: ignore[arg-type]


def test_progress_line_shows_steps_per_second_and_the_time_left() -> None:
    progress, bus, clock, out = _progress(total=100)
    bus.step = 4  # a resumed run: the pace is measured from the steps reached while watching
    assert "step 4/100 [training] ?step/s eta ?" in progress.line()
    clock.now += 45.0  # start-up and the base evaluation: no training step, not in the pace
    bus.step = 5
    assert "?step/s eta ?" in progress.line()
    for _ in range(3):  # then a step every 0.5 s
        clock.now += 0.5
        bus.step += 1
        progress.line()
    progress.show()
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1  # not a terminal: one line per 10 s
    # 2 steps/s; 92 steps left -> 46 s
    assert "step 8/100 [training] 2.00step/s eta 00:46 reward 0.250 acc 0.500 eval 0.200" in line
    progress.show()
    assert out.getvalue() == line  # the next line comes 10 s later
    for _ in range(2):  # slower than a step a second: seconds per step, as tqdm shows them
        clock.now += 130.0
        bus.step += 1
    assert "130.00s/step eta 3:15:00" in progress.line()  # the window forgot the fast steps
    bus.step = 3  # an operator restore went back
    assert "?step/s eta ?" in progress.line()


def test_quiet_progress_writes_nothing() -> None:
    progress, bus, clock, out = _progress(total=10, quiet=True)
    for _ in range(3):
        clock.now += 11.0
        bus.step += 1
        progress.show()
    progress.close()
    assert out.getvalue() == ""


# --- the model ----------------------------------------------------------------------------------
class FakeDownload:
    """`huggingface_hub.snapshot_download` as `prepare` calls it: a snapshot directory in a
    Hugging Face cache layout."""

    def __init__(self, cache: Path, fail: Exception | None = None) -> None:
        self.cache, self.fail = cache, fail
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        if self.fail is not None:
            raise self.fail
        snapshot = (
            self.cache / f"models--{kwargs['repo_id'].replace('/', '--')}" / "snapshots" / "abc123"
        )
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text("{}")
        return str(snapshot)


def test_a_hub_model_is_downloaded_once_and_the_services_read_the_snapshot_offline(
    tmp_path: Path,
) -> None:
    download = FakeDownload(tmp_path / "hf-cache")
    prepared = prepare(
        model_config(tmp_path, "hf://Qwen/Qwen2.5-0.5B-Instruct", revision="v1"), download=download
    )
    assert download.calls == [
        {"repo_id": "Qwen/Qwen2.5-0.5B-Instruct", "revision": "v1", "allow_patterns": MODEL_FILES}
    ]
    snapshot = (
        tmp_path / "hf-cache" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc123"
    )
    assert prepared.cfg.model.path == str(snapshot) and Path(prepared.cfg.model.path).is_dir()
    assert prepared.env == {"HF_HUB_OFFLINE": "1"}
    assert "*.safetensors" in MODEL_FILES and not any(
        p.endswith((".bin", ".pth", ".pt")) for p in MODEL_FILES
    )


def test_a_local_directory_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    download = FakeDownload(tmp_path / "hf-cache")
    cfg = model_config(tmp_path, str(tmp_path / "model"))
    prepared = prepare(cfg, download=download)
    assert prepared.cfg == cfg and prepared.env == {} and download.calls == []


def test_a_missing_directory_fails_before_any_service_starts(tmp_path: Path) -> None:
    """`models/Qwen2.5-7B` (a preset's path) has the shape of a Hub id: without `hf://` it is a
    local directory, and a missing one is an error, never a download."""
    download = FakeDownload(tmp_path / "hf-cache")
    with pytest.raises(
        ConfigError,
        match=r"model.path='models/Qwen2.5-7B': no such model directory .*hf://OWNER/NAME",
    ):
        prepare(model_config(tmp_path, "models/Qwen2.5-7B"), download=download)
    assert download.calls == []


def test_a_failed_download_names_the_id_and_why(tmp_path: Path) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    download = FakeDownload(
        tmp_path / "hf-cache", fail=LocalEntryNotFoundError("offline and not in the cache")
    )
    with pytest.raises(
        ConfigError,
        match=r"model.path='hf://org/model': downloading org/model \(revision default\).*"
        r"LocalEntryNotFoundError: offline and not in the cache",
    ):
        prepare(model_config(tmp_path, "hf://org/model"), download=download)


@pytest.mark.parametrize(
    ("path", "hub_id"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("hf://gpt2", "gpt2"),
        ("Qwen/Qwen2.5-7B-Instruct", None),
        ("runs/cache/tiny", None),
        ("/models/qwen", None),
    ],
)
def test_only_hf_paths_are_hub_models(tmp_path: Path, path: str, hub_id: str | None) -> None:
    assert model_config(tmp_path, path).model.hub_id == hub_id


@pytest.mark.parametrize(
    "path", ["hf://", "hf://a/b/c", "hf://org/", "hf://../x", "hf://org/na me"]
)
def test_a_malformed_hub_model_fails_when_the_config_loads(tmp_path: Path, path: str) -> None:
    with pytest.raises(ConfigError, match=r"model.path=.*expected hf://OWNER/NAME"):
        model_config(tmp_path, path)


def test_a_tiny_model_is_built_in_a_directory_not_a_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.build_tiny builds a local model"):
        model_config(tmp_path, "hf://org/model", build_tiny={})


class StartRefused(Exception):
    pass


def test_dapo_run_hands_the_services_the_snapshot_and_offline_mode(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_local` downloads before the first service starts; the config file every service reads
    names the snapshot, and the services' environment is offline."""
    import huggingface_hub

    download = FakeDownload(tmp_path / "hf-cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    started: list[tuple[str, dict[str, str]]] = []

    def start(self: Service, env: dict[str, str]) -> None:
        started.append((self.name, env))
        raise StartRefused  # stop here: no process is started

    monkeypatch.setattr(Service, "start", start)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(StartRefused):
        launcher.run_local(
            model_config(tmp_path, "hf://org/model", redis_url=redis_url), quiet=True
        )
    assert len(download.calls) == 1 and download.calls[0]["repo_id"] == "org/model"
    [(name, env)] = started
    assert name == "learner" and env["HF_HUB_OFFLINE"] == "1"
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["model"]["path"] == download(repo_id="org/model")


# --- the console ---------------------------------------------------------------------------------
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d \S+\[\d+\] [A-Z]+ [\w.]+: ")

STOP_AFTER_PREPARE = """
import sys
import services.run.launcher as launcher
from services.cli import main

def stop(*args, **kwargs):
    raise SystemExit(3)  # prepare is done; connecting to Redis comes next

launcher.open_bus = stop
sys.exit(main(sys.argv[1:]))
"""


def test_the_prepare_step_prints_each_log_line_once(tmp_path: Path) -> None:
    """`dapo run` as a user starts it, up to the end of its prepare step (building a tiny base
    model: the step that logs the most)."""
    config = {
        "output_dir": str(tmp_path / "run"),
        "model": {
            "path": str(tmp_path / "model"),
            "build_tiny": {
                "hidden_size": 32,
                "num_heads": 1,
                "num_layers": 1,
                "intermediate_size": 64,
                "vocab_size": 300,
                "sft_max_steps": 2,
                "sft_eval_every": 1,
                "sft_batch_size": 8,
            },
        },
        "data": {
            "train_path": str(tmp_path / "train.jsonl"),
            "eval_path": str(tmp_path / "eval.jsonl"),
            "synth": {"num_train": 200, "num_eval": 8},
        },
        "rollout": {"engine": "transformers", "max_response_len": 16},
        "reward": {"overlong": {"buffer_len": 4}},
        "queue": {"redis_url": "redis://127.0.0.1:1/0"},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            STOP_AFTER_PREPARE,
            "run",
            "--config",
            str(tmp_path / "config.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    said = Counter(LOG_LINE.sub("", line).strip() for line in lines)
    assert [n for text, n in said.items() if text.startswith("tiny base: step 1 ")] == [1]
    repeated = {text: n for text, n in said.items() if n > 1}
    assert not repeated, proc.stderr[-3000:]
    assert any(m.startswith("tiny base: saved to") for m in said)  # the build did log its progress


def _synth_config(tmp_path: Path, num_train: int, model_path: Path) -> Any:
    from contracts.config import build_config

    return build_config(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(model_path), "build_tiny": {}},
            "data": {
                "train_path": str(tmp_path / f"train-{num_train}.parquet"),
                "synth": {"num_train": num_train, "num_eval": 4},
            },
            "rollout": {"max_response_len": 16},
            "reward": {"overlong": {"buffer_len": 4}},
        }
    )


def test_the_tiny_base_learns_from_the_same_rows_whatever_the_run_trains_on(
    tmp_path: Path,
) -> None:
    """A preset over 1,000 problems and one over 20,000 name the same cached base: both must
    build it from the same rows, or whichever ran first decides every later run's model."""
    small = _synth_config(tmp_path, 1000, tmp_path / "base")
    large = _synth_config(tmp_path, 20000, tmp_path / "base")
    rows = prepare_step._base_train_rows(small)
    assert len(rows) == prepare_step.BASE_TRAIN_ROWS
    assert rows == prepare_step._base_train_rows(large)
    # Nor does the data seed: `dapo ablate --seeds 3` runs seeds 1 and 2 on seed 0's cached base.
    reseeded = small.model_copy(update={"data": small.data.model_copy(update={"seed": 2})})
    assert prepare_step._base_train_rows(reseeded) == rows


def test_a_cached_tiny_base_built_from_other_rows_is_refused(tmp_path: Path) -> None:
    from services.demo.tiny_base import BUILD_INFO

    cfg = _synth_config(tmp_path, 1000, tmp_path / "base")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "base" / BUILD_INFO).write_text(json.dumps({"train_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="built from other training rows"):
        prepare_step._local_model(cfg)
