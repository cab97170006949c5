"""The config tree: presets load, overrides apply, and every invalid input names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.config import ConfigError, build_config, dump_config, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MINIMAL = {"model": {"path": "m"}, "data": {"train_path": "t.parquet"}}


@pytest.mark.parametrize(
    "name",
    [
        "tiny.yaml",
        "tiny-epochs.yaml",
        "smollm2-135m.yaml",
        "smollm2-135m-gym.yaml",
        "dapo-qwen2.5-32b.yaml",
        "dapo-qwen2.5-7b-1node.yaml",
        "dapo-qwen2.5-32b-lora.yaml",
        "dapo-qwen2.5-7b-1node-lora.yaml",
    ],
)
def test_presets_load(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert load_config(CONFIGS / name) == cfg
    assert build_config(__import__("yaml").safe_load(dump_config(cfg))) == cfg


def test_real_model_preset_keeps_the_papers_algorithm() -> None:
    """configs/smollm2-135m.yaml departs from the paper in sizes only (each commented there)."""
    cfg = load_config(CONFIGS / "smollm2-135m.yaml")
    a, ro = cfg.algorithm, cfg.rollout
    assert cfg.model.catalog_name == "smollm2-135m-instruct"
    assert (a.clip_low, a.clip_high, a.clip_c, a.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
    assert a.gatekeeper and a.gatekeeper_metric == "acc" and a.entropy_coef == 0.0
    assert cfg.reward.overlong.enabled and (ro.temperature, ro.top_p) == (1.0, 1.0)
    # The model as a completer: few-shot text, no chat template, the answer ends at the newline
    assert cfg.data.synth is not None and cfg.data.synth.template == "few-shot"
    assert cfg.data.prompt_format == "completion" and ro.stop == ("\n",)
    assert cfg.data.synth.num_eval >= 400 and cfg.eval.max_problems is None  # 400 held out


def test_paper_preset_has_paper_values() -> None:
    cfg = load_config(CONFIGS / "dapo-qwen2.5-32b.yaml")
    a, ro, le = cfg.algorithm, cfg.rollout, cfg.learner
    assert (a.clip_low, a.clip_high, a.clip_c, a.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
    assert (a.train_batch_groups, ro.group_size, a.mini_batch_groups) == (512, 16, 32)
    assert a.train_batch_groups * ro.group_size // (a.mini_batch_groups * ro.group_size) == 16
    assert (le.lr, le.weight_decay, le.grad_clip, le.warmup_steps) == (1e-6, 0.1, 1.0, 20)
    assert (cfg.data.max_prompt_len, ro.max_response_len, cfg.reward.overlong.buffer_len) == (
        2048,
        20480,
        4096,
    )
    assert (ro.temperature, ro.top_p) == (1.0, 1.0)
    assert (cfg.eval.samples_per_problem, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)
    assert a.gatekeeper and a.gatekeeper_metric == "acc" and a.oversampling == 3.0
    assert a.entropy_coef == 0.0
    assert not hasattr(a, "kl_coef")  # DAPO has no KL term; the key is an unknown-key error


@pytest.mark.parametrize(
    ("lora", "full"),
    [
        ("dapo-qwen2.5-32b-lora.yaml", "dapo-qwen2.5-32b.yaml"),
        ("dapo-qwen2.5-7b-1node-lora.yaml", "dapo-qwen2.5-7b-1node.yaml"),
    ],
)
def test_lora_presets_are_their_full_presets_with_adapters(lora: str, full: str) -> None:
    """`extends` lays the LoRA lines over the full preset; the algorithm stays the paper's."""
    adapted, base = load_config(CONFIGS / lora), load_config(CONFIGS / full)
    assert adapted.learner.lora.enabled and not base.learner.lora.enabled
    assert adapted.learner.lr == pytest.approx(10 * base.learner.lr)
    assert adapted.algorithm == base.algorithm and adapted.reward == base.reward
    assert adapted.data == base.data and adapted.model == base.model
    assert adapted.run_name != base.run_name


def test_extends_overlays_section_by_section_and_refuses_loops(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "model: {path: m, dtype: bfloat16}\ndata: {train_path: t.parquet}\n"
        "learner: {lr: 1.0e-6, total_steps: 5}\n"
    )
    (tmp_path / "top.yaml").write_text("extends: base.yaml\nlearner: {lr: 1.0e-5}\n")
    cfg = load_config(tmp_path / "top.yaml", ["learner.total_steps=7"])
    assert (cfg.learner.lr, cfg.learner.total_steps, cfg.model.dtype) == (1e-5, 7, "bfloat16")
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="goes round"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="lm_head"):
        build_config(MINIMAL, ["learner.lora.target_modules=[q_proj, lm_head]"])


def test_dotted_overrides_parse_yaml_values() -> None:
    cfg = build_config(
        MINIMAL, ["algorithm.clip_high=0.3", "algorithm.clip_c=null", "rollout.engine=transformers"]
    )
    assert cfg.algorithm.clip_high == 0.3
    assert cfg.algorithm.clip_c is None
    assert cfg.rollout.engine == "transformers"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algorithm.clip_high=0.1"], "algorithm.clip_high=0.1 < algorithm.clip_low=0.2"),
        (["rollout.group_size=1"], "rollout.group_size=1"),
        (
            ["rollout.max_response_len=100", "reward.overlong.buffer_len=200"],
            "reward.overlong.buffer_len=200 must be < rollout.max_response_len=100",
        ),
        (["algorithm.loss_agg=mean"], "algorithm.loss_agg='mean'"),
        (["algorithm.clip_lwo=0.1"], "algorithm.clip_lwo=0.1: unknown key"),
        (["learner.lr=-1"], "learner.lr=-1"),
        (["learner.lr=abc"], "learner.lr='abc'"),
        (["algorithm.clip_c=0.5"], "algorithm.clip_c=0.5"),
        (["algorithm.mini_batch_groups=3", "algorithm.train_batch_groups=8"], "must be a multiple"),
        (["nosuch=1"], "nosuch=1: unknown key"),
        (["algorithm=3"], "algorithm=3"),
        (["novalue"], "expected dotted.key=value"),
        (
            ["algorithm.prompt_skip.hard_keep_base=0.97"],
            "hard_keep_base=0.97 is outside [keep_base_min, keep_base_max] = [0.05, 0.95]",
        ),
        (
            ["algorithm.prompt_skip.keep_base_min=0.6", "algorithm.prompt_skip.keep_base_max=0.4"],
            "keep_base_min=0.6 > keep_base_max=0.4",
        ),
        (["algorithm.pass_rate_window=0"], "algorithm.pass_rate_window=0"),
    ],
)
def test_invalid_values_name_key_value_and_reason(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(MINIMAL, overrides)
    assert expected in str(err.value)


def test_prompt_skipping_without_the_gatekeeper_is_refused_naming_both_and_why() -> None:
    with pytest.raises(ConfigError) as err:
        build_config(MINIMAL, ["algorithm.gatekeeper=false", "algorithm.prompt_skip.enabled=true"])
    message = str(err.value)
    assert "algorithm.prompt_skip.enabled=true needs algorithm.gatekeeper=true" in message
    assert "GRPO rungs of the ablation ladder" in message
    assert "partial dynamic sampling" in message
    # Either alone is a valid run: GRPO without skipping, DAPO with it.
    assert not build_config(MINIMAL, ["algorithm.gatekeeper=false"]).algorithm.gatekeeper
    skipping = build_config(MINIMAL, ["algorithm.prompt_skip.enabled=true"])
    assert skipping.algorithm.gatekeeper and skipping.algorithm.prompt_skip.enabled


def test_missing_required_section_is_named() -> None:
    with pytest.raises(ConfigError, match="data"):
        build_config({"model": {"path": "m"}})


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_redis_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://example:1/0")
    assert build_config(MINIMAL).redis_url == "redis://example:1/0"
    assert build_config(MINIMAL, ["queue.redis_url=redis://x:2/0"]).redis_url == "redis://x:2/0"
