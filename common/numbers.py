"""Whole numbers from query parameters: ASCII digits only, of bounded length.

`str.isdigit()` is true for "²" and other digits `int()` refuses (a 500), and `int()` refuses a
string of more than 4300 digits; `whole_number` reads only what a person or a link could mean, and
says None for anything else, so the view answers a 400 naming the parameter.
"""

import re

# Longer numbers are past anything a page, attempt, rank or id of this portal can be.
MAX_DIGITS = 18
_DIGITS_RE = re.compile(r"[0-9]+")


def whole_number(raw, *, max_digits: int = MAX_DIGITS) -> int | None:
    """The int that `raw` spells in ASCII digits (0-9, at most `max_digits` of them), else None."""
    if not isinstance(raw, str) or not _DIGITS_RE.fullmatch(raw):
        return None
    significant = raw.lstrip("0") or "0"  # leading zeros count against int()'s limit too
    return int(significant) if len(significant) <= max_digits else None
