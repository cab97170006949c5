"""GPU placement of `dapo run`: disjoint GPUs for learner ranks and replicas on 1, 2 and 8 GPU
machines, a clear refusal when the config does not fit, and `--dry-run` printing the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.config import load_config
from services.cli import main
from services.planning.placement import PlacementError, plan

REPO = Path(__file__).resolve().parents[2]
SEVEN_B = REPO / "configs" / "dapo-qwen2.5-7b-1node.yaml"
TINY = REPO / "configs" / "tiny.yaml"


def test_eight_gpus_split_between_learner_and_replicas() -> None:
    p = plan(load_config(SEVEN_B), 8)  # 4 learner ranks + 4 replicas, tensor-parallel 1
    assert p.learner == (0, 1, 2, 3)
    assert p.replicas == ((4,), (5,), (6,), (7,))
    assert p.visible_devices("learner") == "0,1,2,3" and p.visible_devices("rollout-2") == "6"
    assert p.visible_devices("reward-0") == "" and p.visible_devices("api") == ""


def test_tensor_parallel_replicas_get_consecutive_gpus() -> None:
    cfg = load_config(
        SEVEN_B, ["learner.nproc=2", "rollout.replicas=3", "rollout.tensor_parallel_size=2"]
    )
    p = plan(cfg, 8)
    assert p.learner == (0, 1) and p.replicas == ((2, 3), (4, 5), (6, 7))


def test_a_config_that_does_not_fit_is_refused_naming_the_numbers() -> None:
    with pytest.raises(PlacementError) as err:
        plan(load_config(SEVEN_B), 2)
    message = str(err.value)
    assert (
        "learner.nproc=4" in message
        and "rollout.replicas=4" in message
        and "= 8 GPUs" in message
        and "has 2" in message
    )


def test_two_gpus_one_learner_one_replica() -> None:
    p = plan(load_config(SEVEN_B, ["learner.nproc=1", "rollout.replicas=1"]), 2)
    assert p.learner == (0,) and p.replicas == ((1,),) and not p.shared


def test_one_gpu_is_shared_only_with_gloo_weights_and_room_for_the_learner() -> None:
    base = ["learner.nproc=1", "rollout.replicas=1"]
    with pytest.raises(PlacementError, match="weights_backend"):
        plan(load_config(SEVEN_B, base), 1)
    p = plan(
        load_config(
            SEVEN_B, [*base, "learner.weights_backend=gloo", "rollout.gpu_memory_utilization=0.4"]
        ),
        1,
    )
    assert p.shared and p.learner == (0,) and p.replicas == ((0,),)


def test_no_gpu_runs_everything_on_the_cpu() -> None:
    p = plan(load_config(TINY), 0)
    assert p.gpus == 0 and p.replicas == ((),)  # the preset's one replica, on no GPU
    with pytest.raises(PlacementError, match="tensor_parallel_size=2 needs GPUs"):
        plan(load_config(TINY, ["rollout.tensor_parallel_size=2"]), 0)


def test_dry_run_prints_the_plan_and_starts_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert (
        main(
            [
                "run",
                "--config",
                str(SEVEN_B),
                "--output-dir",
                str(tmp_path / "out"),
                "--dry-run",
                "--gpus",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "learner (4 ranks): GPUs 0,1,2,3" in out and "rollout-3: GPUs 7" in out
    assert not (tmp_path / "out").exists()
    assert main(["run", "--config", str(SEVEN_B), "--dry-run", "--gpus", "2"]) == 2
    assert "= 8 GPUs" in capsys.readouterr().err
