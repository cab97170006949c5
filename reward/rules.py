"""Rule-based verifiers that run in-process: "dapo" (Minerva) and "strict-box" (docs/algorithm.md s1).

Import them from ``reward.verifiers`` (or ``reward``), which also holds the registry.

Both are pure string work, linear in their input, on at most 300 characters of the response
and ``GROUND_TRUTH_MAX_CHARS`` (1024) of the ground truth; a longer ground truth is an
``[ERROR]`` result. Safe on any input and cheap enough to score thousands of responses per
second. The symbolic verifier, which is not safe in-process, lives in
``reward.math_verify_pool``.
"""

from __future__ import annotations

import re
from typing import Final

from reward.normalize import normalize_answer
from reward.result import CORRECT_SCORE, INVALID, WRONG_SCORE, VerifyResult, error_result
from reward.text import GroundTruthTooLong, ground_truth_text, tail

#: The dapo verifier looks only at this many trailing characters of the response (docs/algorithm.md s1).
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


def verify_dapo(
    response: str, ground_truth: str | int, *, strip_period: bool = True
) -> VerifyResult:
    """Score ``response`` with the default DAPO verifier (docs/algorithm.md s1).

    The last ``Answer: ...`` line of the last 300 characters and the ground truth are both
    normalised by ``reward.normalize.normalize_answer``; exact equality is correct (+1.0),
    anything else, including no answer line (pred ``[INVALID]``), is wrong (-1.0). A ground
    truth over ``GROUND_TRUTH_MAX_CHARS`` characters gives pred ``[ERROR]`` (-1.0) and a reason.

    Args:
        response: the decoded response (special tokens and trailing EOS text already removed).
        ground_truth: the data set's answer; integers are converted with ``str``.
        strip_period: see ``normalize_answer``; ``False`` is the reference behaviour.
    """
    try:
        truth_text = ground_truth_text(ground_truth)
    except GroundTruthTooLong as exc:
        return error_result(str(exc))
    extracted = extract_answer_line(response)
    if extracted is None:
        return _result(False, INVALID)
    pred = normalize_answer(extracted, strip_period=strip_period)
    truth = normalize_answer(truth_text, strip_period=strip_period)
    return _result(pred == truth, pred)


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
