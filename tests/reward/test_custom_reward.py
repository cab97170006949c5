"""`reward.function`: loading by module and by file, refusal at start, and misbehaving functions.

The functions live in ``sample_rewards.py`` (and ``broken_on_import.py``) next to this file.
The sandbox tests start real worker processes, as the reward service does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.config import ConfigError, DapoConfig, RewardConfig, load_config
from reward import RewardFunctionError, SandboxPool, VerifyResult, make_scorer
from reward.checking import Outcome
from reward.custom import load_reward_function, validate_output
from reward.service import MetricMeans, check_reward_function, open_scorer, score_group
from tests.reward.sample_rewards import RIGHT_SCORE, WRONG_SCORE, answer_digit
from tests.reward.test_score_group import CharTokenizer, group_of

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SAMPLES = HERE / "sample_rewards.py"
MODULE = "tests.reward.sample_rewards"
TIMEOUT_S = 0.5


def file_ref(name: str) -> str:
    return f"{SAMPLES}:{name}"


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    """Workers running ``answer_digit`` by file path."""
    scorer = make_scorer("dapo", timeout_s=TIMEOUT_S, workers=1, function=file_ref("answer_digit"))
    assert isinstance(scorer, SandboxPool)
    with scorer:
        scorer.wait_ready()
        yield scorer


def one_item_pool(function: str) -> SandboxPool:
    scorer = make_scorer("dapo", timeout_s=TIMEOUT_S, workers=1, function=function)
    assert isinstance(scorer, SandboxPool)
    return scorer


# -- loading --


@pytest.mark.parametrize("setting", [f"{MODULE}:answer_digit", file_ref("answer_digit")])
def test_loads_by_module_and_by_file(setting: str) -> None:
    function = load_reward_function(setting)
    assert function("the sum is 42", "42", {}) == answer_digit("the sum is 42", "42", {})
    assert function("no", "42", {}) == answer_digit("no", "42", {})


def test_a_relative_file_path_is_read_from_the_working_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    function = load_reward_function("tests/reward/sample_rewards.py:answer_digit")
    assert function("7", "17", {}).acc  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("no_colon_here", "expected 'package.module:function' or 'path/to/file.py:function'"),
        ("module:", "expected 'package.module:function' or 'path/to/file.py:function'"),
        (":function", "expected 'package.module:function' or 'path/to/file.py:function'"),
        ("module:not-a-name", "'not-a-name' after the ':' is not a Python name"),
        ("my module:f", "'my module' is neither a module name nor a .py file"),
    ],
)
def test_a_malformed_setting_fails_before_any_process(setting: str, problem: str) -> None:
    with pytest.raises(RewardFunctionError) as caught:
        make_scorer("dapo", function=setting)
    assert str(caught.value) == f"reward.function={setting!r}: {problem}"


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        (
            "no_such_reward_module:f",
            "module 'no_such_reward_module' not found (is it installed, or on PYTHONPATH?)",
        ),
        ("tests.reward.no_such_file:f", "module 'tests.reward.no_such_file' not found"),
        ("missing/rewards.py:f", "file missing/rewards.py not found"),
        (f"{MODULE}:no_such_function", f"{MODULE} has no attribute 'no_such_function'"),
        (f"{MODULE}:NOT_CALLABLE", "NOT_CALLABLE is a int, not a function"),
        (
            f"{MODULE}:two_arguments",
            "two_arguments(response: 'str', ground_truth: 'str') -> 'RewardOutput' cannot be "
            "called as f(response, ground_truth, extra_info)",
        ),
        (f"{MODULE}:asynchronous", "asynchronous is async; it must be a plain function"),
        (
            "tests.reward.broken_on_import:f",
            "importing tests.reward.broken_on_import raised RuntimeError: this module needs a GPU",
        ),
        (
            f"{HERE / 'broken_on_import.py'}:f",
            "raised RuntimeError: this module needs a GPU",
        ),
    ],
)
def test_a_setting_that_cannot_be_used_names_the_setting(setting: str, problem: str) -> None:
    with pytest.raises(RewardFunctionError) as caught:
        load_reward_function(setting)
    message = str(caught.value)
    assert message.startswith(f"reward.function={setting!r}: ")
    assert problem in message


def test_the_service_refuses_at_start_naming_the_setting() -> None:
    # Loaded in a sandbox worker, as the reward service and `dapo run` do.
    setting = f"{MODULE}:two_arguments"
    start = time.monotonic()
    with pytest.raises(
        ConfigError, match=re.escape(f"reward.function={setting!r}: two_arguments(")
    ):
        open_scorer(RewardConfig(function=setting, sandbox_workers=1))
    assert time.monotonic() - start < 30.0


def test_the_run_preflight_loads_the_function_once(tmp_path: Path) -> None:
    good = load_config(REPO / "configs" / "tiny.yaml", [f"reward.function={MODULE}:answer_digit"])
    check_reward_function(good)  # no error
    bad = good.model_copy(
        update={"reward": good.reward.model_copy(update={"function": "nope_mod:f"})}
    )
    with pytest.raises(
        ConfigError, match=re.escape("reward.function='nope_mod:f': module 'nope_mod' not found")
    ):
        check_reward_function(bad)


def test_dapo_run_fails_fast_naming_reward_function(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            "configs/tiny.yaml",
            "--output-dir",
            str(tmp_path),
            "reward.function=tests/reward/sample_rewards.py:no_such_function",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "reward.function='tests/reward/sample_rewards.py:no_such_function': "
        "tests/reward/sample_rewards.py has no attribute 'no_such_function'"
    ) in proc.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_the_config_checks_the_form_only() -> None:
    with pytest.raises(ConfigError, match=re.escape("reward.function='nocolon': expected")):
        load_config(REPO / "configs" / "tiny.yaml", ["reward.function=nocolon"])
    # A well-formed setting naming nothing is the reward service's to refuse, not the config's.
    assert (
        load_config(REPO / "configs" / "tiny.yaml", ["reward.function=x.y:z"]).reward.function
        == "x.y:z"
    )


# -- return values --


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("yes", "returned str, expected a RewardOutput or a dict with 'score' and 'acc'"),
        (1.0, "returned float, expected a RewardOutput"),
        ({"score": 1.0}, "missing keys ['acc']"),
        ({"score": 1.0, "acc": True, "bonus": 2}, "unknown keys ['bonus']"),
        ({"score": "1", "acc": True}, "score must be a number, got str"),
        ({"score": True, "acc": True}, "score must be a number, got bool"),
        ({"score": float("inf"), "acc": True}, "score must be finite, got inf"),
        ({"score": 1.0, "acc": 1}, "acc must be a bool, got int"),
        ({"score": 1.0, "acc": True, "pred": 5}, "pred must be a string, got int"),
        ({"score": 1.0, "acc": True, "metrics": [1]}, "metrics must be a dict, got list"),
        (
            {"score": 1.0, "acc": True, "metrics": {"m": float("nan")}},
            "metrics['m'] must be finite",
        ),
        (
            {"score": 1.0, "acc": True, "metrics": {f"m{i}": 1 for i in range(17)}},
            "over MAX_METRICS=16",
        ),
    ],
)
def test_invalid_return_values_are_refused(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        validate_output(value)


def test_valid_return_values() -> None:
    assert validate_output({"score": 2, "acc": False}) == Outcome(acc=False, pred="", score=2.0)
    long_pred = validate_output({"score": 0.0, "acc": True, "pred": "p\x00" * 500})
    assert long_pred.pred == "p" * 100  # cut to 200 characters, then cleaned
    assert validate_output(answer_digit("42", "2", {})) == Outcome(
        acc=True,
        pred="2",
        score=RIGHT_SCORE,
        metrics={"response_chars": 2.0, "has_expression": 0.0},
    )


# -- in the sandbox --


def test_scores_come_from_the_function(pool: SandboxPool) -> None:
    results = pool.verify_many([("I think 12", "2"), ("no digits", "2"), ("Answer: 5", 15)])
    assert [(r.score, r.acc, r.pred) for r in results] == [
        (RIGHT_SCORE, True, "2"),
        (WRONG_SCORE, False, ""),
        (RIGHT_SCORE, True, "5"),
    ]
    assert results[0].metrics == {"response_chars": 10.0, "has_expression": 0.0}
    with_row = pool.verify("12", "2", {"expression": "1 + 1"})
    assert with_row.metrics == {"response_chars": 2.0, "has_expression": 1.0}


def test_the_whole_response_reaches_the_function(pool: SandboxPool) -> None:
    # The built-in verifiers read 300 characters; a reward.function gets all of it, cleaned.
    result = pool.verify("7" + "x" * 5000 + "\x00", "7")
    assert result.acc and result.metrics["response_chars"] == 5001.0


def test_extra_info_reaches_the_function() -> None:
    with one_item_pool(f"{MODULE}:weighted_by_extra_info") as scorer:
        results = scorer.score_many([("42", "42"), ("41", "42")], [{"weight": 3}, {"weight": 3}])
        assert [(r.score, r.acc) for r in results] == [(3.0, True), (0.0, False)]
        assert scorer.score_many([("42", "42")])[0].score == 0.0  # no extra_info: {}
        with pytest.raises(ValueError, match="1 extra_info mappings for 2 pairs"):
            scorer.score_many([("a", "1"), ("b", "2")], [{}])


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("raises", "reward.function: raised ValueError: cannot score 'x'"),
        (
            "returns_text",
            "reward.function: invalid return value: returned str, expected a RewardOutput or "
            "a dict with 'score' and 'acc'",
        ),
        ("returns_nan", "reward.function: invalid return value: score must be finite, got nan"),
        (
            "returns_unknown_key",
            "reward.function: invalid return value: unknown keys ['bonus'] "
            "(allowed: ['acc', 'metrics', 'pred', 'score'])",
        ),
        ("returns_int_acc", "reward.function: invalid return value: acc must be a bool, got int"),
        ("exits", "the reward.function worker died while checking this item (exit code 3)"),
    ],
)
def test_a_misbehaving_function_is_an_error_with_its_reason(name: str, reason: str) -> None:
    with one_item_pool(f"{MODULE}:{name}") as scorer:
        start = time.monotonic()
        result = scorer.verify("x", "1")
        assert time.monotonic() - start < 30.0
        assert result == VerifyResult(-1.0, False, "[ERROR]", reason=reason)
        assert scorer.errors == 1


def test_a_hanging_function_times_out_and_the_next_item_is_scored() -> None:
    with one_item_pool(f"{MODULE}:hangs") as scorer:
        scorer.wait_ready()
        start = time.monotonic()
        results = scorer.score_many([("hang", "1"), ("fine", "1")])
        elapsed = time.monotonic() - start
    assert results[0] == VerifyResult(
        -1.0,
        False,
        "[TIMEOUT]",
        timeout=True,
        reason="reward.function ran past the 0.5 s timeout",
    )
    assert results[1] == VerifyResult(1.0, True, "")
    assert elapsed < TIMEOUT_S + 10.0  # the kill, plus a replacement worker's start
    assert scorer.timeouts == 1


# -- in the reward worker --


def test_score_group_shapes_the_function_score(pool: SandboxPool) -> None:
    cfg: DapoConfig = load_config(REPO / "configs" / "tiny.yaml")  # overlong: 4-token buffer of 16
    group = group_of("42", ["it is 42", "it is 41", "2" * 16])
    scored, results = score_group(group, CharTokenizer(), pool, cfg)
    assert scored.scores == [RIGHT_SCORE, WRONG_SCORE, RIGHT_SCORE]
    assert scored.acc == [True, False, True]
    # 16 tokens is the whole budget: the full overlong penalty (-1) is added to the score.
    assert scored.rewards == [RIGHT_SCORE, WRONG_SCORE, RIGHT_SCORE - 1.0]
    means = MetricMeans()
    means.add(results)
    assert means.means() == {"has_expression": 0.0, "response_chars": (8 + 8 + 16) / 3}


def test_score_group_hands_the_job_extra_info_to_the_function() -> None:
    cfg: DapoConfig = load_config(REPO / "configs" / "tiny.yaml")
    group = group_of("42", ["42", "41"])
    group.job.extra_info = {"weight": 2.5}
    with one_item_pool(f"{MODULE}:weighted_by_extra_info") as scorer:
        scored, _ = score_group(group, CharTokenizer(), scorer, cfg)
    assert (scored.scores, scored.acc) == ([2.5, 0.0], [True, False])


# -- a hostile function is contained --


def test_a_pickle_written_on_the_pipe_is_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("DAPO_PWNED_MARKER", str(marker))
    # A roomy limit: the frame must be read as malformed, not outlived by a loaded machine.
    scorer = make_scorer("dapo", timeout_s=10.0, workers=1, function=f"{MODULE}:sends_a_pickle")
    assert isinstance(scorer, SandboxPool)
    with scorer:
        result = scorer.verify("x", "1")
    assert result.pred == "[ERROR]" and "sent a bad reply" in (result.reason or "")
    assert not marker.exists()


def test_half_a_message_times_out_instead_of_blocking_the_service() -> None:
    with one_item_pool(f"{MODULE}:sends_half_a_message") as scorer:
        scorer.wait_ready()
        start = time.monotonic()
        result = scorer.verify("x", "1")
        assert time.monotonic() - start < TIMEOUT_S + 10.0
    assert result.timeout and scorer.timeouts == 1


def test_a_function_cannot_fork_or_read_the_services_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("WANDB_API_KEY", "w" * 40)
    with one_item_pool(f"{MODULE}:forks") as scorer:
        forked = scorer.verify("x", "1")
    assert "starting processes is not allowed" in (forked.reason or "")
    with one_item_pool(f"{MODULE}:reads_secrets") as scorer:
        secrets = scorer.verify("x", "1")
    assert secrets.acc and secrets.pred == "", secrets
    # Nor reach the run's Redis (a listening port here), even through libc.
    import socket

    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        one_item_pool(f"{MODULE}:connects_to_redis") as scorer,
    ):
        reached = scorer.verify("x", str(server.getsockname()[1]))
    assert not reached.acc and "refused" in reached.pred, reached
