"""The W&B API key reaches the learner, and only the learner, in docker-compose (from the env
file, optional) and Kubernetes (from an optional Secret): a deployment without W&B starts as
before, and one with it needs no edit of the manifests."""

from __future__ import annotations

import re

import pytest

from tests.deploy.test_manifests import (
    ENV_EXAMPLE,
    OVERLAYS,
    compose,
    containers,
    env_of,
    render,
    workload,
)

LEARNERS = {"learner", "learner-gpu"}


def test_compose_passes_the_optional_key_to_the_learners_only() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if name in LEARNERS:
            assert env["WANDB_API_KEY"] == "${WANDB_API_KEY:-}", name  # optional: empty when unset
        else:
            assert "WANDB_API_KEY" not in env, f"{name} gets the W&B key but logs nothing to W&B"
    example = ENV_EXAMPLE.read_text(encoding="utf-8")
    assert re.search(r"^#WANDB_API_KEY=$", example, flags=re.M), (
        "documented, commented out, no value"
    )


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kubernetes_learner_reads_the_key_from_an_optional_secret(overlay: str) -> None:
    docs = render(overlay)
    [learner] = [
        c for c in containers(workload(docs, "dapo-learner"), init=False) if c["name"] == "learner"
    ]
    assert env_of(learner)["WANDB_API_KEY"] == {
        "secretKeyRef": {"name": "dapo-wandb", "key": "api-key", "optional": True}
    }
    others = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]
    assert others
    for doc in others:
        for c in containers(doc):
            assert "WANDB_API_KEY" not in env_of(c), doc["metadata"]["name"]
    assert not [
        d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "dapo-wandb"
    ]  # never shipped
