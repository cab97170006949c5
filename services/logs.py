"""The log-line format every `dapo` process shares: `HH:MM:SS name[pid] LEVEL logger: message`,
at the level `DAPO_LOG_LEVEL` names (INFO by default).

A module apart from the CLI: `python -m services.run.learner_torchrun` and the Ray Serve hosts
start without the CLI, and `services.run` importing the CLI, which imports `services.run`, would
make the two import each other (import-linter's acyclic-siblings contract)."""

from __future__ import annotations

import logging
import os


def setup_logging(name: str) -> None:
    level = os.environ.get("DAPO_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
