"""The FSDP2 trainer on one gloo rank: parameters change in the right direction, and the update
does not depend on how rows are cut into micro-batches (docs/algorithm.md s5)."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch

from contracts.config import ConfigError, DapoConfig, load_config
from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.batch import PACKED_ATTENTION, build_batch
from learner.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module", autouse=True)
def process_group(one_rank_group: None) -> None:
    """Every test here builds a trainer: one gloo rank for the module."""


def make_groups(
    n_groups: int, group_size: int, seed: int = 0, version: int = 0
) -> list[ScoredGroup]:
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        job = PromptJob(
            group_id=f"g{g}",
            prompt_index=g,
            prompt_ids=[rng.randrange(3, 200) for _ in range(rng.randint(4, 9))],
            ground_truth="1",
            issued_version=version,
            issued_at=0.0,
        )
        responses = []
        for _ in range(group_size):
            n = rng.randint(1, 7)
            responses.append(
                Response(
                    token_ids=[rng.randrange(3, 200) for _ in range(n)],
                    logprobs=[-1.0] * n,
                    finish_reason="stop",
                )
            )
        rewards = [rng.choice([1.0, -1.0]) for _ in range(group_size)]
        rewards[0], rewards[1] = 1.0, -1.0
        groups.append(
            ScoredGroup(
                job=job,
                policy_version=version,
                replica_id="r",
                responses=responses,
                scores=rewards,
                acc=[r > 0 for r in rewards],
                rewards=rewards,
                preds=[""] * group_size,
            )
        )
    return groups


def config(model_dir: Path, *overrides: str) -> DapoConfig:
    return load_config(
        CONFIG,
        [
            f"model.path={model_dir}",
            "learner.lr=1e-3",
            "learner.warmup_steps=0",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=2",
            *overrides,
        ],
    )


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_full_params()}


def record_gradients(trainer: Trainer) -> list[torch.Tensor]:
    """The flattened gradient of every optimizer step (after clipping), recorded as it steps."""
    seen: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        seen.append(torch.cat([p.grad.full_tensor().flatten() for p in trainer.trainable]))
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


def test_train_step_changes_parameters_and_raises_good_responses(tiny_model_dir: Path) -> None:
    cfg = config(tiny_model_dir)
    trainer = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    batch = build_batch(make_groups(4, 4), pad_id=0)
    before = params(trainer)
    with torch.no_grad():
        logp0, _ = trainer._forward(batch, entropy=False)
    metrics = trainer.train_step(batch, policy_version=0)
    after = params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert metrics["actor/updates"] == 2.0 and metrics["actor/grad_norm"] > 0
    with torch.no_grad():
        logp1, _ = trainer._forward(batch, entropy=False)
    # Policy gradient: mean log-prob of positive-advantage responses rises
    # relative to negative ones.
    delta = ((logp1 - logp0) * batch.response_mask).sum(-1) / batch.response_mask.sum(-1)
    assert float((delta * batch.advantages).sum()) > 0


def test_update_is_invariant_to_micro_batch_size(tiny_model_dir: Path) -> None:
    batch = build_batch(make_groups(4, 4, seed=1), pad_id=0)
    results = []
    for mbs in (3, 64):
        torch.manual_seed(0)
        trainer = Trainer(
            config(tiny_model_dir, f"learner.micro_batch_size={mbs}"),
            rank=0,
            world_size=1,
            backend="gloo",
        )
        trainer.rng = random.Random(0)
        trainer.train_step(batch, policy_version=0)
        results.append(params(trainer))
    for other in results[1:]:
        for name, tensor in results[0].items():
            torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=1e-5)


def test_sharing_prompts_takes_the_same_step(tiny_model_dir: Path) -> None:
    """One row per group (prompt computed once) or one row per response, with micro-batches that
    split the groups differently: the same update; and auto picks the packed layout for these
    prompt-heavy groups."""
    batch = build_batch(make_groups(4, 4, seed=2), pad_id=0)
    results = []
    for share, mbs in (("never", 3), ("always", 8), ("always", 64), ("auto", 64)):
        torch.manual_seed(0)
        trainer = Trainer(
            config(
                tiny_model_dir, f"learner.share_prompts={share}", f"learner.micro_batch_size={mbs}"
            ),
            rank=0,
            world_size=1,
            backend="gloo",
        )
        trainer.rng = random.Random(0)
        metrics = trainer.train_step(batch, policy_version=0)
        assert trainer.share_prompts == (share != "never")
        results.append((params(trainer), metrics))
    for other, metrics in results[1:]:
        for name, tensor in results[0][0].items():
            # AdamW moves each element by about lr (1e-3) whatever its gradient's size, so an
            # element whose gradient is near zero turns float-rounding differences between the
            # layouts into update differences of a few percent of lr (1.4e-5 seen): the bound is
            # 5% of one step, far below what a wrong layout gives (a whole step, 1e-3).
            torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=5e-5)
        assert metrics["actor/pg_loss"] == pytest.approx(
            results[0][1]["actor/pg_loss"], rel=1e-4, abs=1e-6
        )


def test_packed_responses_give_the_row_layouts_log_probs_loss_and_gradients(
    tiny_model_dir: Path,
) -> None:
    """Responses of 1-7 tokens after prompts of 4-9, packed back to back behind their group's
    prompt (no padding between them) or one row per response, prompt and response padded: the
    same per-token log-probs and entropy, and one update with off-policy rows (so the importance
    weight enters the loss) and an entropy bonus gives the same loss, metrics and gradient."""
    batch = build_batch(make_groups(4, 4, seed=6), pad_id=0)
    batch.behaviour_log_prob = batch.response_mask * -2.0
    runs = []
    for share in ("never", "always"):
        torch.manual_seed(0)
        trainer = Trainer(
            config(
                tiny_model_dir,
                f"learner.share_prompts={share}",
                "algorithm.mini_batch_groups=4",
                "algorithm.entropy_coef=0.01",
            ),
            rank=0,
            world_size=1,
            backend="gloo",
        )
        trainer.model.eval()
        with torch.no_grad():
            logp, ent = trainer._forward(batch, entropy=True)
        grads = record_gradients(trainer)
        metrics = trainer.train_step(batch, policy_version=1)
        assert trainer.share_prompts == (share == "always")
        runs.append((logp, ent, metrics, grads[0]))
    (logp, ent, metrics, grad), (p_logp, p_ent, p_metrics, p_grad) = runs
    mask = batch.response_mask.bool()
    torch.testing.assert_close(p_logp[mask], logp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_ent[mask], ent[mask], rtol=1e-5, atol=1e-5)
    assert float(logp[mask].abs().min()) > 0  # every real token was scored
    assert metrics["actor/off_policy_frac"] == 1.0
    for key in ("actor/pg_loss", "actor/entropy", "actor/is_weight_mean", "actor/grad_norm"):
        assert p_metrics[key] == pytest.approx(metrics[key], rel=1e-4), key
    torch.testing.assert_close(p_grad, grad, rtol=1e-4, atol=1e-6)


def test_build_batch_layout_and_advantages() -> None:
    groups = make_groups(2, 3)
    batch = build_batch(groups, pad_id=0)
    assert len(batch) == 6
    P = batch.prompt_len
    for b, (g, r) in enumerate((grp, r) for grp in groups for r in grp.responses):
        n = len(r.token_ids)
        assert batch.responses[b, :n].tolist() == r.token_ids
        assert batch.input_ids[b, P - len(g.job.prompt_ids) : P].tolist() == g.job.prompt_ids
        assert batch.response_mask[b].sum() == n
        assert (
            batch.token_rewards[b, n - 1] == g.rewards[g.responses.index(r)]
        )  # reward on the last token
    for gi in range(2):
        rows = batch.group_index == gi
        assert abs(float(batch.advantages[rows].sum())) < 1e-5  # group-normalised


def test_activation_checkpointing_recomputes_without_changing_the_update(
    tiny_model_dir: Path,
) -> None:
    batch = build_batch(make_groups(4, 4, seed=2), pad_id=0)
    results = []
    for checkpointing in (False, True):
        trainer = Trainer(
            config(tiny_model_dir, f"learner.activation_checkpointing={checkpointing}"),
            rank=0,
            world_size=1,
            backend="gloo",
        )
        assert trainer.model.is_gradient_checkpointing == checkpointing
        metrics = trainer.train_step(batch, policy_version=0)
        results.append((metrics, params(trainer)))
    (m0, p0), (m1, p1) = results
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-5)
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-4)
    for name, tensor in p0.items():
        torch.testing.assert_close(p1[name], tensor, rtol=1e-4, atol=1e-6)


# --- the attention the packed layout needs -------------------------------------------------
def model_dir_with(tiny_model_dir: Path, out: Path, **config: object) -> Path:
    """A copy of the tiny model whose config.json also holds `config`."""
    shutil.copytree(tiny_model_dir, out)
    stored = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(stored | config))
    return out


@pytest.mark.parametrize("asks_for", [None, "eager"], ids=["as-saved", "config-asks-for-eager"])
def test_packed_and_row_layouts_give_the_same_log_probs_under_the_trainers_attention(
    tiny_model_dir: Path, tmp_path: Path, asks_for: str | None
) -> None:
    """The trainer's own model and forward passes: one row per group and one row per response score
    every response alike, also when the model's config.json asks for eager attention (under which
    the packed mask gives log-probs up to 0.3 away)."""
    extra = {} if asks_for is None else {"attn_implementation": asks_for}
    model = model_dir_with(tiny_model_dir, tmp_path / "model", **extra)
    trainer = Trainer(config(model), rank=0, world_size=1, backend="gloo")
    batch = build_batch(make_groups(3, 4, seed=3), pad_id=0)
    trainer.model.eval()
    with torch.no_grad():
        layouts = []
        for share in (False, True):
            trainer.share_prompts = share
            layouts.append(trainer._forward(batch, entropy=False)[0])
    mask = batch.response_mask.bool()
    torch.testing.assert_close(layouts[1][mask], layouts[0][mask], rtol=1e-5, atol=1e-5)
    assert trainer.model.config._attn_implementation == PACKED_ATTENTION
    assert trainer.packing_problem is None


def test_a_sliding_window_model_keeps_to_rows_under_auto_and_is_refused_under_always(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The packed mask would lose the window: `auto` runs one row per response (logged), even for
    the prompt-heavy groups it would otherwise pack; `always` stops at start naming the setting."""
    model = model_dir_with(
        tiny_model_dir,
        tmp_path / "model",
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        layer_types=["sliding_attention"] * 4,
    )
    with caplog.at_level(logging.WARNING, logger="learner.trainer"):
        trainer = Trainer(
            config(model, "learner.share_prompts=auto"), rank=0, world_size=1, backend="gloo"
        )
    assert trainer.packing_problem is not None and "sliding_attention" in trainer.packing_problem
    assert "one row per response" in caplog.text
    trainer.train_step(build_batch(make_groups(4, 4, seed=2), pad_id=0), policy_version=0)
    assert not trainer.share_prompts  # the same groups packed under full attention (above)
    with pytest.raises(ConfigError, match=r"learner\.share_prompts=always cannot be honoured"):
        Trainer(config(model, "learner.share_prompts=always"), rank=0, world_size=1, backend="gloo")


def test_importance_weight_metrics_cover_off_policy_tokens_only(tiny_model_dir: Path) -> None:
    """Groups 0-1 were generated one version back, 2-3 by the policy being trained: the weight's
    mean and truncated share are over the off-policy tokens, and a synchronous step has none."""
    trainer = Trainer(config(tiny_model_dir), rank=0, world_size=1, backend="gloo")
    batch = build_batch(make_groups(4, 4, seed=4), pad_id=0)
    first = batch.group_index == 0
    batch.policy_version = (batch.group_index >= 2).long()  # (B,): groups 0-1 at version 0
    # pi_old / pi_behaviour: about e^15 on group 0 (truncated at is_clip = 2), about e^-5 on 1.
    batch.behaviour_log_prob = torch.where(first.unsqueeze(-1), -20.0, 0.0).expand_as(
        batch.behaviour_log_prob
    )
    with torch.no_grad():
        trainer.model.eval()
        old, _ = trainer._forward(batch, entropy=False)  # the weights the batch arrives to
    off = batch.response_mask * (batch.policy_version == 0).unsqueeze(-1)  # (B, R)
    weight = (old - batch.behaviour_log_prob).exp().clamp(max=2.0)
    metrics = trainer.train_step(batch, policy_version=1)
    assert metrics["actor/is_weight_mean"] == pytest.approx(
        float((weight * off).sum() / off.sum()), rel=1e-4
    )
    truncated = batch.response_mask[first].sum()
    assert metrics["actor/is_clipfrac"] == pytest.approx(float(truncated / off.sum()))
    assert metrics["actor/off_policy_frac"] == pytest.approx(
        float(off.sum() / batch.response_mask.sum())
    )
    synchronous = trainer.train_step(batch, policy_version=0)  # every row on-policy
    assert synchronous["actor/off_policy_frac"] == 0.0
    assert not {"actor/is_weight_mean", "actor/is_clipfrac"} & set(synchronous)


def test_tool_tokens_do_not_lengthen_the_seq_mean_token_sum_norm_constant(
    tiny_model_dir: Path,
) -> None:
    """L_norm counts model tokens: a tool result appended to one response (masked, and after
    every model token, so no log-prob changes) leaves the Dr.GRPO step as it was."""
    plain = make_groups(4, 4, seed=5)
    with_tool = make_groups(4, 4, seed=5)
    r = with_tool[0].responses[0]
    n = len(r.token_ids)
    with_tool[0].responses[0] = Response(
        token_ids=[*r.token_ids, *[7] * 20],
        logprobs=[*r.logprobs, *[0.0] * 20],
        finish_reason="stop",
        tool_spans=[(n, n + 20)],
    )
    results = []
    for groups in (plain, with_tool):
        batch = build_batch(groups, pad_id=0)
        torch.manual_seed(0)
        trainer = Trainer(
            config(
                tiny_model_dir,
                "algorithm.loss_agg=seq-mean-token-sum-norm",
                "learner.share_prompts=never",
            ),
            rank=0,
            world_size=1,
            backend="gloo",
        )
        trainer.rng = random.Random(0)
        results.append((batch, trainer.train_step(batch, policy_version=0)))
    (short, m_plain), (long, m_tool) = results
    assert long.responses.shape[1] > short.responses.shape[1]
    assert long.model_len == short.model_len == short.responses.shape[1]
    # The loss and its gradient are divided by L_norm (AdamW's step barely shows a scale).
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert m_tool[key] == pytest.approx(m_plain[key], rel=1e-4)
