"""Prompt data: loading DAPO-Math-17K style files and making synthetic arithmetic sets.

Rows follow the DAPO-Math-17K schema (docs/algorithm.md s7)::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule"},
     "extra_info": {"index": 0, ...}}

`load_prompts` also accepts AIME-style evaluation rows whose `prompt` is a plain string, or
that carry `problem` + `answer` columns; each becomes one user message.

`synth_rows` makes word problems with integer answers in the same schema, for runs that must
learn within minutes on a CPU. Its `difficulty` knob (see `DIFFICULTY_LEVELS`) sets how hard
the arithmetic is.

Pure module: stdlib only; pyarrow is imported when a parquet file is read or written.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

class DataError(ValueError):
    """A prompt file or row that cannot be read; the message names the file, row and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for rollout: chat messages plus the verifier's ground truth."""

    index: int
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Reading


def parse_row(
    row: Mapping[str, Any], *, row_number: int = 0, source: str = "<rows>", line: int | None = None
) -> PromptRecord:
    """Turn one row (DAPO-Math-17K or AIME style) into a `PromptRecord`.

    `extra_info.index` becomes `index` when it is an integer (or a string of digits);
    otherwise (e.g. the UUID strings some releases use) the row number does, and the original
    stays in `extra_info`. A missing `data_source` becomes `source`'s file stem.

    Raises:
        DataError: naming `source`, `row_number` (and `line`, for JSON lines) and the
            missing or invalid field.
    """
    where = f"{source}: row {row_number}" + (f" (line {line})" if line is not None else "")

    def fail(field: str, problem: str) -> DataError:
        return DataError(f"{where}: field {field!r} {problem}")

    if not isinstance(row, Mapping):
        raise fail("<row>", f"must be an object, got {type(row).__name__}")
    messages = _parse_messages(row, fail)
    ground_truth = _parse_ground_truth(row, fail)

    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, Mapping):
        raise fail("extra_info", f"must be an object, got {type(extra_info).__name__}")
    index = _as_index(extra_info.get("index"), row_number)

    data_source = row.get("data_source")
    if data_source is None:
        data_source = Path(source).stem
    if not isinstance(data_source, str):
        raise fail("data_source", f"must be a string, got {type(data_source).__name__}")
    return PromptRecord(
        index=index,
        messages=messages,
        ground_truth=ground_truth,
        data_source=data_source,
        extra_info=dict(extra_info),
    )


def _parse_messages(
    row: Mapping[str, Any], fail: Callable[[str, str], DataError]
) -> list[dict[str, str]]:
    if "prompt" in row and row["prompt"] is not None:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise fail("prompt", "is empty")
            return [{"role": "user", "content": prompt}]
        if not isinstance(prompt, Sequence) or not prompt:
            raise fail("prompt", "must be a non-empty list of chat messages or a string")
        messages = []
        for i, msg in enumerate(prompt):
            if not isinstance(msg, Mapping):
                raise fail(f"prompt[{i}]", "must be an object with 'role' and 'content'")
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str) or not role:
                raise fail(f"prompt[{i}].role", "is missing or not a string")
            if not isinstance(content, str):
                raise fail(f"prompt[{i}].content", "is missing or not a string")
            messages.append({"role": role, "content": content})
        return messages
    problem = row.get("problem")
    if problem is None:
        raise fail("prompt", "is missing (and there is no 'problem' column)")
    if not isinstance(problem, str) or not problem:
        raise fail("problem", "must be a non-empty string")
    return [{"role": "user", "content": problem}]


def _parse_ground_truth(row: Mapping[str, Any], fail: Callable[[str, str], DataError]) -> str:
    if "reward_model" in row and row["reward_model"] is not None:
        reward_model = row["reward_model"]
        if not isinstance(reward_model, Mapping):
            raise fail("reward_model", "must be an object with 'ground_truth'")
        field, value = "reward_model.ground_truth", reward_model.get("ground_truth")
    elif "answer" in row:
        field, value = "answer", row["answer"]
    else:
        raise fail("reward_model.ground_truth", "is missing (and there is no 'answer' column)")
    if value is None:
        raise fail(field, "is missing")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fail(field, f"must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        text = str(int(value)) if value.is_integer() else repr(value)
    else:
        text = str(value).strip()
    if not text:
        raise fail(field, "is empty")
    return text


def _as_index(value: Any, row_number: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return row_number


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """Read prompts from a .parquet file or a JSON-lines file (.jsonl, or .json).

    A .json file may also hold one JSON array of rows. Rows are numbered from 0 in error
    messages; JSON-lines errors also give the 1-based line.

    Raises:
        DataError: unknown extension, unreadable JSON, or a bad row.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows: list[tuple[Any, int | None]] = [(row, None) for row in _read_parquet(path)]
    elif suffix in (".jsonl", ".json"):
        rows = _read_json_rows(path)
    else:
        raise DataError(f"{path}: unknown extension {suffix!r}; use .parquet, .jsonl or .json")
    records = [
        parse_row(row, row_number=i, source=str(path), line=line)
        for i, (row, line) in enumerate(rows)
    ]
    logger.info("loaded %d prompts from %s", len(records), path)
    return records


def distinct_problems(records: Sequence[PromptRecord]) -> list[PromptRecord]:
    """The records with duplicate problems merged (same messages and ground truth), first
    occurrence kept, order kept. AIME-style eval files repeat each problem (e.g. 32 times for
    avg@32); evaluation samples k responses per distinct problem instead, which gives the same
    expected avg@k for a fraction of the prompt tokens."""
    seen: set[tuple[str, str]] = set()
    out = []
    for rec in records:
        key = (json.dumps(rec.messages, sort_keys=True), rec.ground_truth)
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def load_eval_problems(path: str | Path, max_problems: int | None = None) -> list[PromptRecord]:
    """The distinct problems of an eval file (see `distinct_problems`), the first `max_problems`."""
    records = load_prompts(path)
    problems = distinct_problems(records)
    if len(problems) < len(records):
        logger.info("%s: %d rows hold %d distinct problems; duplicates merged", path, len(records), len(problems))
    return problems[:max_problems]


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _read_json_rows(path: Path) -> list[tuple[Any, int | None]]:
    """Rows with their 1-based line number (None for a JSON array)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            array = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON: {exc}") from exc
        if not isinstance(array, list):
            raise DataError(f"{path}: a .json file must hold an array of rows or JSON lines")
        return [(row, None) for row in array]
    rows: list[tuple[Any, int | None]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}: row {len(rows)} (line {lineno}): invalid JSON: {exc}"
            ) from exc
        rows.append((row, lineno))
    return rows


# ---------------------------------------------------------------------------------------------
# Writing


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as parquet (.parquet) or JSON lines (.jsonl / .json), creating parent dirs.

    The file appears whole or not at all (written beside the target, then renamed).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise DataError(f"{path}: unknown extension {suffix!r}; use .parquet, .jsonl or .json")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), tmp_name)
        else:
            with open(tmp_name, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    logger.info("wrote %d rows to %s", len(rows), path)
    return path


# ---------------------------------------------------------------------------------------------
# Rendering


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The text the policy sees: the chat template if the tokenizer has one, else the message
    contents joined with "\\n" (the tiny tokenizers here have no template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text
    return "\n".join(m["content"] for m in messages)


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]], max_len: int) -> list[int]:
    """The prompt's token ids, left-truncated to `max_len` (the paper keeps the end of a long
    prompt, where the question is)."""
    ids: list[int] = tokenizer.encode(render_prompt(tokenizer, messages), add_special_tokens=False)
    return ids[-max_len:]
