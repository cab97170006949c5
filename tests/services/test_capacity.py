"""The per-GPU memory budget (`dapo run --dry-run`): parameter counts exact from a config, the
sharded part shrinking with learner ranks, and the shipped presets' verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.config import load_config
from services.cli import main
from services.planning.capacity import ModelShape, budget

REPO = Path(__file__).resolve().parents[2]


def test_parameter_count_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert ModelShape.from_file(tiny_model_dir / "config.json").params == sum(
        p.numel() for p in model.parameters()
    )
    # The published sizes of the presets' models.
    assert ModelShape.from_file(REPO / "configs/models/qwen2.5-7b.json").params == pytest.approx(
        7.62e9, rel=0.01
    )
    assert ModelShape.from_file(REPO / "configs/models/qwen2.5-32b.json").params == pytest.approx(
        32.76e9, rel=0.01
    )


def test_sharded_state_halves_with_twice_the_ranks_and_checkpointing_cuts_activations() -> None:
    shape = ModelShape.from_file(REPO / "configs/models/qwen2.5-7b.json")
    preset = REPO / "configs/dapo-qwen2.5-7b-1node.yaml"
    four, eight = (
        budget(load_config(preset, [f"learner.nproc={n}"]), shape, 80).learner for n in (4, 8)
    )
    for part in ("parameters", "gradients", "optimizer"):
        assert eight[part] == pytest.approx(four[part] / 2)
    plain = budget(
        load_config(preset, ["learner.activation_checkpointing=false"]), shape, 80
    ).learner
    assert plain["activations"] > 10 * four["activations"]


@pytest.mark.parametrize(
    ("preset", "model", "gpus", "gib", "verdict"),
    [
        ("dapo-qwen2.5-7b-1node", "qwen2.5-7b", 8, 80, "fits"),
        ("dapo-qwen2.5-32b", "qwen2.5-32b", 72, 80, "does NOT fit"),
        ("dapo-qwen2.5-32b", "qwen2.5-32b", 72, 141, "fits"),
    ],
)
def test_dry_run_prints_the_presets_budget(
    preset: str, model: str, gpus: int, gib: int, verdict: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "run",
        "--config",
        str(REPO / "configs" / f"{preset}.yaml"),
        "--dry-run",
        "--gpus",
        str(gpus),
        "--model-config",
        str(REPO / "configs" / "models" / f"{model}.json"),
        "--gpu-memory-gib",
        str(gib),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "learner, per GPU:" in out and "KV cache holds" in out
    assert out.strip().endswith(f"on {gib} GiB GPUs this {verdict}")
