"""The vocabulary of API requests: paths, retries of transient failures, streamed lines, and the outcomes a
caller of `k8s` tells apart (a write that landed, a stale decision, an expired watch, a refused create)."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sharded_operator.run.transport import ApiError

T = TypeVar("T")
_TRANSIENT = {429, 500, 502, 503, 504}


def retrying(fn: Callable[..., T]) -> Callable[..., T]:
    """Retry throttling, server errors and dropped connections with exponential backoff."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        delay = 0.2
        for attempt in range(5):
            try:
                return fn(*args, **kwargs)
            except ApiError as e:
                if e.status not in _TRANSIENT or attempt == 4:
                    raise
            except OSError:  # connection reset / refused while the API server restarts (Unreachable)
                if attempt == 4:
                    raise
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    return wrapper


def resource_of(url: str) -> str:
    """The resource (and subresource) a request URL names: pods, shardedtrainingjobs/status, leases..."""
    parts = urlsplit(url).path.strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]
    if not rest:
        return "-"
    return f"{rest[0]}/{rest[2]}" if len(rest) > 2 else rest[0]


def path(api: str, namespace: str | None, resource: str, name: str | None = None, sub: str | None = None) -> str:
    """/api/v1/namespaces/ns/pods/name/log: `api` is "api/v1" or "apis/<group>/<version>"."""
    parts = [api, *(("namespaces", namespace) if namespace else ()), resource, *((name,) if name else ()),
             *((sub,) if sub else ())]  # fmt: skip
    return "/" + "/".join(parts)


def api_of(api_version: str) -> str:
    return "api/v1" if api_version == "v1" else f"apis/{api_version}"


def stream_lines(response: Any) -> Iterator[bytes]:
    """A streamed response line by line as it arrives, its connection released at the end."""
    try:
        pending = b""
        for chunk in response.stream(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            yield from lines
        if pending:
            yield pending
    finally:
        response.release_conn()


@dataclass(frozen=True)
class Written:
    """A status write that landed, and the job's resourceVersion after it (None if the response had none)."""

    resource_version: str | None


class Stale(RuntimeError):
    """A decision's status write refused: the job changed since the version it was decided from."""


class Expired(RuntimeError):
    """A watch's resourceVersion is older than the API server keeps (410 Gone): list again."""


class Malformed(ValueError):
    """A watch event that cannot be read. Resuming from the same version would bring it back each time:
    list again, from a newer version."""


class MissingAPI(RuntimeError):
    """An API the job asks for (e.g. a PodGroup CRD) does not exist in the cluster."""


class Refused(RuntimeError):
    """The API server refused to create a child: Pod Security, a quota, a webhook, an invalid object."""

    def __init__(self, kind: str, name: str, reason: str, message: str):
        super().__init__(f"{kind} {name}: {message}")
        self.kind, self.name, self.reason, self.message = kind, name, reason, message

    @classmethod
    def from_api(cls, kind: str, name: str, e: ApiError) -> Refused:
        try:
            status = json.loads(e.body or "{}")
        except ValueError:
            status = {}
        return cls(kind, name, status.get("reason") or e.reason or str(e.status), status.get("message") or str(e))
