"""Minerva-style answer normalisation of the "dapo" verifiers (docs/algorithm.md s1).

The prediction and the ground truth go through the same normalisation; the verifier then
compares the two strings for exact equality. Each step is one small function below, applied in
the order of ``minerva_steps``; the order is part of the behaviour (for instance units are
removed after spaces, so ``"5 cm"`` becomes ``"5cm"`` and then ``"5"``). Every step takes time
linear in the input: the reference's wrapper regexes, quadratic on some inputs, are replaced by
patterns with the same results (see ``unwrap_wrappers``).

Two normalisations share those steps and differ only in how they end:

* ``normalize_answer_reference`` ends as the reference code does: every comma goes when the
  string is digits once the commas are gone (``str.isdigit``, so ``"1,2,3"`` becomes ``"123"``
  while ``"-1,000"`` and ``"1,000.5"`` keep theirs), then surrounding whitespace is stripped.
* ``normalize_answer`` (the "dapo-strict" verifier) departs from it on purpose: one trailing
  ``"."`` is stripped (``"42."`` equals ``"42"``), and thousands commas are dropped from, and
  only from, properly grouped numbers (``"1,000"``, ``"-12,345.5"``), so the list ``"1,2,3"``
  keeps its commas.
"""

from __future__ import annotations

import re
from typing import Final

#: Literal replacements applied in this order (docs/algorithm.md s1: "drop ... `\\$` ... spaces").
#: Articles go first so "a 5" is "5"; every space goes, so units and markup can be matched.
SUBSTITUTIONS: Final[tuple[tuple[str, str], ...]] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

#: Unit and filler words deleted wherever they occur (docs/algorithm.md s1: "drop units").
#: Plain substring deletion, as in Minerva: "always" loses its "ways" too.
UNIT_WORDS: Final[tuple[str, ...]] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
)

#: TeX fragments deleted after the units (docs/algorithm.md s1: "drop ... `^\\circ`"). The empty
#: ``\\text{}`` entries catch what is left once a unit inside ``\\text{..}`` has gone.
MARKUP_TO_DROP: Final[tuple[str, ...]] = (
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

#: Commands whose braces are unwrapped, keeping the (shortest) content: ``\\text{cm}`` -> ``cm``.
UNWRAPPED_COMMANDS: Final[tuple[str, ...]] = ("text", "textbf", "overline")

# The three wrapper patterns below give the results of Minerva's ``.*?\$(.*?)\$.*``,
# ``\\text\{(.*?)\}`` and ``\\boxed\{(.*)\}`` (``.`` never matches a newline, so each works
# within one line) in time linear in the input. The reference patterns rescan the rest of the
# line from every position where a match could start and fail there, which is quadratic in the
# line length: 16k characters without ``$`` took 2 s, 64k took 35 s. tests/reward/
# test_normalize_linear.py checks the results against the reference patterns.

#: A line with two ``$``: the reference match can only start at a line start (its ``.*?``
#: absorbs any later start), so one anchored attempt per line is enough.
_INLINE_MATH = re.compile(r"^[^$\n]*\$([^$\n]*)\$.*", re.MULTILINE)

#: ``\\name{`` then the content up to the first ``}`` of the line (group 1), or, when the line
#: has no ``}`` after it, the rest of the line, left as it is (group 1 is ``None``). Consuming
#: that rest is safe, as no later ``\\name{`` of the line has a ``}`` after it either, and it
#: is what stops the rescans.
_UNWRAP = tuple(re.compile(r"\\" + name + r"\{(?:([^}\n]*)\}|.*)") for name in UNWRAPPED_COMMANDS)

#: ``\\boxed{`` then the content up to the LAST ``}`` of the line (group 1), or the rest of the
#: line, left as it is, when it has no ``}`` after it (same reasoning as ``_UNWRAP``).
_BOXED = re.compile(r"\\boxed\{(?:(.*)\}|.*)")
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def keep_after_last_equals(answer: str) -> str:
    """Keep the text after the last ``=`` (docs/algorithm.md s1: "keep text after the last `=`").

    ``"x = 5"`` -> ``" 5"``; a string without ``=`` is unchanged.
    """
    return answer.rsplit("=", 1)[-1]


def apply_substitutions(answer: str) -> str:
    """Apply ``SUBSTITUTIONS`` in order (docs/algorithm.md s1: "drop ... `\\$` ... spaces")."""
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    return answer


def drop_units_and_markup(answer: str) -> str:
    """Delete ``UNIT_WORDS`` then ``MARKUP_TO_DROP`` (docs/algorithm.md s1:
    "drop units ... `^\\circ`")."""
    for fragment in (*UNIT_WORDS, *MARKUP_TO_DROP):
        answer = answer.replace(fragment, "")
    return answer


def unwrap_wrappers(answer: str) -> str:
    """Strip wrappers (docs/algorithm.md s1: "drop ... `\\text{..}` ... `\\boxed{}` wrappers").

    In order: keep only the first inline ``$..$`` block of a line (re-wrapped in ``$`` so that
    the final ``$`` removal is uniform); unwrap ``\\text{}``, ``\\textbf{}`` and ``\\overline{}``;
    unwrap ``\\boxed{..}`` up to the LAST closing brace of its line, so
    ``\\boxed{\\frac{1}{2}}`` keeps its braces. As in the reference, no wrapper spans a newline
    (an answer line has none; a ground truth may). Linear time in ``len(answer)``.
    """
    answer = _INLINE_MATH.sub(r"$\1$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(_content_or_unchanged, answer)
    return _BOXED.sub(_content_or_unchanged, answer)


def _content_or_unchanged(match: re.Match[str]) -> str:
    """The wrapper's content (group 1), or the matched text itself when nothing was unwrapped."""
    content = match.group(1)
    return match.group(0) if content is None else content


def fix_shorthand_tex(answer: str) -> str:
    """Brace TeX shorthand (docs/algorithm.md s1: "fix `\\fracab`->`\\frac{a}{b}`,
    `\\sqrta`->`\\sqrt{a}`").

    Only the single characters right after ``frac`` / ``sqrt`` are braced, as in Minerva:
    ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``.
    """
    answer = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", answer)
    return _SQRT_SHORTHAND.sub(r"sqrt{\1}", answer)


def drop_dollars(answer: str) -> str:
    """Remove every remaining ``$`` (docs/algorithm.md s1:
    the math-mode delimiters carry no value)."""
    return answer.replace("$", "")


def strip_trailing_period(answer: str) -> str:
    """Remove one trailing ``.`` (a sentence end, not part of the value; not in the reference)."""
    answer = answer.strip()
    return answer[:-1] if answer.endswith(".") else answer


def drop_thousands_commas(answer: str) -> str:
    """``"1,000"`` -> ``"1000"`` for a whole string that is one grouped number
    (docs/algorithm.md s1).

    Anything else (``"1,2"``, ``"(1,000, 2)"``) keeps its commas.
    """
    if _GROUPED_NUMBER.fullmatch(answer):
        return answer.replace(",", "")
    return answer


def drop_digit_commas_reference(answer: str) -> str:
    """The reference's comma rule: drop every comma when the rest is digits (``str.isdigit``).

    ``"1,2,3"`` -> ``"123"``, ``"1,000"`` -> ``"1000"``; ``"-1,000"`` (the sign), ``"1,000.5"``
    (the point) and ``" 1,000"`` (the whitespace, stripped only afterwards) keep their commas.
    ``isdigit`` also accepts other digits, such as ``"²"`` and ``"١٢"``.
    """
    if answer.replace(",", "").isdigit():
        return answer.replace(",", "")
    return answer


def minerva_steps(answer: str) -> str:
    """The steps both normalisations share, in order: ``=``, substitutions, units, wrappers, TeX."""
    answer = keep_after_last_equals(answer)
    answer = apply_substitutions(answer)
    answer = drop_units_and_markup(answer)
    answer = unwrap_wrappers(answer)
    answer = fix_shorthand_tex(answer)
    return drop_dollars(answer)


def normalize_answer(answer: str) -> str:
    """Normalise an answer or a ground truth for the "dapo-strict" verifier (docs/algorithm.md s1).

    ``minerva_steps``, then one trailing ``.`` stripped and thousands commas dropped from a
    grouped number: the two departures from ``normalize_answer_reference`` (module docstring).

    Args:
        answer: the text captured after ``Answer:``, or the ground truth.

    Returns:
        The normalised string, with surrounding whitespace stripped.
    """
    answer = strip_trailing_period(minerva_steps(answer))
    return drop_thousands_commas(answer.strip()).strip()


def normalize_answer_reference(answer: str) -> str:
    """Normalise an answer or a ground truth exactly as the reference code does
    (docs/algorithm.md s1).

    ``minerva_steps``, then ``drop_digit_commas_reference``, then surrounding whitespace
    stripped. A trailing ``.`` is kept: ``"42."`` does not equal ``"42"``.
    """
    return drop_digit_commas_reference(minerva_steps(answer)).strip()
