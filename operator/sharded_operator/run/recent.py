"""What this operator wrote that its watches have not shown yet: the pods it created, the status it wrote.

Reconcile decides from what the watches delivered (kopf's indexes), which lags the API server by the
time an event takes to arrive. Deciding from a view older than one's own writes would create a pod twice
(harmless: the API server says it exists) or, worse, judge a job by a status it already moved past: a
restart counted twice, the new attempt's pods deleted as an old attempt's. So each write is laid over the
watched view until the watch shows it (client-go's "expectations" for pods). Only the Lease holder
reconciles and only it writes the fields it owns, so its last write is the newest value of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sharded_operator.decide.views import PodView

# A write the watch never showed (the pod was deleted before its event came) is dropped after this long.
# Long enough for a watch that lags behind a burst: an operator whose events arrive a minute late must not
# take the pods it just created for deleted ones and restart healthy gangs (measured: a slowed operator, a
# minute behind, did so under a 60 s keep). client-go keeps its controllers' expectations as long.
KEEP_SECONDS = 300.0


class Recent:
    def __init__(self, clock: Callable[[], float] = time.monotonic, keep: float = KEEP_SECONDS) -> None:
        self.clock, self.keep = clock, keep
        self._lock = threading.Lock()  # reconciles write from worker threads; events read on the loop
        self._pods: dict[str, dict[str, tuple[float, PodView]]] = {}  # "ns/job" -> pod uid -> (when, view)
        self._status: dict[str, tuple[float, dict[str, Any], str | None]] = {}  # uid -> (when, owned status, version)

    def pod_created(self, key: str, view: PodView) -> None:
        with self._lock:
            self._pods.setdefault(key, {})[view.uid or view.name] = (self.clock(), view)

    def pod_gone(self, key: str, uid: str | None) -> None:
        with self._lock:
            if uid and (pods := self._pods.get(key)):
                pods.pop(uid, None)

    def pods(self, key: str, watched: list[PodView]) -> list[PodView]:
        """The watched pods of a job, and those it created that the watch does not show yet."""
        with self._lock:
            pods = self._pods.get(key)
            if not pods:
                return watched
            seen, old = {p.uid for p in watched}, self.clock() - self.keep
            for uid in [u for u, (when, _) in pods.items() if u in seen or when < old]:
                del pods[uid]
            if not pods:
                del self._pods[key]
            return watched + [view for _, view in (pods or {}).values()]

    def status_written(self, uid: str, owned: dict[str, Any], version: str | None = None) -> None:
        with self._lock:
            self._status[uid] = (self.clock(), owned, version)

    def version(self, uid: str, watched: str | None) -> str | None:
        """The resourceVersion the next decision is taken over: that of this operator's last status write
        while the watch has not shown it (the watched one is older than what the decision sees)."""
        with self._lock:
            written = self._status.get(uid)
            return written[2] if written is not None and written[2] is not None else watched

    def status(self, uid: str, watched: dict[str, Any], owned: Callable[[dict[str, Any]], dict[str, Any]]
               ) -> dict[str, Any]:  # fmt: skip
        """The watched status with the fields this operator owns as it last wrote them (until the watch
        shows that write: then the watched status is as new)."""
        with self._lock:
            written = self._status.get(uid)
            if written is None:
                return watched
            when, fields, _ = written
            if owned(watched) == fields or when < self.clock() - self.keep:
                del self._status[uid]
                return watched
            return {**{k: v for k, v in watched.items() if k not in owned(watched)}, **fields}

    def forget(self, key: str, uid: str) -> None:
        with self._lock:
            self._pods.pop(key, None)
            self._status.pop(uid, None)

    def clear(self) -> None:
        """Leadership lost: another replica writes from now on, and its writes come through the watch."""
        with self._lock:
            self._pods.clear()
            self._status.clear()
