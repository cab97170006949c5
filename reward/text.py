"""Text hygiene shared by every verifier.

Responses come from a sampler and are untrusted: they may hold lone UTF-16 surrogates (from a
tokenizer decoding half a character, or a JSON ``"\\ud800"`` escape) and NUL bytes. Neither
may crash a verifier, and neither may reach a worker process or a JSON writer unchanged.
"""

from __future__ import annotations

import re

#: A lone surrogate code point. ``json.loads`` joins valid pairs, so any left are unpaired.
_SURROGATE = re.compile("[\ud800-\udfff]")

#: What an unpaired surrogate becomes: the Unicode replacement character.
REPLACEMENT_CHAR = "\ufffd"


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
