"""How `k8s.py` reaches the API server: the credentials of the pod's ServiceAccount or of a kubeconfig, and
HTTP requests over urllib3 with them.

The operator does not load the `kubernetes` client package: its generated models and API classes take about
20 MB of every replica's memory, for requests that are plain JSON (see docs/benchmarks-history.md, "What the
operator's memory is"). kopf connects with the same credentials (`handlers.login`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A projected ServiceAccount token is rotated by the kubelet (hourly by default): read it again this often,
# as client-go does.
TOKEN_REREAD_SECONDS = 60.0
EXEC_TIMEOUT_SECONDS = 60.0
# An exec plugin's token is renewed this long before it expires, so that a plugin that fails once (the
# identity provider briefly down) leaves time to try again while the old token still works.
EXEC_RENEW_EARLY_SECONDS = 60.0
# After a renewal failed, the still-valid token is used this long before the next try.
RENEW_RETRY_SECONDS = 5.0


class ConfigError(RuntimeError):
    """No usable credentials: the message names the kubeconfig field or file and what to do."""


class ApiError(Exception):
    """The API server answered with an error status. `body` is its Status object as text (it names the field
    of a rejected object)."""

    def __init__(self, status: int, reason: str = "", body: str = ""):
        super().__init__(f"({status}) {reason}: {body[:500]}" if body else f"({status}) {reason}")
        self.status, self.reason, self.body = status, reason, body


class Unreachable(ConnectionError):
    """No answer: the connection was refused, reset or timed out (the API server restarting, say)."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are. PEM text for the certificates."""

    server: str
    ca: str | None = None
    insecure: bool = False
    cert: str | None = None
    key: str | None = None
    token: str | None = None
    username: str | None = None
    password: str | None = None
    proxy: str | None = None
    namespace: str | None = None
    expires: float | None = None  # time.time() after which the token no longer works (None: not known)
    renew_at: float | None = None  # time.time() after which `renew` gives fresh ones (a rotated token)
    renew: Callable[[], Credentials] | None = dataclasses.field(default=None, compare=False, repr=False)

    def headers(self) -> dict[str, str]:
        if self.token:
            return {"Authorization": f"Bearer {self.token}"}
        if self.username is not None and self.password is not None:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {}

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.ca) if self.ca else ssl.create_default_context()
        if self.cert and self.key:
            # Python's ssl loads a client certificate only from files: they exist while it is read.
            with tempfile.TemporaryDirectory(prefix="sharded-tls-") as d:
                cert, key = Path(d) / "tls.crt", Path(d) / "tls.key"
                for path, text in ((cert, self.cert), (key, self.key)):
                    path.touch(mode=0o600)
                    path.write_text(text)
                context.load_cert_chain(cert, key)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def load(kubeconfig: str | None = None) -> Credentials:
    """An explicit kubeconfig; else the pod's ServiceAccount when running in a cluster; else $KUBECONFIG or
    ~/.kube/config, as kubectl reads them."""
    if in_a_cluster(kubeconfig):
        return in_cluster()
    if kubeconfig is None:
        kubeconfig = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    paths = [Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p]
    return from_kubeconfig(paths)


def in_a_cluster(kubeconfig: str | None) -> bool:
    """Whether `load(kubeconfig)` takes the pod's ServiceAccount."""
    return kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (
        SERVICE_ACCOUNT / "token").exists()  # fmt: skip


def in_cluster() -> Credentials:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    token = (SERVICE_ACCOUNT / "token").read_text().strip()
    if not token:
        raise ConfigError(f"{SERVICE_ACCOUNT / 'token'} is empty: mount the ServiceAccount token")
    ca = SERVICE_ACCOUNT / "ca.crt"
    namespace = SERVICE_ACCOUNT / "namespace"
    return Credentials(
        server=f"https://{host}:{port}", ca=ca.read_text() if ca.exists() else None, token=token,
        namespace=namespace.read_text().strip() if namespace.exists() else None,
        renew_at=time.time() + TOKEN_REREAD_SECONDS, renew=in_cluster,
    )  # fmt: skip


def _named(config: dict[str, Any], section: str, path: Path) -> dict[str, dict[str, Any]]:
    items = config.get(section) or []
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        raise ConfigError(f"kubeconfig {path}: `{section}` must be a list of entries, each with a name")
    key = section[:-1]  # clusters -> cluster
    return {i["name"]: {**(i.get(key) or {}), "_dir": path.parent} for i in items}


def from_kubeconfig(paths: list[Path]) -> Credentials:
    """The current context's cluster and user. Several files merge as kubectl merges them: the first file
    to name an entry, or to set the current context, wins."""
    current, contexts, clusters, users = None, {}, {}, {}
    for path in paths:
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"kubeconfig {path}: {e.strerror}; set --kubeconfig or KUBECONFIG") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"kubeconfig {path} is not YAML: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"kubeconfig {path} is not a kubeconfig (a mapping with clusters, users, contexts)")
        current = current or config.get("current-context")
        for merged, section in ((contexts, "contexts"), (clusters, "clusters"), (users, "users")):
            merged.update({k: v for k, v in _named(config, section, path).items() if k not in merged})
    where = ", ".join(map(str, paths))
    if not current:
        raise ConfigError(f"kubeconfig {where}: no current-context; choose one with `kubectl config use-context`")
    if current not in contexts:
        raise ConfigError(f"kubeconfig {where}: current-context {current!r} is not among its contexts")
    context = contexts[current]
    if context.get("cluster") not in clusters:
        raise ConfigError(f"kubeconfig {where}: context {current!r} names cluster {context.get('cluster')!r}, "
                          f"which is not defined")  # fmt: skip
    if context.get("user") not in users:
        raise ConfigError(f"kubeconfig {where}: context {current!r} names user {context.get('user')!r}, "
                          f"which is not defined")  # fmt: skip
    return _credentials(clusters[context["cluster"]], users[context["user"]], context.get("namespace"))


def _pem(entry: dict[str, Any], field: str) -> str | None:
    """`field-data` (base64) or `field` (a file, relative to the kubeconfig's folder)."""
    if data := entry.get(f"{field}-data"):
        try:
            return base64.b64decode(data, validate=True).decode()
        except (ValueError, TypeError):
            raise ConfigError(f"kubeconfig: {field}-data is not base64 PEM") from None
    if path := entry.get(field):
        try:
            return (entry["_dir"] / Path(path).expanduser()).read_text()
        except OSError as e:
            raise ConfigError(f"kubeconfig: {field} {path}: {e.strerror}") from None
    return None


def _credentials(cluster: dict[str, Any], user: dict[str, Any], namespace: str | None) -> Credentials:
    if not cluster.get("server"):
        raise ConfigError("kubeconfig: the context's cluster has no server")
    if cluster.get("tls-server-name"):
        raise ConfigError("kubeconfig: clusters[].cluster.tls-server-name is not supported; use a server name "
                          "the API server's certificate holds")  # fmt: skip
    base = Credentials(
        server=cluster["server"].rstrip("/"), ca=_pem(cluster, "certificate-authority"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")), proxy=cluster.get("proxy-url"), namespace=namespace,
        cert=_pem(user, "client-certificate"), key=_pem(user, "client-key"),
        username=user.get("username"), password=user.get("password"), token=user.get("token"),
    )  # fmt: skip
    if base.token:
        return base
    if token_file := user.get("tokenFile"):

        def reread() -> Credentials:
            token = (user["_dir"] / Path(token_file).expanduser()).read_text().strip()
            return dataclasses.replace(base, token=token, renew_at=time.time() + TOKEN_REREAD_SECONDS, renew=reread)

        return reread()
    if exec_ := user.get("exec"):

        def run() -> Credentials:
            return _exec_plugin(base, exec_, user["_dir"], run)

        return run()
    if provider := user.get("auth-provider"):
        if token := ((provider.get("config") or {}).get("access-token")):
            return dataclasses.replace(base, token=token)
        raise ConfigError(f"kubeconfig: auth-provider {provider.get('name')!r} without an access-token is not "
                          f"supported; use an exec credential plugin")  # fmt: skip
    return base


def _exec_plugin(
    base: Credentials, spec: dict[str, Any], folder: Path, again: Callable[[], Credentials]
) -> Credentials:
    """Run a client-go credential plugin (`users[].user.exec`, as kubectl does for EKS, GKE, AKS, OIDC)."""
    command = spec.get("command")
    if not command:
        raise ConfigError("kubeconfig: users[].user.exec has no command")
    env = {**os.environ, **{e["name"]: e["value"] for e in spec.get("env") or []}}
    info = {"apiVersion": spec.get("apiVersion", "client.authentication.k8s.io/v1"), "kind": "ExecCredential",
            "spec": {"interactive": False}}  # fmt: skip
    env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
    try:
        done = subprocess.run(
            [command, *(spec.get("args") or [])], env=env, cwd=folder, capture_output=True, text=True,
            timeout=EXEC_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"kubeconfig: the credential plugin {command!r} did not run: {e}") from None
    if done.returncode != 0:
        raise ConfigError(f"kubeconfig: the credential plugin {command!r} exited {done.returncode}: "
                          f"{done.stderr.strip()[-500:]}")  # fmt: skip
    try:
        status = json.loads(done.stdout)["status"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"kubeconfig: the credential plugin {command!r} printed no ExecCredential") from None
    expires = renew_at = None
    if stamp := status.get("expirationTimestamp"):
        expires = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        renew_at = expires - EXEC_RENEW_EARLY_SECONDS
    return dataclasses.replace(
        base, token=status.get("token"), cert=status.get("clientCertificateData") or base.cert,
        key=status.get("clientKeyData") or base.key, expires=expires, renew_at=renew_at, renew=again,
    )  # fmt: skip


class Transport:
    """Requests to the API server, safe to share between threads. `connections`: the most requests the
    caller's threads have in flight at once (past it a connection is opened and dropped per request).
    `on_request(method, path)` is told of every request sent."""

    def __init__(self, credentials: Credentials, connections: int = 10,
                 on_request: Callable[[str, str], None] | None = None, timeout: float = 60.0,
                 agent: str = "sharded-operator"):  # fmt: skip
        self.connections, self.on_request, self.timeout = max(connections, 1), on_request, timeout
        self.agent = agent  # the User-Agent: with the replica's identity, the API server's audit tells replicas apart
        self._renewing = threading.Lock()  # one renewal (and swap of pool and credentials) at a time
        self._retry_at = 0.0  # time.monotonic() before which a failed renewal is not tried again
        self._use(credentials)

    def _use(self, credentials: Credentials) -> None:
        """Send with `credentials` from now on. The connections stay open unless what they were made with
        changed: a token read again each minute must not cost every thread a new TLS handshake."""
        old = getattr(self, "credentials", None)
        if old is None or _connection(old) != _connection(credentials):
            context = credentials.ssl_context() if credentials.server.startswith("https:") else None
            kw: dict[str, Any] = {"maxsize": self.connections, "ssl_context": context, "retries": False}
            proxy = credentials.proxy
            self.pool = urllib3.ProxyManager(proxy, **kw) if proxy else urllib3.PoolManager(**kw)
        self.credentials = credentials

    def _current(self, stale: Credentials | None = None) -> Credentials:
        """The credentials to send with, renewed when due (or refused: `stale`). The renewal (an exec plugin
        may run for a minute) holds no lock that a request needs: while one thread renews, the others send
        with the current token as long as it still works, and wait for the renewal only when it does not.
        A renewal that fails keeps a token that still works, and is tried again a moment later."""
        c = self.credentials
        if c.renew is None:
            return c
        now = time.time()
        usable = c is not stale and (c.expires is None or now < c.expires)
        if usable and (c.renew_at is None or now < c.renew_at or time.monotonic() < self._retry_at):
            return c
        if not self._renewing.acquire(blocking=not usable):
            return c  # another thread is renewing; this token still works meanwhile
        try:
            if self.credentials is not c:
                return self.credentials  # renewed by another thread while this one waited
            try:
                fresh = c.renew()
            except (ConfigError, OSError, ValueError) as e:
                if not usable:
                    raise
                self._retry_at = time.monotonic() + RENEW_RETRY_SECONDS
                log.warning("renewing the API credentials failed; the current token still works%s: %s",
                            "" if c.expires is None else f" until {dt.datetime.fromtimestamp(c.expires):%H:%M:%S}",
                            e)  # fmt: skip
                return c
            self._use(fresh)
            return fresh
        finally:
            self._renewing.release()

    def request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = -1,
        accept: str = "application/json",
    ) -> urllib3.BaseHTTPResponse:
        """The response, its body unread (read it as it streams, or whole with `json`/`send`; its connection
        goes back to the pool once read). Raises ApiError for an error status, Unreachable when no answer
        came. `timeout`: seconds to wait for each read (-1: the transport's), None for ever."""
        url = path + ("?" + urlencode({k: v for k, v in query.items() if v is not None}) if query else "")
        data = None if body is None else json.dumps(body).encode()
        read = self.timeout if timeout == -1 else timeout
        credentials = self._current()
        for attempt in (1, 2):
            if self.on_request is not None:
                self.on_request(method, path)
            headers = {"Accept": accept, "User-Agent": self.agent, **credentials.headers()}
            if data is not None:
                headers["Content-Type"] = content_type
            try:
                resp = self.pool.request(
                    method, credentials.server + url, body=data, headers=headers, preload_content=False,
                    timeout=urllib3.Timeout(connect=min(10.0, self.timeout), read=read), redirect=False,
                )  # fmt: skip
            except urllib3.exceptions.HTTPError as e:
                raise Unreachable(f"{method} {path}: {e}") from e
            if resp.status < 400:
                return resp
            text = _drained(resp).decode(errors="replace")
            if resp.status == 401 and attempt == 1 and credentials.renew is not None:
                credentials = self._current(stale=credentials)  # a token rotated before we read it again
                continue
            raise ApiError(resp.status, resp.reason or "", text)
        raise AssertionError("unreachable")

    def send(self, method: str, path: str, **kw: Any) -> None:
        """A request whose answer is not needed beyond its status."""
        _drained(self.request(method, path, **kw))

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return json.loads(_drained(self.request(method, path, **kw)) or b"null")


def _connection(c: Credentials) -> tuple[Any, ...]:
    """What a connection is made with (the rest goes in each request's headers)."""
    return c.server, c.ca, c.insecure, c.cert, c.key, c.proxy


def _drained(response: urllib3.BaseHTTPResponse) -> bytes:
    """The whole body, the connection back in the pool."""
    try:
        return response.data
    finally:
        with contextlib.suppress(Exception):
            response.release_conn()
