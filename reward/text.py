"""Text hygiene shared by every verifier.

Responses come from a sampler and are untrusted: they may hold lone UTF-16 surrogates (from a
tokenizer decoding half a character, or a JSON ``"\\ud800"`` escape) and NUL bytes. Neither
may crash a verifier, and neither may reach a worker process or a JSON writer unchanged.

Lengths are bounded before any parsing: a verifier reads only a response's tail (``tail``) and
refuses a ground truth longer than ``GROUND_TRUTH_MAX_CHARS`` (``ground_truth_text``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

#: A lone surrogate code point. ``json.loads`` joins valid pairs, so any left are unpaired.
_SURROGATE = re.compile("[\ud800-\udfff]")

#: What an unpaired surrogate becomes: the Unicode replacement character.
REPLACEMENT_CHAR = "\ufffd"

#: Longest ground truth, in characters, that a verifier accepts. Final answers are short
#: (DAPO-Math-17k's are integers); one this long is a data error, and verifying it costs time
#: that grows with its length (math-verify parses it whole). A longer one is an ``[ERROR]``
#: result with the reason, never a crash.
GROUND_TRUTH_MAX_CHARS: Final = 1024

#: An integer ground truth with more bits than this has more than ``GROUND_TRUTH_MAX_CHARS``
#: decimal digits (each digit carries under 4 bits), so it is refused without the conversion to
#: ``str``, which is quadratic in the digits and raises past Python's 4300-digit limit.
_MAX_INT_BITS: Final = 4 * GROUND_TRUTH_MAX_CHARS


class GroundTruthTooLong(ValueError):
    """A ground truth longer than ``GROUND_TRUTH_MAX_CHARS``; the message gives its length."""


def clean_text(text: str) -> str:
    """Return ``text`` with lone surrogates replaced by U+FFFD and NUL characters removed.

    The result always encodes as strict UTF-8.
    """
    if "\x00" in text:
        text = text.replace("\x00", "")
    return _SURROGATE.sub(REPLACEMENT_CHAR, text)


def tail(text: str, n_chars: int) -> str:
    """Return the last ``n_chars`` characters of ``text``, cleaned (see ``clean_text``).

    The cut comes first, so a 1 MB response costs as much as an ``n_chars`` one.
    """
    if n_chars <= 0:
        raise ValueError(f"n_chars must be > 0, got n_chars={n_chars}")
    return clean_text(text[-n_chars:])


def ground_truth_text(ground_truth: str | int, *, clean: bool = True) -> str:
    """Return ``ground_truth`` as text (integers via ``str``), cleaned unless ``clean=False``.

    ``clean=False`` is for the "dapo-reference" verifier, which compares the raw text as the
    reference does (a NUL byte is part of the value there); the length cap applies either way.

    Raises:
        GroundTruthTooLong: it is longer than ``GROUND_TRUTH_MAX_CHARS`` characters.
    """
    if isinstance(ground_truth, int) and ground_truth.bit_length() > _MAX_INT_BITS:
        raise GroundTruthTooLong(
            f"ground truth is an integer of more than {GROUND_TRUTH_MAX_CHARS} digits "
            f"(GROUND_TRUTH_MAX_CHARS={GROUND_TRUTH_MAX_CHARS})"
        )
    text = str(ground_truth)
    if len(text) > GROUND_TRUTH_MAX_CHARS:
        raise GroundTruthTooLong(
            f"ground truth is {len(text)} characters long, over "
            f"GROUND_TRUTH_MAX_CHARS={GROUND_TRUTH_MAX_CHARS}"
        )
    return clean_text(text) if clean else text


def model_token_ids(token_ids: Sequence[int], tool_spans: Sequence[tuple[int, int]]) -> list[int]:
    """``token_ids`` without the tool results inserted at ``tool_spans`` ([start, end) each,
    increasing): what the model wrote, its turns joined in order. Each turn ends at a tool's
    closing tag, so joining them splits no character."""
    kept: list[int] = []
    start = 0
    for span_start, span_end in tool_spans:
        kept += token_ids[start:span_start]
        start = span_end
    return kept + list(token_ids[start:])
