"""Leader election over a coordination.k8s.io Lease, pure: which replica may act, as client-go elects.

Every replica watches and serves progress reports; only the holder of the Lease reconciles. A holder
renews the Lease every few seconds; another replica takes it over once it has not been renewed for
`leaseDurationSeconds`. A holder that cannot renew stops acting after `RENEW_DEADLINE` of that, before
anyone else can take over, so two replicas never act at once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

LEASE_SECONDS = 15
RENEW_DEADLINE = 10  # seconds a holder keeps acting without a successful renewal (< LEASE_SECONDS)
RETRY_SECONDS = 2  # how often every replica tries to acquire or renew


def micro_time(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def claim(spec: dict[str, Any] | None, me: str, now: dt.datetime) -> dict[str, Any] | None:
    """The Lease spec to write to hold the Lease as `me`, or None while another holder's Lease is valid."""
    spec = spec or {}
    holder = spec.get("holderIdentity")
    renewed = parse_micro_time(spec.get("renewTime"))
    duration = spec.get("leaseDurationSeconds") or LEASE_SECONDS
    if holder and holder != me and renewed and now < renewed + dt.timedelta(seconds=duration):
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

    def __init__(self, me: str, enabled: bool = True):
        self.me, self.enabled = me, enabled
        self.renewed: dt.datetime | None = None

    def leading(self, now: dt.datetime) -> bool:
        if not self.enabled:  # a single replica: always acts
            return True
        return self.renewed is not None and (now - self.renewed).total_seconds() < RENEW_DEADLINE

    def record(self, held: bool, now: dt.datetime) -> None:
        """The outcome of one acquire-or-renew: held (written as ours) or not."""
        if held:
            self.renewed = now
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
