"""Rule-based verifiers that run in-process (docs/algorithm.md s1).

* ``verify_dapo_reference`` ("dapo-reference"): the reference code's rule, quirks included, so
  training rewards and evaluation numbers compare with the paper's.
* ``verify_dapo_strict`` ("dapo-strict", alias "dapo"): the same rule with four deliberate
  departures, listed in its docstring.
* ``verify_strict_box`` ("strict-box").
* ``verify_first_line`` ("first-line") and ``verify_first_number`` ("first-number"): strict and
  lenient grading of a completer's answer (`data.prompt_format: completion`), which writes the
  number and ends the line.

Import them from ``reward.verifiers`` (or ``reward``), which also holds the registry.

All are pure string work, linear in their input, on at most 300 characters of the response
and ``GROUND_TRUTH_MAX_CHARS`` (1024) of the ground truth; a longer ground truth is an
``[ERROR]`` result (the reference has no cap: a data error there is a slow comparison here an
error with its reason). Safe on any input and cheap enough to score thousands of responses per
second. The symbolic verifier, which is not safe in-process, lives in
``reward.math_verify_pool``.
"""

from __future__ import annotations

import re
from typing import Final

from reward.normalize import normalize_answer, normalize_answer_reference
from reward.result import CORRECT_SCORE, INVALID, WRONG_SCORE, VerifyResult, error_result
from reward.text import GroundTruthTooLong, clean_text, ground_truth_text, tail

#: The dapo verifier looks only at this many trailing characters of the response
#: (docs/algorithm.md s1).
DAPO_TAIL_CHARS: Final = 300

#: Strict-box mode looks only at this many trailing characters (docs/algorithm.md s1).
STRICT_BOX_TAIL_CHARS: Final = 100

#: The answer line the DAPO prompt asks for: "Answer: $Answer" (docs/algorithm.md s1 and s7).
ANSWER_PATTERN: Final = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

_BOXED_OPEN: Final = "\\boxed{"


def _result(acc: bool, pred: str) -> VerifyResult:
    return VerifyResult(score=CORRECT_SCORE if acc else WRONG_SCORE, acc=acc, pred=pred)


def extract_answer_line(response: str) -> str | None:
    """Return the text after the LAST ``Answer:`` in the last 300 characters, or ``None``.

    The match is case-insensitive and runs to the end of its line (docs/algorithm.md s1). An answer
    that starts more than 300 characters before the end is not seen, as in the reference.
    """
    matches = ANSWER_PATTERN.findall(tail(response, DAPO_TAIL_CHARS))
    return matches[-1] if matches else None


def verify_dapo_strict(response: str, ground_truth: str | int) -> VerifyResult:
    """Score ``response`` with the "dapo-strict" verifier (alias "dapo"; docs/algorithm.md s1).

    The last ``Answer: ...`` line of the last 300 characters and the ground truth are both
    normalised by ``reward.normalize.normalize_answer``; exact equality is correct (+1.0),
    anything else, including no answer line (pred ``[INVALID]``), is wrong (-1.0). A ground
    truth over ``GROUND_TRUTH_MAX_CHARS`` characters gives pred ``[ERROR]`` (-1.0) and a reason.

    Departures from the reference rule (``verify_dapo_reference``), each deliberate:

    1. one trailing ``"."`` is stripped: ``"Answer: 42."`` is correct for 42 (the reference
       counts the sentence's full stop as part of the answer);
    2. commas are dropped from, and only from, correctly grouped numbers, after surrounding
       whitespace is stripped: ``"-1,000"``, ``"1,000.5"`` and ``"1,000\\r"`` lose theirs
       (the reference keeps them, so ``"-1,000"`` never equals ``"-1000"``), the list
       ``"1,2"`` keeps its (the reference reads it as ``"12"``);
    3. no answer line is never correct: the reference compares the marker ``[INVALID]`` with
       the normalised ground truth, so a ground truth spelled ``[INVALID]`` matches it;
    4. the text is cleaned (``reward.text.clean_text``: NUL bytes removed, lone surrogates
       replaced) before it is read, so ``"4\\x002"`` reads as ``"42"``; the reference reads
       it raw.

    tests/reward/test_dapo_reference.py checks that these, and only these, change a score on
    the reference cases (51 of 481).

    Args:
        response: the decoded response (special tokens and trailing EOS text already removed).
        ground_truth: the data set's answer; integers are converted with ``str``.
    """
    try:
        truth_text = ground_truth_text(ground_truth)
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    extracted = extract_answer_line(response)
    if extracted is None:
        return _result(False, INVALID)
    pred = normalize_answer(extracted)
    return _result(pred == normalize_answer(truth_text), pred)


def verify_dapo_reference(response: str, ground_truth: str | int) -> VerifyResult:
    """Score ``response`` exactly as the reference code does
    ("dapo-reference"; docs/algorithm.md s1).

    In the raw last 300 characters, the text after the LAST ``Answer:`` (case-insensitive, to
    the end of its line), or the marker ``[INVALID]`` when there is none, is normalised by
    ``normalize_answer_reference``, as is the ground truth; string equality is correct (+1.0).
    Every quirk is kept: ``"42."`` is wrong for 42, ``"1,2"`` is right for 12, ``"-1,000"`` is
    wrong for -1000, and a ground truth spelled ``[INVALID]`` is matched by a response with no
    answer line. tests/reward/dapo_reference_cases.jsonl holds the cases it is checked on.

    Two things are not the reference's, and neither changes an ``acc`` the reference computes:
    a ground truth over ``GROUND_TRUTH_MAX_CHARS`` is an ``[ERROR]`` result (the reference
    would compare it), and the reported ``pred`` is cleaned (NUL bytes removed, lone
    surrogates replaced) after the comparison, so it can travel as JSON. Integer ground truths
    are converted with ``str`` (the reference takes only strings).
    """
    try:
        truth_text = ground_truth_text(ground_truth, clean=False)
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    matches = ANSWER_PATTERN.findall(response[-DAPO_TAIL_CHARS:])
    pred = normalize_answer_reference(matches[-1] if matches else INVALID)
    return _result(pred == normalize_answer_reference(truth_text), clean_text(pred))


def last_boxed_content(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` of ``text``, braces matched, or ``None``.

    Only the LAST ``\\boxed{`` is considered: if its braces never close (a truncated response)
    the result is ``None`` even when an earlier box is complete, as in the reference.
    """
    start = text.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    depth = 0
    for index in range(start + len(_BOXED_OPEN) - 1, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED_OPEN) : index]
    return None


def verify_strict_box(response: str, ground_truth: str | int) -> VerifyResult:
    """Score ``response`` in strict-box mode (docs/algorithm.md s1).

    The content of the last brace-matched ``\\boxed{...}`` in the last 100 characters must
    equal ``str(ground_truth)`` as a raw string; only surrounding whitespace is stripped from
    both sides. No box -> pred ``[INVALID]``, score -1.0. A ground truth over
    ``GROUND_TRUTH_MAX_CHARS`` characters gives pred ``[ERROR]`` (-1.0) and a reason.
    """
    try:
        truth = ground_truth_text(ground_truth).strip()
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    boxed = last_boxed_content(tail(response, STRICT_BOX_TAIL_CHARS))
    if boxed is None:
        return _result(False, INVALID)
    pred = boxed.strip()
    return _result(pred == truth, pred)


#: A completer's answer is read from this many leading characters (it comes first).
COMPLETION_HEAD_CHARS: Final = 100
_INTEGER: Final = re.compile(r"[-+]?\d+")


def verify_first_line(response: str, ground_truth: str | int) -> VerifyResult:
    """Strict grading of a completion ("first-line"): the response's first line, surrounding
    whitespace stripped, is exactly the ground truth's text ("68" for 68; "68." or "68 apples"
    are wrong). The few-shot prompt shows answers in exactly that form."""
    try:
        truth = ground_truth_text(ground_truth).strip()
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    head = response[:COMPLETION_HEAD_CHARS]
    pred = head.split("\n", 1)[0].strip()
    if not pred:
        return _result(False, INVALID)
    return _result(pred == truth, pred)


def verify_first_number(response: str, ground_truth: str | int) -> VerifyResult:
    """Lenient grading of a completion ("first-number"): the first integer in the response's
    first characters equals the ground truth as an integer, whatever surrounds it."""
    try:
        truth = ground_truth_text(ground_truth).strip()
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    found = _INTEGER.search(response[:COMPLETION_HEAD_CHARS])
    if found is None:
        return _result(False, INVALID)
    pred = found.group(0)
    try:
        return _result(int(pred) == int(truth), pred)
    except ValueError:  # a ground truth that is no integer: this rule cannot match it
        return _result(False, pred)
