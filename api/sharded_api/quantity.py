"""Kubernetes quantities ("16Gi", "500m", "1e3"): exactly the strings the API server's `isQuantity` accepts.

A port of `resource.ParseQuantity` (k8s.io/apimachinery): the same scanner, suffix table and numeric
checks, so that nothing the API server admits fails later in the operator. Values come back as exact
`Decimal`s. The integration tier checks a table of strings against the real API server.
"""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MIN_EMIN, Decimal, localcontext

_DECIMAL_SUFFIXES = {"": 0, "n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_CHARS = set("eEinumkKMGTP")
_INT64_MAX = 2**63 - 1
_GO_INT = re.compile(r"^[+-]?[0-9]+$")  # what strconv.ParseInt(s, 10, 64) accepts, bar overflow


class QuantityError(ValueError):
    """Not a Kubernetes quantity."""


def _scan(s: str) -> tuple[bool, str, str, str, str]:
    """parseQuantityString: (positive, number text with sign, integer digits, fraction digits, suffix)."""
    pos, end, positive = 0, len(s), True
    if pos < end and s[0] in "+-":
        positive = s[0] == "+"
        pos += 1
    while pos < end and s[pos] == "0":  # leading zeros
        pos += 1
    if pos >= end:
        return positive, "0", "0", "", ""
    start = pos
    while pos < end and s[pos].isdigit() and s[pos].isascii():
        pos += 1
    if pos >= end:
        return positive, s, s[start:], "", ""
    num = s[start:pos] or "0"
    denom = ""
    if s[pos] == ".":
        pos += 1
        start = pos
        while pos < end and s[pos].isdigit() and s[pos].isascii():
            pos += 1
        denom = s[start:pos]
        if pos >= end:
            return positive, s, num, denom, ""
    value = s[:pos]
    suffix_start = pos
    while pos < end and s[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and s[pos] in "+-":
        pos += 1
    while pos < end:
        if not (s[pos].isdigit() and s[pos].isascii()):
            raise QuantityError(f"{s!r} is not a quantity: unexpected {s[pos]!r}")
        pos += 1
    return positive, value, num, denom, s[suffix_start:]


def _int64(v: int) -> bool:
    return -_INT64_MAX - 1 <= v <= _INT64_MAX


def _interpret(suffix: str) -> tuple[int, bool]:
    """(exponent, binary) of a suffix: a decimal or binary SI suffix, or e/E and an integer (base 10)."""
    if suffix in _DECIMAL_SUFFIXES:
        return _DECIMAL_SUFFIXES[suffix], False
    if suffix in _BINARY_SUFFIXES:
        return _BINARY_SUFFIXES[suffix], True
    if len(suffix) > 1 and suffix[0] in "eE" and _GO_INT.match(suffix[1:]) and _int64(int(suffix[1:])):
        exponent = int(suffix[1:])
        # Go keeps the exponent in an int32: larger ones wrap around, as the API server's do.
        return (exponent + 2**31) % 2**32 - 2**31, False
    raise QuantityError(f"unknown suffix {suffix!r}")


def parse_quantity(s: str) -> Decimal:
    """The value of a quantity string; QuantityError for anything the API server refuses."""
    if not isinstance(s, str) or not s:
        raise QuantityError("a quantity cannot be empty")
    if s == "0":
        return Decimal(0)
    positive, value, num, denom, suffix = _scan(s)
    exponent, binary = _interpret(suffix)
    # ParseQuantity parses the number part with inf.Dec unless its int64 fast path applies; only the
    # former can fail (a number part without a digit, such as "+." or "."). Replicate when it is taken.
    fast = False
    if binary:
        fast = exponent >= 0 and not denom and 15 - len(num) - int(exponent * 3 / 10) - 1 >= 0
        fast = fast and int(num) * 2**exponent <= _INT64_MAX
    elif 18 - (len(num) + len(denom)) >= 0 and exponent - len(denom) >= -9:
        fast = int(num + denom) <= _INT64_MAX
    digits = value.lstrip("+-")
    if not fast and not any(c.isdigit() for c in digits):
        raise QuantityError(f"{s!r} is not a quantity: no digits")
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 100, MAX_EMAX, MIN_EMIN
        magnitude = Decimal(f"{num}.{denom or '0'}")
        result = magnitude * 2**exponent if binary else magnitude.scaleb(exponent)
        return +result if positive else -result


def is_quantity(s: object) -> bool:
    try:
        parse_quantity(s)  # type: ignore[arg-type]
    except QuantityError:
        return False
    return True


def quantity_value(q: int | str) -> Decimal:
    """An int (as the API accepts for int-or-string fields) or a quantity string, as a number."""
    return Decimal(q) if isinstance(q, int) else parse_quantity(q)


def memory_bytes(text: str) -> float:
    """A memory size as Kubernetes writes one (`80Gi`, `141G`, `1e9`; `m` is milli, as everywhere in
    Kubernetes), a trailing `B` allowed (`80GiB`), as bytes: at least 1 MiB and finite. ValueError otherwise,
    naming the text."""
    t = text.strip()
    try:
        size = float(parse_quantity(t[:-1] if t.endswith("B") and len(t) > 1 and not t[-2].isdigit() else t))
    except (QuantityError, OverflowError):
        size = 0.0
    if not 2**20 <= size < float("inf"):
        raise ValueError(f"{text[:40]!r} is not a memory size: write one such as 80Gi")
    return size
