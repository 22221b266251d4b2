"""How long ranks that torchrun stops may take to agree on a final checkpoint before leaving without one."""

from __future__ import annotations

import signal

import pytest

from sharded_trainer.train import STOP_AGREE_SECONDS, StopRequest

LOW, HIGH = STOP_AGREE_SECONDS


@pytest.fixture(autouse=True)
def _handlers():
    """StopRequest installs SIGTERM/SIGINT handlers: pytest's own come back after each test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("iterations", "expected"),
    [
        ([], HIGH),  # nothing timed yet (the load, the first step): the most torchrun allows
        ([0.05, 0.02], LOW),  # a tiny model: a frozen peer costs 2 s, not torchrun's 30
        ([0.5, 4.0, 0.5], 9.0),  # twice the slowest iteration (a save included) and a second
        ([0.5, 60.0], HIGH),  # never past torchrun's own kill
    ],
)
def test_the_wait_follows_the_slowest_iteration_within_bounds(iterations, expected):
    stop = StopRequest()
    for seconds in iterations:
        stop.timed(seconds)
    assert stop.agree_seconds() == expected
    assert LOW <= stop.agree_seconds() <= HIGH < 30
