"""Leader election over a coordination.k8s.io Lease, pure: which replica may act, as client-go elects.

Every replica watches and serves progress reports; only the holder of the Lease reconciles. A holder
renews the Lease every few seconds; another replica takes it over once it has seen the Lease unchanged
for `leaseDurationSeconds`. A holder that cannot renew stops acting `RENEW_DEADLINE` after the start of
its last successful renewal, before anyone else can take over, so two replicas never act at once.

Both clocks are local, as client-go's are: the standby times the Lease from when *it* saw the record
change (`Observed`), never by comparing the holder's renewTime with its own wall clock (a skew of a few
seconds would let it take over from a holder still acting); the holder times its deadline from before
its request was sent, not from when a slow API server answered it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

LEASE_SECONDS = 15
RENEW_DEADLINE = 10  # seconds a holder keeps acting without a successful renewal (< LEASE_SECONDS)
RETRY_SECONDS = 2  # how often every replica tries to acquire or renew
# Each request of a renewal (a read, a write) waits at most this long: two fit within RENEW_DEADLINE, so a
# slow API server costs a renewal, never a holder that acts on past its deadline.
REQUEST_SECONDS = 4.0


def micro_time(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Observed:
    """The Lease record as this replica last saw it change, and when, by its own monotonic clock."""

    def __init__(self) -> None:
        self.record: tuple[Any, ...] | None = None
        self.at: float = 0.0

    def see(self, spec: dict[str, Any], now: float) -> float:
        """Note the record read at `now`; when it last changed."""
        record = tuple(spec.get(k) for k in ("holderIdentity", "renewTime", "acquireTime", "leaseDurationSeconds",
                                             "leaseTransitions"))  # fmt: skip
        if record != self.record:
            self.record, self.at = record, now
        return self.at


def claim(spec: dict[str, Any] | None, me: str, now: dt.datetime, seen: Observed, mono: float) -> dict[str, Any] | None:
    """The Lease spec to write to hold the Lease as `me`, or None while another holder's Lease is valid:
    changed, as this replica has seen it, less than its duration ago (`mono`: now, on `seen`'s clock). `now`
    only stamps the record for readers."""
    spec = spec or {}
    changed = seen.see(spec, mono)
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds") or LEASE_SECONDS
    if holder and holder != me and mono < changed + duration:
        return None
    ours = holder == me
    return {
        "holderIdentity": me,
        "leaseDurationSeconds": LEASE_SECONDS,
        "acquireTime": spec.get("acquireTime") if ours and spec.get("acquireTime") else micro_time(now),
        "renewTime": micro_time(now),
        "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
    }


class Leadership:
    """Whether this replica may act now: it holds the Lease and renewed it within RENEW_DEADLINE."""

    def __init__(self, me: str, enabled: bool = True, clock: Callable[[], dt.datetime] | None = None):
        self.me, self.enabled = me, enabled
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))  # the clock the renewals are timed by
        self.renewed: dt.datetime | None = None

    def acting(self) -> bool:
        """Whether this replica may send the next write of a decision now. A reconcile asks before each of
        its writes, not only when it starts: a request that took seconds (a slow API server) may have run
        past the renew deadline, and from then on the standby may act."""
        return self.leading(self.clock())

    def leading(self, now: dt.datetime) -> bool:
        if not self.enabled:  # a single replica: always acts
            return True
        return self.renewed is not None and (now - self.renewed).total_seconds() < RENEW_DEADLINE

    def record(self, held: bool, started: dt.datetime, now: dt.datetime) -> None:
        """The outcome of one acquire-or-renew sent at `started`: held (written as ours) or not. The deadline
        runs from `started`: the standby may have seen the Lease change any time after it."""
        if held:
            self.renewed = started
        elif self.renewed is not None and not self.leading(now):
            self.renewed = None


class Hearing:
    """Since when this replica has been able to hear every job's progress: acting (it leads), its progress
    server up, and the reports it takes landing in status. The hang and startup timers count from no earlier:
    time in which it could not hear (an operator outage, a standby's wait, the API server away) is no proof
    of a silent gang, so after an outage they start again."""

    def __init__(self) -> None:
        self.since: dt.datetime | None = None

    def hearing(self, now: dt.datetime) -> None:
        if self.since is None:
            self.since = now

    def deaf(self) -> None:
        self.since = None
