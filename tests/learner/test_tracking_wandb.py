"""W&B tracking (learner.tracking.Trackers with `tracking.wandb_project` set), against a fake
`wandb` module that records what the trackers call: the run's project, name and config, the
per-step scalars at their step, and the completions table. The real wandb is not run here."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from contracts.config import DapoConfig, load_config
from learner.tracking import COMPLETIONS_TAG, MAX_CELL_CHARS, Completion, Trackers

REPO = Path(__file__).resolve().parents[2]


class FakeTable:
    def __init__(self, columns: list[str], data: list[list[Any]]) -> None:
        self.columns = columns
        self.data = data


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []
        self.finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture()
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A `wandb` module in sys.modules; `.inits` holds each init's keyword arguments and `.run`
    the run it returned."""
    recorded = types.SimpleNamespace(inits=[], run=FakeRun())
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> FakeRun:
        recorded.inits.append(kwargs)
        return recorded.run

    module.init = init
    module.Table = FakeTable
    monkeypatch.setitem(sys.modules, "wandb", module)
    return recorded


def wandb_config(tmp_path: Path, *overrides: str) -> DapoConfig:
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"output_dir={tmp_path}",
            "run_name=wandb-check",
            "tracking.wandb_project=dapo-tests",
            "tracking.tensorboard=false",
            *overrides,
        ],
    )


def test_the_run_is_started_with_the_project_name_and_whole_config(
    tmp_path: Path, fake_wandb: types.SimpleNamespace
) -> None:
    cfg = wandb_config(tmp_path, "algorithm.clip_high=0.3")
    Trackers(cfg).close()
    [init] = fake_wandb.inits
    assert (init["project"], init["name"]) == ("dapo-tests", "wandb-check")
    assert init["config"] == cfg.model_dump(mode="json")
    assert init["config"]["algorithm"]["clip_high"] == 0.3
    assert fake_wandb.run.finished


def test_scalars_are_logged_at_their_step_and_only_namespaced_numbers(
    tmp_path: Path, fake_wandb: types.SimpleNamespace
) -> None:
    trackers = Trackers(wandb_config(tmp_path))
    trackers.log(3, {"actor/pg_loss": 0.25, "gate/pass_rate": 1, "step": 3, "eval/note": "x"})
    trackers.log(4, {"actor/pg_loss": 0.5})
    trackers.close()
    assert fake_wandb.run.logged == [
        ({"actor/pg_loss": 0.25, "gate/pass_rate": 1.0}, 3),
        ({"actor/pg_loss": 0.5}, 4),
    ]


def test_completions_go_to_a_table_with_the_whole_text(
    tmp_path: Path, fake_wandb: types.SimpleNamespace
) -> None:
    long_response = "Answer: 4 " + "x" * (MAX_CELL_CHARS + 100)
    completions = [
        Completion("What is 2+2?", long_response, 1.0, True, "stop"),
        Completion("What is 3+3?", "7", -1.0, None, "length"),
    ]
    trackers = Trackers(wandb_config(tmp_path))
    trackers.log_completions(10, completions)
    trackers.log_completions(11, [])  # nothing sampled: nothing logged
    trackers.close()
    [(data, step)] = fake_wandb.run.logged
    table = data[COMPLETIONS_TAG]
    assert step == 10 and list(data) == [COMPLETIONS_TAG]
    assert table.columns == ["prompt", "response", "reward", "acc", "finish"]
    assert table.data == [
        ["What is 2+2?", long_response, 1.0, True, "stop"],
        ["What is 3+3?", "7", -1.0, None, "length"],
    ]


def test_without_wandb_installed_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(
        RuntimeError, match=r"wandb package is not installed \(pip install '\.\[wandb\]'\)"
    ):
        Trackers(wandb_config(tmp_path))


def test_a_restarted_learner_logs_into_the_same_run_and_a_fresh_run_gets_its_own(
    tmp_path: Path, fake_wandb: types.SimpleNamespace
) -> None:
    cfg = wandb_config(tmp_path)
    Trackers(cfg).close()
    Trackers(cfg).close()  # the learner restarted (or the run resumed): same checkpoint store
    first, again = fake_wandb.inits
    assert first["id"] == again["id"] and first["resume"] == "allow"
    other = wandb_config(tmp_path / "other")  # a run with its own checkpoint store
    Trackers(other).close()
    assert fake_wandb.inits[2]["id"] != first["id"]


def test_a_garbled_run_id_file_is_replaced_rather_than_sent_to_wandb(
    tmp_path: Path, fake_wandb: types.SimpleNamespace
) -> None:
    cfg = wandb_config(tmp_path)
    cfg.checkpoint_dir.mkdir(parents=True)
    (cfg.checkpoint_dir / "wandb-run-id").write_text("../../etc\n")
    Trackers(cfg).close()
    [init] = fake_wandb.inits
    assert (
        init["id"].isalnum()
        and init["id"] == (cfg.checkpoint_dir / "wandb-run-id").read_text().strip()
    )
