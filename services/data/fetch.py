"""`dapo data fetch`: download public prompt sets and write them as the presets expect.

Each known set (`KNOWN_DATASETS`) is one or more files of a Hugging Face Hub dataset
repository, downloaded with `huggingface_hub` (a dependency of transformers, so no extra is
needed), read through `contracts.data.iter_prompts` (the code path training uses)
and written as parquet rows in the verl / DAPO-Math-17K schema, duplicates merged:

- `dapo-math-17k` -> dapo-math-17k.parquet (the presets' `data.train_path`). The published
  file repeats each of its ~17.9k problems about 100 times (1.79M rows, noted on the dataset's
  page); merging them keeps the distribution the shuffled feeder draws from and makes the file
  ~100x smaller. Rows are read in batches, so the 1.79M rows are never all in memory.
- `aime-2024` -> aime-2024.parquet (the presets' `data.eval_path`): the DAPO authors' copy,
  which repeats each of the 30 problems 32 times for avg@32; evaluation merges them anyway.
- `gsm8k` -> gsm8k-train.parquet and gsm8k-test.parquet; `math-500` -> math-500.parquet. These
  are flat sets: each problem is wrapped in DAPO-Math-17K's instruction, so the `dapo`
  verifier's `Answer:` line applies, and GSM8K's ground truth is its final `#### N` line.

What it does NOT check: that a set's content is what the paper used beyond its schema, or that
the Hub has not changed a file since; the download is pinned to no revision.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from contracts.data import (
    DAPO_PROMPT_TEMPLATE,
    ColumnMap,
    DataError,
    PromptRecord,
    iter_prompts,
    to_row,
    write_rows,
)
from contracts.heldout import distinct_problems

log = logging.getLogger(__name__)

Download = Callable[[str, str], Path]
"""(Hub dataset repository, file in it) -> the local file; raises DataError when it cannot."""

_VERL = ColumnMap(prompt_key="prompt", answer_key="reward_model.ground_truth")


@dataclass(frozen=True)
class KnownDataset:
    """A public prompt set `dapo data fetch` knows how to download and convert."""

    name: str
    repo_id: str
    files: tuple[tuple[str, str], ...]
    """(file in the Hub repository, file written under --out) pairs."""
    columns: ColumnMap
    """How the published rows are read (strict: a renamed column fails the fetch)."""
    data_source: str | None = None
    """Set on every row; None keeps the rows' own `data_source`."""
    about: str = ""


KNOWN_DATASETS: dict[str, KnownDataset] = {
    d.name: d
    for d in (
        KnownDataset(
            "dapo-math-17k",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            (("data/dapo-math-17k.parquet", "dapo-math-17k.parquet"),),
            _VERL,
            about="the DAPO training set (verl format; ~17.9k distinct problems)",
        ),
        KnownDataset(
            "aime-2024",
            "BytedTsinghua-SIA/AIME-2024",
            (("data/aime-2024.parquet", "aime-2024.parquet"),),
            _VERL,
            about="the paper's eval set, AIME 2024 (verl format; 30 problems)",
        ),
        KnownDataset(
            "gsm8k",
            "openai/gsm8k",
            (
                ("main/train-00000-of-00001.parquet", "gsm8k-train.parquet"),
                ("main/test-00000-of-00001.parquet", "gsm8k-test.parquet"),
            ),
            ColumnMap(
                prompt_key="question", answer_key="answer", prompt_template=DAPO_PROMPT_TEMPLATE
            ),
            data_source="gsm8k",
            about="grade-school word problems (flat question/answer; train and test)",
        ),
        KnownDataset(
            "math-500",
            "HuggingFaceH4/MATH-500",
            (("test.jsonl", "math-500.parquet"),),
            ColumnMap(
                prompt_key="problem",
                answer_key="answer",
                extra_keys=("subject", "level", "unique_id"),
                prompt_template=DAPO_PROMPT_TEMPLATE,
            ),
            data_source="math500",
            about="500 MATH test problems (flat problem/answer)",
        ),
    )
}


def hub_download(repo_id: str, filename: str) -> Path:
    """One file of a Hub dataset repository, through the Hugging Face cache (`HF_HOME`)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset"))
    except (OSError, EntryNotFoundError) as exc:  # offline, DNS, HTTP errors, missing file
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"cannot download {filename} of the Hub dataset {repo_id} ({type(exc).__name__}: "
            f"{reason}). This machine may be offline or unable to reach the Hugging Face Hub: run "
            "`dapo data fetch` where it can (or with HF_ENDPOINT set to a mirror) and copy the "
            "written files here"
        ) from exc


def fetch(name: str, out_dir: str | Path, *, download: Download = hub_download) -> list[Path]:
    """Download the known set `name` and write its files under `out_dir`; their paths.

    Raises:
        DataError: an unknown name, a failed download (see `hub_download`), or a published
            row that does not have the columns expected (naming them).
    """
    known = KNOWN_DATASETS.get(name)
    if known is None:
        raise DataError(f"unknown data set {name!r}; known: {', '.join(KNOWN_DATASETS)}")
    written = []
    for remote, local in known.files:
        source = download(known.repo_id, remote)
        log.info("converting %s (%s/%s)", source, known.repo_id, remote)
        written.append(convert(source, Path(out_dir) / local, known))
    return written


def convert(source: str | Path, out: Path, known: KnownDataset) -> Path:
    """Read `source` with `known`'s columns, merge duplicates, write verl rows to `out`."""
    problems = distinct_problems(_records(source, known))
    if not problems:
        raise DataError(f"{source}: no rows")
    write_rows(out, [to_row(rec) for rec in problems])
    log.info("%s: %d distinct problems written to %s", known.name, len(problems), out)
    return out


def _records(source: str | Path, known: KnownDataset) -> Iterator[PromptRecord]:
    for rec in iter_prompts(source, columns=known.columns):
        if known.data_source is not None:
            rec = dataclasses.replace(rec, data_source=known.data_source)
        yield rec


def describe() -> str:
    """The known sets, one per line, for `dapo data fetch --help`."""
    return "\n".join(
        f"  {d.name:14} {d.about} -> {', '.join(local for _, local in d.files)}"
        for d in KNOWN_DATASETS.values()
    )
