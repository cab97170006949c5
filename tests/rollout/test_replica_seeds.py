"""Every replica samples with a seed of its own, derived from `rollout.seed` and its replica id:
two replicas given the same prompt do not generate the same responses, and a replica id always
maps to the same seed, in any process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.config import DapoConfig, build_config
from rollout.engine import REPLICA_NAME_ENV, make_engine, replica_seed, seed_name

REPO = Path(__file__).resolve().parents[2]


def _config(model_dir: Path, seed: int = 0) -> DapoConfig:
    return build_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {"engine": "transformers", "seed": seed},
        }
    )


def test_replica_seeds_differ_by_id_and_config_seed_and_are_stable_across_processes() -> None:
    a, b = replica_seed(0, "rollout-host-1"), replica_seed(0, "rollout-host-2")
    assert a != b and replica_seed(1, "rollout-host-1") != a
    assert replica_seed(0, "rollout-host-1") == a and 0 <= a < 2**31
    code = "from rollout.engine import replica_seed; print(replica_seed(0, 'rollout-host-1'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashes differ from this process's
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert int(out.stdout) == a


def test_replicas_given_the_same_prompt_sample_different_tokens(tiny_model_dir: Path) -> None:
    cfg = _config(tiny_model_dir)

    def sample(replica_id: str) -> list[list[int]]:
        engine = make_engine(cfg, replica_id=replica_id)
        [group] = engine.generate([[5, 6, 7, 8]], n=2, max_tokens=8, temperature=1.0, top_p=1.0)
        return [s.token_ids for s in group]

    first = sample("rollout-host-1")
    assert sample("rollout-host-2") != first
    assert sample("rollout-host-1") == first  # the same replica id: the same seed


def test_a_restarted_replica_keeps_its_seed_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dapo run` names each replica (`rollout-0`...): the seed derives from that name, not from
    the instance id, which holds the process id and changes on a restart."""
    monkeypatch.setenv(REPLICA_NAME_ENV, "rollout-0")
    assert seed_name("rollout-host-111") == seed_name("rollout-host-222") == "rollout-0"
    monkeypatch.delenv(REPLICA_NAME_ENV)
    assert seed_name("rollout-host-111") == "rollout-host-111"
