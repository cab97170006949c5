"""Prompt data: reading prompt sets in the verl / DAPO-Math-17K schema or with flat columns.

Rows in the verl RL-dataset format, as DAPO-Math-17K and the DAPO authors' AIME-2024 publish them
(docs/algorithm.md s7)::

    {"data_source": "math_dapo",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "MATH",
     "reward_model": {"ground_truth": "34", "style": "rule"},
     "extra_info": {"index": 0, ...}}

Flat rows are read too: a plain-text `prompt`, `problem` or `question` column (one user message)
and an `answer` column, as in AIME, MATH or GSM8K style sets (a GSM8K answer's final `#### 42`
line is its ground truth); and chat files, whose `messages` column is the conversation: a last
assistant turn is the reply, not the prompt, and is the ground truth of a row without an answer
column (its `#### 42` line, if it ends with one, else the whole reply). Each row's prompt and
ground truth come from the first candidate column it has (`PROMPT_CANDIDATES`,
`ANSWER_CANDIDATES`) unless a `ColumnMap` names them (config `data.prompt_key`,
`data.answer_key`, `data.extra_keys`, `data.prompt_template`); a row without them fails the
load, and the message names the column looked for and the row's columns.

Sources (`iter_prompts`, `load_prompts`): a .parquet, .jsonl or .json file; a directory written by
the `datasets` library's `save_to_disk`; a Hugging Face Hub dataset `hf://OWNER/NAME[?split=S&name=C]`
(`parse_hub_id`). The last two need the optional `datasets` library (the `data` extra).

`scan_rows` reads every row and says, for each, its record or why it is refused (`dapo data
inspect`), where the loaders stop at the first bad row. `write_rows` writes rows (parquet or
JSON lines); `to_row` turns a record back into a verl row.
The synthetic demo task lives in `services.demo.synthetic`.

Pure module: stdlib only; pyarrow is imported when a parquet file is read or written, and
`datasets` when a dataset directory or a Hub dataset is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

logger = logging.getLogger(__name__)

# The DAPO-Math-17K instruction (docs/algorithm.md s7): its `Answer:` line is what the `dapo`
# verifier looks for. `ColumnMap.prompt_template` can wrap plain-text problems in it; chat-message
# prompts (DAPO-Math-17K's own rows) already carry it and are never wrapped again.
DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
PROMPT_CANDIDATES = ("prompt", "problem", "question", "messages")
"""Columns tried in order for the prompt when `ColumnMap.prompt_key` is None."""
ANSWER_CANDIDATES = ("reward_model.ground_truth", "answer")
"""Columns tried in order for the ground truth when `ColumnMap.answer_key` is None."""
HUB_SCHEME = "hf://"
_HUB_QUERY_KEYS = ("split", "name")
_HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_PARQUET_BATCH_ROWS = 8192
DATA_EXTRA_HINT = "pip install 'dapo-services[data]' (in a checkout: pip install -e '.[data]')"

Fail = Callable[[str, str], "DataError"]


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


@dataclass(frozen=True)
class ColumnMap:
    """Which columns of a row hold the prompt, the ground truth and extra fields.

    A key may be a dotted path into object columns (`reward_model.ground_truth`). A key that is
    set must be present in every row; None means the first candidate column a row has.
    """

    prompt_key: str | None = None
    answer_key: str | None = None
    extra_keys: tuple[str, ...] = ()
    """Copied into each record's `extra_info` under their own names."""
    prompt_template: str | None = None
    """Wraps plain-text prompts: `{problem}` is replaced by the text (no other brace is read, so
    LaTeX in a template is safe). Chat-message prompts are used as they are."""

    def __post_init__(self) -> None:
        for key in (self.prompt_key, self.answer_key, *self.extra_keys):
            if key is not None and any(not part for part in key.split(".")):
                raise DataError(f"column key {key!r} is empty or has an empty dotted part")
        if self.prompt_template is not None and "{problem}" not in self.prompt_template:
            raise DataError(f"prompt template {self.prompt_template!r} has no '{{problem}}'")


@dataclass(frozen=True)
class HubDataset:
    """A Hugging Face Hub dataset: `hf://OWNER/NAME[?split=S&name=C]`."""

    repo_id: str
    split: str = "train"
    name: str | None = None
    """The dataset's configuration (e.g. GSM8K's `main`); None = its default one."""


# ---------------------------------------------------------------------------------------------
# Rows


def parse_row(
    row: Mapping[str, Any],
    *,
    row_number: int = 0,
    source: str = "<rows>",
    line: int | None = None,
    columns: ColumnMap | None = None,
    default_source: str | None = None,
) -> PromptRecord:
    """Turn one row (verl / DAPO-Math-17K format, or flat columns) into a `PromptRecord`.

    `extra_info.index` becomes `index` when it is an integer (or a string of digits);
    otherwise (e.g. the UUID strings DAPO-Math-17K uses) the row number does, and the original
    stays in `extra_info`. A missing `data_source` becomes `default_source`, else `source`'s
    file stem.

    Raises:
        DataError: naming `source`, `row_number` (and `line`, for JSON lines) and the
            missing or invalid field; a missing column's message lists the row's columns.
    """
    cols = columns or ColumnMap()
    where = f"{source}: row {row_number}" + (f" (line {line})" if line is not None else "")

    def fail(field: str, problem: str) -> DataError:
        return DataError(f"{where}: field {field!r} {problem}")

    if not isinstance(row, Mapping):
        raise fail("<row>", f"must be an object, got {type(row).__name__}")
    prompt_key, prompt = _find(row, cols.prompt_key, PROMPT_CANDIDATES, "prompt_key", fail)
    messages = _parse_messages(prompt_key, prompt, cols.prompt_template, fail)
    reply = _take_reply(prompt_key, messages, fail)
    answer_key, answer = _find_answer(row, cols, reply, fail)
    ground_truth = _parse_ground_truth(answer_key, answer, fail)
    extra_info = _parse_extra_info(row, cols.extra_keys, fail)
    index = _as_index(extra_info.get("index"), row_number)

    data_source = row.get("data_source")
    if data_source is None:
        data_source = default_source if default_source is not None else Path(source).stem
    if not isinstance(data_source, str):
        raise fail("data_source", f"must be a string, got {type(data_source).__name__}")
    return PromptRecord(
        index=index,
        messages=messages,
        ground_truth=ground_truth,
        data_source=data_source,
        extra_info=extra_info,
    )


def _lookup(row: Mapping[str, Any], key: str, fail: Fail) -> Any:
    """The value of column `key`, or of a dotted path into object columns; None if absent."""
    if key in row:
        return row[key]
    node: Any = row
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return None
        if not isinstance(node, Mapping):
            raise fail(".".join(parts[:i]), f"must be an object with {part!r}")
        node = node.get(part)
    return node


def _find(
    row: Mapping[str, Any], key: str | None, candidates: tuple[str, ...], setting: str, fail: Fail
) -> tuple[str, Any]:
    """(column, value) of the first of `key` (if set) or `candidates` that the row has."""
    keys = (key,) if key is not None else candidates
    for k in keys:
        value = _lookup(row, k, fail)
        if value is not None:
            return k, value
    present = ", ".join(repr(str(c)) for c in row) or "none"
    if key is not None:
        how = f"named by data.{setting}"
    else:
        how = f"looked for {', '.join(map(repr, keys))}; name the column with data.{setting}"
    raise fail(keys[0], f"is missing ({how}; the row's columns: {present})")


REPLY_COLUMN = "messages[-1].content"
"""How the ground truth taken from a chat row's last assistant turn is named (messages, inspect)."""


def _take_reply(key: str, messages: list[dict[str, str]], fail: Fail) -> str | None:
    """Remove and return a last assistant turn: the prompt is what the model answers, and a
    conversation that ends in its reply would have it speak after itself."""
    if messages[-1]["role"] != "assistant":
        return None
    if len(messages) == 1:
        raise fail(key, "holds only an assistant turn: there is no prompt to answer")
    return messages.pop()["content"]


def _find_answer(
    row: Mapping[str, Any], cols: ColumnMap, reply: str | None, fail: Fail
) -> tuple[str, Any]:
    """The ground truth's column and value: an answer column, else a chat row's reply."""
    if reply is None or cols.answer_key is not None:
        return _find(row, cols.answer_key, ANSWER_CANDIDATES, "answer_key", fail)
    for key in ANSWER_CANDIDATES:
        value = _lookup(row, key, fail)
        if value is not None:
            return key, value
    return REPLY_COLUMN, reply


def column_used(row: Mapping[str, Any], key: str | None, candidates: tuple[str, ...]) -> str | None:
    """The column `parse_row` reads a value from: `key` when set, else the first candidate the
    row has (None when it has none)."""
    for k in (key,) if key is not None else candidates:
        try:
            if _lookup(row, k, lambda f, p: DataError(p)) is not None:
                return k
        except DataError:
            return None
    return None


def _parse_messages(
    key: str, prompt: Any, template: str | None, fail: Fail
) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt:
            raise fail(key, "is empty")
        text = prompt if template is None else template.replace("{problem}", prompt)
        return [{"role": "user", "content": text}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise fail(key, "must be a non-empty list of chat messages or a string")
    messages = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping):
            raise fail(f"{key}[{i}]", "must be an object with 'role' and 'content'")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise fail(f"{key}[{i}].role", "is missing or not a string")
        if not isinstance(content, str):
            raise fail(f"{key}[{i}].content", "is missing or not a string")
        messages.append({"role": role, "content": content})
    return messages


def _parse_ground_truth(key: str, value: Any, fail: Fail) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fail(key, f"must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        text = str(int(value)) if value.is_integer() else repr(value)
    else:
        text = _final_answer(str(value).strip())
    if not text:
        raise fail(key, "is empty")
    return text


def _final_answer(text: str) -> str:
    """GSM8K-style answers are a worked solution whose last line is `#### 1,234`: the ground
    truth is that line's number, thousands separators removed. Other text is kept as it is."""
    last = text.rpartition("\n")[2]
    if not last.startswith("####"):
        return text
    final = last.removeprefix("####").strip()
    return final.replace(",", "") if _THOUSANDS.fullmatch(final) else final


def _parse_extra_info(
    row: Mapping[str, Any], extra_keys: tuple[str, ...], fail: Fail
) -> dict[str, Any]:
    info = row.get("extra_info")
    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        raise fail("extra_info", f"must be an object, got {type(info).__name__}")
    out = dict(info)
    for key in extra_keys:
        out[key] = _find(row, key, (), "extra_keys", fail)[1]
    return out


def _as_index(value: Any, row_number: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return row_number


def to_row(record: PromptRecord, *, ability: str = "MATH") -> dict[str, Any]:
    """The verl / DAPO-Math-17K row of a record; `parse_row` reads it back to the same messages,
    ground truth and data source. `extra_info.index` is added when the record's has none."""
    extra_info = dict(record.extra_info)
    extra_info.setdefault("index", record.index)
    return {
        "data_source": record.data_source,
        "prompt": [dict(m) for m in record.messages],
        "ability": ability,
        "reward_model": {"ground_truth": record.ground_truth, "style": "rule"},
        "extra_info": extra_info,
    }


# ---------------------------------------------------------------------------------------------
# Reading


def parse_hub_id(spec: str) -> HubDataset | None:
    """`hf://OWNER/NAME[?split=S&name=C]` -> `HubDataset`; None for any other string.

    Raises:
        DataError: an `hf://` string that is not a dataset id, or an unknown or repeated option.
    """
    if not spec.startswith(HUB_SCHEME):
        return None
    repo_id, _, query = spec.removeprefix(HUB_SCHEME).partition("?")
    if not _HUB_REPO_ID.fullmatch(repo_id):
        raise DataError(f"{spec}: expected hf://OWNER/NAME[?split=SPLIT&name=CONFIG]")
    try:
        options = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise DataError(f"{spec}: cannot read the options after '?': {exc}") from None
    for key, values in options.items():
        if key not in _HUB_QUERY_KEYS:
            raise DataError(f"{spec}: unknown option {key!r}; use {' and '.join(_HUB_QUERY_KEYS)}")
        if len(values) != 1 or not values[0]:
            raise DataError(f"{spec}: option {key!r} needs exactly one non-empty value")
    return HubDataset(
        repo_id, split=options.get("split", ["train"])[0], name=options.get("name", [None])[0]
    )


def iter_prompts(path: str | Path, *, columns: ColumnMap | None = None) -> Iterator[PromptRecord]:
    """The records of a source (see the module docstring), read lazily: parquet files in
    batches, so a large file need not be held as rows all at once.

    Raises:
        DataError: a missing file, an unknown extension, unreadable data, a missing `datasets`
            library, or a bad row (naming its number and field).
    """
    source = str(path)
    rows, default_source = _open_rows(source)
    for i, (row, line) in enumerate(rows):
        yield parse_row(
            row,
            row_number=i,
            source=source,
            line=line,
            columns=columns,
            default_source=default_source,
        )


def scan_rows(
    path: str | Path, *, columns: ColumnMap | None = None
) -> Iterator[tuple[Any, PromptRecord | DataError]]:
    """Every row of a source with its record, or the `DataError` that refuses it (naming the
    row, its line and the field): unlike `iter_prompts`, a bad row (a JSON line that does not
    parse included) does not stop the reading.

    Raises:
        DataError: the source itself cannot be read (missing, unknown extension, not parquet).
    """
    source = str(path)
    rows, default_source = _open_rows(source, lenient=True)
    for i, (row, line) in enumerate(rows):
        if isinstance(row, DataError):
            yield None, row
            continue
        try:
            yield (
                row,
                parse_row(
                    row,
                    row_number=i,
                    source=source,
                    line=line,
                    columns=columns,
                    default_source=default_source,
                ),
            )
        except DataError as exc:
            yield row, exc


def load_prompts(path: str | Path, *, columns: ColumnMap | None = None) -> list[PromptRecord]:
    """All records of a source (see `iter_prompts`). Rows are numbered from 0 in error messages;
    JSON-lines errors also give the 1-based line, and a .json file may hold one JSON array."""
    records = list(iter_prompts(path, columns=columns))
    logger.info("loaded %d prompts from %s", len(records), path)
    return records


Rows = Iterable[tuple[Any, int | None]]
"""Rows of a source, each with its 1-based line (JSON lines only, else None)."""


def _open_rows(source: str, *, lenient: bool = False) -> tuple[Rows, str]:
    """The rows of `source` and the `data_source` of rows that carry none (`lenient`: a JSON
    line that does not parse is a `DataError` in place of its row, not an error raised)."""
    hub = parse_hub_id(source)
    if hub is not None:
        return _read_hub(hub, source), hub.repo_id.rpartition("/")[2]
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"{path}: no such file or directory (`dapo data fetch` writes the public sets the "
            "presets name, e.g. data/dapo-math-17k.parquet)"
        )
    if path.is_dir():
        return _read_dataset_dir(path), path.name
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path), path.stem
    if suffix in (".jsonl", ".json"):
        return _read_json_rows(path, lenient=lenient), path.stem
    raise DataError(
        f"{path}: unknown extension {suffix!r}; use .parquet, .jsonl or .json, a `datasets` "
        "directory, or hf://OWNER/NAME"
    )


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc
    return _parquet_rows(parquet, path)


def _parquet_rows(parquet: Any, path: Path) -> Iterator[tuple[Any, None]]:
    try:
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                yield row, None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read parquet: {exc}") from exc


def _read_json_rows(path: Path, *, lenient: bool = False) -> list[tuple[Any, int | None]]:
    """Rows with their 1-based line number (None for a JSON array); `lenient`: see
    `_open_rows`."""
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
            error = DataError(f"{path}: row {len(rows)} (line {lineno}): invalid JSON: {exc}")
            if not lenient:
                raise error from exc
            row = error
        rows.append((row, lineno))
    return rows


def _import_datasets(what: str) -> Any:
    """The `datasets` module; the optional `data` extra, so its absence is a DataError."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            f"{what} needs the `datasets` library, not installed: {DATA_EXTRA_HINT}"
        ) from exc
    return datasets


def _read_dataset_dir(path: Path) -> Rows:
    datasets = _import_datasets(f"{path} is a directory; reading it as a saved dataset")
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a dataset written by `datasets` save_to_disk: {exc}") from exc
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset) or ["train"]
        raise DataError(
            f"{path} holds one dataset per split ({', '.join(splits)}): point at one of them, "
            f"e.g. {path / splits[0]}"
        )
    return ((row, None) for row in dataset)


def _read_hub(hub: HubDataset, spec: str) -> Rows:
    datasets = _import_datasets(f"{spec} (a Hugging Face Hub dataset)")
    from datasets.exceptions import DatasetsError

    try:
        dataset = datasets.load_dataset(hub.repo_id, hub.name, split=hub.split)
    except (OSError, ValueError, DatasetsError) as exc:  # offline, not found, unknown split
        hint = (
            ". Offline, or the id is wrong? Where the Hub cannot be reached, point at a local file "
            "(`dapo data fetch` writes the known sets on a machine that can reach it)"
            if isinstance(exc, OSError)
            else ""
        )
        raise DataError(
            f"{spec}: cannot load split {hub.split!r} of the Hub dataset {hub.repo_id!r} "
            f"({type(exc).__name__}: {exc}){hint}"
        ) from exc
    return ((row, None) for row in dataset)


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


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], *, chat: bool = True) -> str:
    """The text the policy sees: the chat template if the tokenizer has one and `chat`, else the
    message contents joined with "\\n" (the tiny tokenizers here have no template; a model used
    as a completer, `data.prompt_format: completion`, continues the text itself)."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
        return text
    return "\n".join(m["content"] for m in messages)


def encode_prompt(
    tokenizer: Any, messages: list[dict[str, str]], max_len: int, *, chat: bool = True
) -> list[int]:
    """The prompt's token ids (`render_prompt`), left-truncated to `max_len` (the paper keeps the
    end of a long prompt, where the question is)."""
    text = render_prompt(tokenizer, messages, chat=chat)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids[-max_len:]
