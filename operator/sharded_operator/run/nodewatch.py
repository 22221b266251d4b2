"""Every node's readiness, from a list and a watch of nodes on a thread of the operator's own.

A kubelet (or KWOK) writes its Node's status every few seconds: a thousand nodes send hundreds of watch
events a second that change nothing a decision reads. Through kopf's per-object machinery each cost about a
millisecond of the event loop that also serves job and pod events; here each is one JSON parse and a
comparison on a thread, and only a change of a node's readiness (or a node gone) reaches the loop.

The watch resumes from the last version it saw (bookmarks keep that version fresh while nothing changes);
when the API server no longer keeps that version (410 Gone) the nodes are listed again and only the
differences are passed on, so a node deleted while the watch was away is still reported gone. So is an event
that cannot be read (it would come back on every resume from the same version), and so is a watch that failed
`STUCK_AFTER` times in a row at one version, whatever the cause.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sharded_operator.decide.views import NodeView
from sharded_operator.run.apicalls import Expired, Malformed
from sharded_operator.run.k8s import Kube

logger = logging.getLogger(__name__)

# The API server ends each watch after this long (a fresh request then, as kopf's watches do); the client
# gives up a minute later on a connection that went silent without closing.
WATCH_SECONDS = 300
RETRY_SECONDS = (1.0, 30.0)
STUCK_AFTER = 3

Changes = dict[str, NodeView | None]  # node name -> its new view, None: the node is gone
# Deleted node names remembered: a churning autoscaled pool must not grow the operator's memory for ever; a
# name forgotten costs one GET of it if a pod still names it.
GONE_KEPT = 10_000


class Gone:
    """Names of nodes the watch saw deleted (or a listing left out), the newest `GONE_KEPT` of them."""

    def __init__(self, kept: int = GONE_KEPT) -> None:
        self.kept, self._names = kept, OrderedDict[str, None]()

    def add(self, name: str) -> None:
        self._names[name] = None
        self._names.move_to_end(name)
        while len(self._names) > self.kept:
            self._names.popitem(last=False)

    def discard(self, name: str) -> None:
        self._names.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)


def carried(old: NodeView | None, new: NodeView) -> NodeView:
    """`new`, keeping when the node stopped being Ready if it has not been Ready since: the node lifecycle
    controller turns a NotReady node Unknown (a new transition time), and the node has been down since the
    first one. (A Ready in between that no event or listing showed is not known: it counts as down.)"""
    if old is not None and not old.ready and old.since and not new.ready and (not new.since or new.since > old.since):
        return NodeView(ready=False, since=old.since)
    return new


def changes(old: dict[str, NodeView], new: dict[str, NodeView]) -> Changes:
    """What differs between two views of the nodes: new or changed nodes with their view, gone ones with None."""
    out: Changes = {name: view for name, view in new.items() if old.get(name) != view}
    out.update({name: None for name in old.keys() - new.keys()})
    return out


class NodeWatch:
    """Follows every node's readiness. `on_listed(views)` is called after each listing with the changes since
    the last one (every node, the first time); `on_change(name, view)` for each change the watch shows (view
    None: deleted); `on_event()` for every watch event, changed or not (the operator counts them). All three
    run on the watch's thread: the operator hands them over to its event loop."""

    def __init__(
        self, kube: Kube, on_listed: Callable[[Changes], None], on_change: Callable[[str, NodeView | None], None],
        on_event: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        self.kube, self.on_listed, self.on_change, self.on_event = kube, on_listed, on_change, on_event
        self.views: dict[str, NodeView] = {}
        self.version: str | None = None  # the last seen: where a dropped watch resumes (None: list first)
        self.stop = threading.Event()

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self.run, name="node-watch", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> None:
        failures, stuck = 0, 0  # in a row; in a row at the same version
        while not self.stop.is_set():
            start = self.version
            try:
                if self.version is None:
                    self.relist()
                self.follow()
                failures = stuck = 0
            except Expired:
                logger.info("the node watch's version expired; listing the nodes again")
                self.version = None
            except Exception as e:  # the API server away, a connection dropped: resume from the last version seen
                stuck = stuck + 1 if self.version == start else 1
                if isinstance(e, Malformed) or stuck >= STUCK_AFTER:
                    self.version, stuck = None, 0  # resuming would fail the same way: list again
                delay = min(RETRY_SECONDS[0] * 2**failures, RETRY_SECONDS[1])
                failures += 1
                if isinstance(e, Malformed):  # what the API server sent, not a fault here: no traceback to read
                    logger.warning("a node event could not be read (%s); listing the nodes again in %.0fs", e, delay)
                else:
                    logger.exception("watching nodes failed; again in %.0fs%s", delay,
                                     " from a fresh listing" if self.version is None else "")  # fmt: skip
                self.stop.wait(delay)

    def relist(self) -> None:
        items, version = self.kube.list_nodes()
        fresh = {name: carried(self.views.get(name), NodeView.from_node(node)) for node in items
                 if (name := _name(node))}  # fmt: skip
        if len(fresh) < len(items):
            logger.warning("%d listed nodes without a name left out", len(items) - len(fresh))
        diff, self.views = changes(self.views, fresh), fresh
        self.on_listed(diff)
        self.version = version

    def follow(self) -> None:
        """Pass on the watch's changes until the API server ends it (or the connection drops)."""
        assert self.version is not None
        for kind, node in self.kube.watch_nodes(self.version, WATCH_SECONDS):
            self.version = _version(node) or self.version
            if kind == "BOOKMARK":
                continue
            self.on_event()
            name = _name(node)
            if name is None or kind not in ("ADDED", "MODIFIED", "DELETED"):
                raise Malformed(f"a {kind!r} node event without a name or of an unknown type")
            view = None if kind == "DELETED" else carried(self.views.get(name), NodeView.from_node(node))
            if self.views.get(name) == view:
                continue  # a heartbeat
            if view is None:
                self.views.pop(name, None)
            else:
                self.views[name] = view
            self.on_change(name, view)
            if self.stop.is_set():
                break


def _version(obj: dict[str, Any]) -> str | None:
    version = _meta(obj).get("resourceVersion")
    return version if isinstance(version, str) and version else None


def _name(obj: Any) -> str | None:
    name = _meta(obj).get("name")
    return name if isinstance(name, str) and name else None


def _meta(obj: Any) -> dict[str, Any]:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    return meta if isinstance(meta, dict) else {}
