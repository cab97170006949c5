"""Command line: ``python -m reward score`` scores JSON lines from stdin (docs/algorithm.md s1).

Input: one JSON object per line with ``response`` (string) and ``ground_truth`` (string or
integer). Output: one JSON object per non-blank input line, in input order, with ``score``,
``acc`` and ``pred`` (plus ``timeout`` for math-verify, and ``reason`` for an item that could not
be verified, pred ``[ERROR]``: an over-long ground truth, say). A malformed line yields
``{"error": "line N: ..."}`` (N counts every input line from 1) in its place and the rest are
still scored. Blank lines are skipped. Exit code 0 when every line scored, 1 when some line
was malformed, 2 on bad arguments or when the math-verify workers cannot start. Timeouts and
other warnings go to stderr.

Lines are read and scored in chunks, so memory stays bounded and math-verify runs a whole
chunk in parallel across its workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

from reward.verifiers import (
    VERIFIER_ALIASES,
    VERIFIERS,
    Scorer,
    VerifyResult,
    WorkerStartError,
    make_scorer,
)

logger = logging.getLogger(__name__)

#: Lines scored per batch.
CHUNK_LINES: Final = 1024


class LineError(ValueError):
    """A JSON line that cannot be scored; the message says why."""


@dataclass(frozen=True)
class _Parsed:
    """One non-blank input line: a pair to score, or the reason it cannot be."""

    line_number: int
    pair: tuple[str, str | int] | None
    error: str | None


def parse_line(text: str) -> tuple[str, str | int]:
    """Return ``(response, ground_truth)`` from one JSON line; raise ``LineError`` if invalid."""
    try:
        record: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"invalid JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 100 000 nested "[" on one line
        raise LineError("invalid JSON: nested too deeply") from exc
    except ValueError as exc:  # an integer literal longer than Python converts
        raise LineError(
            f"invalid JSON: an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from exc
    if not isinstance(record, dict):
        raise LineError(f"expected a JSON object, got {type(record).__name__}")
    for key in ("response", "ground_truth"):
        if key not in record:
            raise LineError(f"missing key {key!r}")
    response, truth = record["response"], record["ground_truth"]
    if not isinstance(response, str):
        raise LineError(f"'response' must be a string, got {type(response).__name__}")
    # bool is an int subclass, but true/false is no answer.
    if isinstance(truth, bool) or not isinstance(truth, str | int):
        raise LineError(f"'ground_truth' must be a string or integer, got {type(truth).__name__}")
    return response, truth


def _parse_lines(lines: Iterable[bytes]) -> Iterator[_Parsed]:
    for line_number, raw in enumerate(lines, start=1):
        # Invalid UTF-8 must not stop the run; JSON escapes may still carry lone surrogates,
        # which the verifiers clean.
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            continue
        try:
            yield _Parsed(line_number, parse_line(text), None)
        except LineError as exc:
            yield _Parsed(line_number, None, f"line {line_number}: {exc}")


def _chunks(items: Iterator[_Parsed], size: int) -> Iterator[list[_Parsed]]:
    chunk: list[_Parsed] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _result_record(result: VerifyResult, with_timeout: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"score": result.score, "acc": result.acc, "pred": result.pred}
    if with_timeout:
        record["timeout"] = result.timeout
    if result.reason is not None:
        record["reason"] = result.reason
    return record


def score_stream(
    lines: Iterable[bytes], out: IO[str], scorer: Scorer, *, with_timeout: bool = False
) -> int:
    """Score JSON ``lines`` to ``out``, one JSON line each; return the number of error lines."""
    errors = 0
    for chunk in _chunks(_parse_lines(lines), CHUNK_LINES):
        pairs = [item.pair for item in chunk if item.pair is not None]
        scored = iter(scorer.score_many(pairs))
        for item in chunk:
            if item.error is not None:
                errors += 1
                record: dict[str, Any] = {"error": item.error}
            else:
                record = _result_record(next(scored), with_timeout)
            # ASCII-escaped JSON: always encodable, whatever the response held.
            out.write(json.dumps(record) + "\n")
        out.flush()
    return errors


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m reward`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m reward",
        description="Rule-based rewards for DAPO (docs/algorithm.md s1).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser(
        "score",
        help="score JSON lines from stdin",
        description=(
            "Read JSON lines {'response': str, 'ground_truth': str|int} from stdin and write "
            "one JSON line {'score', 'acc', 'pred'} per input line, in order. Malformed lines "
            "give {'error': 'line N: ...'}; exit code 1 if there was any."
        ),
    )
    score.add_argument(
        "--verifier",
        choices=(*VERIFIERS, *VERIFIER_ALIASES),
        default=VERIFIERS[0],
        help=f"verifier (default: {VERIFIERS[0]}, the reference rule; 'dapo' means 'dapo-strict')",
    )
    score.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="math-verify hard timeout per item, seconds (default: 5.0)",
    )
    score.add_argument(
        "--workers",
        type=int,
        default=2,
        help="math-verify worker processes (default: 2)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with make_scorer(args.verifier, timeout_s=args.timeout, workers=args.workers) as scorer:
            errors = score_stream(
                sys.stdin.buffer, sys.stdout, scorer, with_timeout=args.verifier == "math-verify"
            )
    except WorkerStartError as exc:
        logger.error("cannot score: %s", exc)
        return 2
    return 1 if errors else 0
