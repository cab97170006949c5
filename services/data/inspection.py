"""`dapo data inspect [FILE] [--config CFG]`: what a run would read from a prompt file (issue 42).

It reads the file the way training does (`contracts.data`, with the config's column settings)
and prints: how many rows it read and parsed, which columns gave the prompt and the ground
truth, the rows' `data_source`s, the scorer each row gets (`reward.routing.verifier_for`: the
rule the reward stage applies) and why, one prompt rendered as the model will see it, its ground
truth, and every row refused with the reason. `dapo run` stops at the first refused row (naming
it); this shows them all, so a file can be fixed in one pass.

Without FILE it inspects the config's `data.train_path`, generating it first where the config
asks (`data.synth`, `data.gym`). The prompt goes through the chat template of the config's model
when that model is on this machine (a local directory, or a catalogue model already fetched);
otherwise the messages are shown as they are, and the output says so. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.config import DapoConfig, RewardConfig, load_config
from contracts.data import (
    ANSWER_CANDIDATES,
    PROMPT_CANDIDATES,
    REPLY_COLUMN,
    ColumnMap,
    DataError,
    PromptRecord,
    column_used,
    render_prompt,
    scan_rows,
)
from contracts.model_catalog import model_cache
from contracts.tasks import GymEntry
from reward.routing import FUNCTION, GYM, verifier_for

MAX_REFUSALS_SHOWN = 20


@dataclass
class Inspection:
    """What `inspect_file` found."""

    source: str
    rows: int = 0
    parsed: int = 0
    prompt_columns: Counter[str] = field(default_factory=Counter)
    answer_columns: Counter[str] = field(default_factory=Counter)
    data_sources: Counter[str] = field(default_factory=Counter)
    scorers: Counter[str] = field(default_factory=Counter)
    refused: list[str] = field(default_factory=list)
    """Every refused row's reason, in file order."""
    first: PromptRecord | None = None


def scorer_of(rw: RewardConfig, record: PromptRecord) -> str:
    """The scorer a row gets and why: `reasoning-gym:countdown (the row's reasoning-gym task)`.

    Raises:
        ValueError: the row carries a reasoning-gym entry that is not one this project wrote.
    """
    name = verifier_for(rw, record.data_source, record.extra_info)
    if name == FUNCTION:
        return f"{rw.function} (reward.function)"
    if record.data_source in rw.verifier_by_source:
        return f"{name} (reward.verifier_by_source[{record.data_source!r}])"
    if name == GYM:
        entry = GymEntry.from_extra_info(record.extra_info)
        assert entry is not None  # verifier_for chose it for the entry
        return f"{GYM}:{entry.dataset} (the row's reasoning-gym task)"
    return f"{name} (reward.verifier)"


def inspect_file(path: str | Path, columns: ColumnMap, rw: RewardConfig) -> Inspection:
    """Read every row of `path` as training would; refusals are collected, not raised.

    Raises:
        DataError: the file itself cannot be read.
    """
    found = Inspection(str(path))
    for row, outcome in scan_rows(path, columns=columns):
        found.rows += 1
        if isinstance(outcome, DataError):
            found.refused.append(str(outcome))
            continue
        try:
            scorer = scorer_of(rw, outcome)
        except ValueError as exc:
            found.refused.append(f"row {found.rows - 1}: {exc} (it would score [ERROR])")
            continue
        found.parsed += 1
        found.scorers[scorer] += 1
        found.data_sources[outcome.data_source] += 1
        found.prompt_columns[str(column_used(row, columns.prompt_key, PROMPT_CANDIDATES))] += 1
        answer = column_used(row, columns.answer_key, ANSWER_CANDIDATES)
        found.answer_columns[answer or REPLY_COLUMN] += 1
        if found.first is None:
            found.first = outcome
    return found


def _tokenizer(cfg: DapoConfig | None) -> Any | None:
    """The config's model's tokenizer when it is on this machine, else None (no download)."""
    if cfg is None or cfg.model.hub_id is not None:
        return None
    name = cfg.model.catalog_name
    path = model_cache() / name if name is not None else Path(cfg.model.path).expanduser()
    if not (path / "config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def rendered(record: PromptRecord, cfg: DapoConfig | None) -> tuple[str, str]:
    """(the prompt as the model sees it, how it was rendered)."""
    if cfg is not None and not cfg.data.chat:
        return render_prompt(None, record.messages, chat=False), "data.prompt_format: completion"
    tokenizer = _tokenizer(cfg)
    if cfg is not None and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return render_prompt(tokenizer, record.messages), f"{cfg.model.path}'s chat template"
    messages = "\n".join(f"[{m['role']}]\n{m['content']}" for m in record.messages)
    return messages, "the messages; no local model to apply its chat template (pass --config)"


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{name} ({n} rows)" for name, n in counter.most_common())


def report(found: Inspection, cfg: DapoConfig | None) -> str:
    """The text `dapo data inspect` prints."""
    lines = [
        f"file: {found.source}",
        f"rows: {found.rows} read, {found.parsed} parsed, {len(found.refused)} refused",
        f"prompt column: {_counts(found.prompt_columns) or '-'}",
        f"ground truth column: {_counts(found.answer_columns) or '-'}",
        f"data_source: {_counts(found.data_sources) or '-'}",
        f"scorer: {_counts(found.scorers) or '-'}",
    ]
    if found.first is not None:
        text, how = rendered(found.first, cfg)
        lines += [
            f"first row's prompt (rendered with {how}):",
            *(f"  | {line}" for line in text.split("\n")),
            f"its ground truth: {found.first.ground_truth!r}",
        ]
    if found.refused:
        lines.append(f"refused rows ({len(found.refused)}; `dapo run` stops at the first):")
        lines += [f"  {reason}" for reason in found.refused[:MAX_REFUSALS_SHOWN]]
        if len(found.refused) > MAX_REFUSALS_SHOWN:
            lines.append(f"  ... and {len(found.refused) - MAX_REFUSALS_SHOWN} more")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """The command: 0 when every row parsed, 1 when some row was refused, 2 when the file
    cannot be read."""
    cfg = load_config(args.config, list(args.set)) if args.config else None
    path = args.file
    if path is None:
        if cfg is None:
            sys.stderr.write("dapo data inspect: give a FILE, or --config to read its train_path\n")
            return 2
        from services.data.prepare import prepare_data

        prepare_data(cfg)  # generated sets (data.synth, data.gym) are written first
        path = cfg.data.train_path
    columns = cfg.data.columns if cfg is not None else ColumnMap()
    try:
        found = inspect_file(path, columns, cfg.reward if cfg is not None else RewardConfig())
    except DataError as exc:
        sys.stderr.write(f"dapo data inspect: {exc}\n")
        return 2
    sys.stdout.write(report(found, cfg))
    return 1 if found.refused else 0


def add_parser(dsub: Any) -> None:
    """`dapo data inspect` in the `dapo data` subcommands."""
    inspect = dsub.add_parser(
        "inspect",
        help="what a run would read from a prompt file: rows, columns, a rendered prompt, the "
        "scorer, refused rows",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    inspect.add_argument("file", nargs="?", help="the file (default: the config's train_path)")
    inspect.add_argument("--config", help="a run's config: its data.* columns, reward, model")
    inspect.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted config override (with --config), e.g. data.prompt_key=question",
    )
    inspect.set_defaults(fn=run)
