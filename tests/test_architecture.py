"""The layers of ARCHITECTURE.md hold: import-linter's contracts pass on the repository and fail
on a deliberately wrong import, nothing outside the contracts touches the raw Redis client, and a
stage is handed the parts of the bus it uses, never the whole of it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sandbox", "contracts", "rollout", "reward", "gatekeeper", "learner", "services")
LINT = Path(sys.executable).with_name("lint-imports")
BUS_CONCERNS = ("transport", "run_state", "telemetry", "prompt_history")
"""The parts of the bus a stage is handed, by the names its constructors give them."""
STAGES = ("rollout", "reward", "gatekeeper", "learner")
WHOLE_BUS_IN_STAGES = {"learner/service.py"}
"""The stage modules that may hold the whole `StreamBus`: the learner process's assembly, which
opens it and hands each collaborator its parts (the other stages get theirs from their hosts'
`ServiceContext`)."""


def _copy_tree(dest: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(
            REPO / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.html")
        )
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(cwd), "PATH": str(LINT.parent)},
        timeout=300,
    )


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")
def test_layer_contracts_hold_and_catch_a_wrong_import(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    ok = _lint(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # A stage importing another stage: the learner reaching into the rollout engine.
    batch = tmp_path / "learner" / "batch.py"
    batch.write_text(batch.read_text() + "\nfrom rollout.engine import Sample  # noqa\n")
    bad = _lint(tmp_path)
    assert bad.returncode != 0
    assert "learner is not allowed to import rollout" in bad.stdout
    # The contracts importing a stage.
    batch.write_text(batch.read_text().replace("from rollout.engine import Sample  # noqa\n", ""))
    keys = tmp_path / "contracts" / "keys.py"
    keys.write_text(keys.read_text() + "\nimport learner.batch  # noqa\n")
    bad = _lint(tmp_path)
    assert bad.returncode != 0 and "contracts.keys -> learner.batch" in bad.stdout, bad.stdout
    # A stage importing the application above it: the gatekeeper reaching into the launcher.
    keys.write_text(keys.read_text().replace("\nimport learner.batch  # noqa\n", ""))
    gate = tmp_path / "gatekeeper" / "service.py"
    gate.write_text(gate.read_text() + "\nimport services.run.launcher  # noqa\n")
    bad = _lint(tmp_path)
    assert bad.returncode != 0 and "gatekeeper.service -> services.run.launcher" in bad.stdout, (
        bad.stdout
    )


def test_no_raw_redis_client_outside_the_contracts() -> None:
    """`StreamBus.redis` is for the contracts modules; everyone else uses its typed accessors."""
    offenders = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if path.is_relative_to(REPO / "contracts"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("redis", "r")
                    and isinstance(node.value, ast.Attribute | ast.Name)
                ):
                    owner = (
                        node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
                    )
                    if "bus" in owner or owner in BUS_CONCERNS:
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"raw Redis client used outside contracts: {offenders}"


def test_a_stage_is_handed_the_parts_of_the_bus_it_uses() -> None:
    """Outside their process's assembly, stage modules never name `StreamBus`: each constructor
    takes the concerns it touches, typed by concern, which mypy then holds it to."""
    holders = set()
    for pkg in STAGES:
        for path in (REPO / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.Name) and n.id == "StreamBus" for n in ast.walk(tree)):
                holders.add(path.relative_to(REPO).as_posix())
    assert holders == WHOLE_BUS_IN_STAGES


def test_the_concerns_of_the_bus_do_not_overlap() -> None:
    """A concern type admits only its own methods (and the shared core's): were one concern to
    inherit another, or two to define the same method, a stage typed by one could use the other
    without its constructor saying so."""
    from contracts.bus import PromptHistory, RunState, StreamBus, Telemetry, Transport
    from contracts.bus.hygiene import RedisHygiene

    concerns = (Transport, RunState, Telemetry, PromptHistory)
    for concern in concerns:
        assert concern.__bases__ == (RedisHygiene,), concern
    own = [{name for name in vars(c) if not name.startswith("__")} for c in concerns]
    for i, names in enumerate(own):
        for other in own[i + 1 :]:
            assert not names & other, names & other
    assert set(StreamBus.__bases__) == set(concerns)  # the union, and nothing of its own
    assert not {name for name in vars(StreamBus) if not name.startswith("__")}
