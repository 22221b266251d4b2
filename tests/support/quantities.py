"""Quantity strings and whether the API server's `isQuantity` accepts them, edge cases included."""

from __future__ import annotations

# (string, accepted): the integration tier checks every line against the real API server.
QUANTITIES: list[tuple[str, bool]] = [
    ("1e3", True), ("500m", True), ("1.5Gi", True), ("100u", True), ("12n", True), ("0.5", True), ("+1", True),
    ("-1", True), ("0", True), ("00", True), ("1.", True), (".5", True), ("1.G", True), ("1E", True),
    ("1Ki", True), ("1e-3", True), ("1E+3", True), ("16Gi", True), ("4", True), ("1500m", True), ("1.5Ki", True),
    ("999999999999999999999", True), ("0.000000001", True), ("1e9999999999", True), ("Ti", True), ("Gi", True),
    ("k", True), (".", True), ("+", True), ("-0.5m", True),
    ("", False), ("1e", False), ("1EE", False), ("1ki", False), ("abc", False), ("1 Gi", False), (" 1", False),
    ("1Gi ", False), ("0x10", False), ("1_000", False), ("Pi", False), ("Ei", False), ("+.e-10", False),
    ("1e3Gi", False), ("1.2.3", False), ("--1", False), ("1K", False), ("1mi", False), ("1e1.5", False),
    ("\u0661", False), ("1e99999999999999999999", False),
]  # fmt: skip
