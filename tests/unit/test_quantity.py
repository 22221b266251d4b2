"""The quantity parser accepts exactly what the API server does (the same table runs against it in integration)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from sharded_api.quantity import QuantityError, is_quantity, parse_quantity
from sharded_operator.render import podspec
from support.jobs import make_job
from support.quantities import QUANTITIES


def test_the_table_is_wide_enough():
    assert len(QUANTITIES) >= 30 and sum(ok for _, ok in QUANTITIES) >= 15 and sum(not ok for _, ok in QUANTITIES) >= 15


@pytest.mark.parametrize("text,accepted", QUANTITIES, ids=[repr(q) for q, _ in QUANTITIES])
def test_the_parser_accepts_what_the_api_server_accepts(text, accepted):
    assert is_quantity(text) is accepted


@pytest.mark.parametrize(
    "text,value",
    [("1e3", 1000), ("500m", Decimal("0.5")), ("1.5Gi", 1536 * 2**20), ("100u", Decimal("0.0001")),
     ("12n", Decimal("1.2e-8")), ("-1", -1), ("1Ki", 1024), ("1E", 10**18), (".5", Decimal("0.5")), ("0", 0)],
)  # fmt: skip
def test_values(text, value):
    assert parse_quantity(text) == value


def test_a_refused_quantity_says_why():
    with pytest.raises(QuantityError, match="unknown suffix 'ki'"):
        parse_quantity("1ki")


def test_shm_from_any_admitted_memory_quantity_is_bounded():
    """Half the pod's memory, even for quantities no node has; nothing the API server admits crashes here."""
    for memory, shm in [("100u", "0"), ("64Gi", str(32 * 2**30)), ("1e9999999999", str((2**63 - 1) // 2))]:
        job = make_job().spec("resources.memory", memory).model()
        assert podspec.shm_size(job) == shm
