"""The operator's API client (transport.py, k8s.py): credentials as kubectl reads them, tokens renewed when
they rotate or are refused, errors that name what to fix, and a process that never loads the `kubernetes`
package. TLS with client certificates against the real API server is the integration tier's; the in-cluster
ServiceAccount the image tier's."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sharded_operator.run import transport
from sharded_operator.run.apicalls import retrying
from sharded_operator.run.k8s import Kube
from sharded_operator.run.transport import ApiError, ConfigError, Transport, Unreachable

ROOT = Path(__file__).resolve().parents[2]
PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def kubeconfig(tmp_path: Path, user: dict, cluster: dict | None = None, name: str = "kubeconfig", **extra) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster or {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "team-a"}}],
        **extra,
    }))  # fmt: skip
    return path


@pytest.fixture(autouse=True)
def outside_a_cluster(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def test_the_client_keeps_a_connection_for_each_thread_that_may_send(tmp_path):
    # Past the pool's size each request's connection is dropped and the next pays for a TLS handshake.
    path = str(kubeconfig(tmp_path, {"token": "t"}))
    assert Kube.connect(path, connections=41).http.pool.connection_pool_kw["maxsize"] == 41
    assert Kube.connect(path).http.pool.connection_pool_kw["maxsize"] >= 5


def test_kubeconfig_data_files_relative_to_it_and_the_contexts_namespace(tmp_path):
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.crt").write_text(PEM)
    b64 = base64.b64encode(b"client cert").decode()
    path = kubeconfig(tmp_path, {"client-certificate-data": b64, "client-key": "certs/ca.crt"},
                      {"server": "https://api:6443/", "certificate-authority": "certs/ca.crt"})  # fmt: skip
    c = transport.load(str(path))
    assert (c.server, c.ca, c.cert, c.key, c.namespace) == ("https://api:6443", PEM, "client cert", PEM, "team-a")
    assert c.headers() == {}
    assert transport.load(str(kubeconfig(tmp_path, {"username": "a", "password": "b"}))).headers() == {
        "Authorization": "Basic " + base64.b64encode(b"a:b").decode()}  # fmt: skip


def test_several_kubeconfigs_merge_the_first_naming_an_entry_wins(tmp_path, monkeypatch):
    first = kubeconfig(tmp_path, {"token": "first"}, name="one")
    second = kubeconfig(tmp_path, {"token": "second"}, {"server": "https://other:1"}, name="two")
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(first), str(second)]))
    c = transport.load()
    assert (c.server, c.token) == ("https://127.0.0.1:1", "first")


@pytest.mark.parametrize(
    "change, says",
    [
        ({"current-context": ""}, "no current-context"),
        ({"current-context": "elsewhere"}, "current-context 'elsewhere' is not among its contexts"),
        ({"users": []}, "names user 'u', which is not defined"),
        ({"clusters": [{"name": "k", "cluster": {}}]}, "has no server"),
        ({"clusters": "k"}, "`clusters` must be a list"),
        ({"users": [{"name": "u", "user": {"client-key-data": "%%%"}}]}, "client-key-data is not base64"),
        ({"users": [{"name": "u", "user": {"client-key": "missing.key"}}]}, "client-key missing.key"),
        ({"users": [{"name": "u", "user": {"auth-provider": {"name": "gcp"}}}]}, "auth-provider 'gcp'"),
    ],
)
def test_a_kubeconfig_that_cannot_work_names_the_field(tmp_path, change, says):
    path = kubeconfig(tmp_path, {"token": "t"})
    config = {**json.loads(path.read_text()), **change}
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        transport.load(str(path))


def test_a_missing_or_unreadable_kubeconfig_says_so(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        transport.load(str(tmp_path / "absent"))
    (tmp_path / "bad").write_text("clusters: [\n")
    with pytest.raises(ConfigError, match="is not YAML"):
        transport.load(str(tmp_path / "bad"))


def plugin(tmp_path: Path, script: str) -> dict:
    exe = tmp_path / "plugin"
    exe.write_text(f"#!{sys.executable}\n{script}")
    exe.chmod(0o755)
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(exe), "args": ["--x"],
                     "env": [{"name": "PLUGIN_TOKEN", "value": "from-env"}]}}  # fmt: skip


def test_an_exec_plugin_gives_the_token_and_runs_again_when_it_expires(tmp_path):
    count = tmp_path / "runs"
    user = plugin(
        tmp_path,
        f"""
import json, os, sys, pathlib
p = pathlib.Path({str(count)!r}); n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["kind"] == "ExecCredential" and sys.argv[1:] == ["--x"]
print(json.dumps({{"kind": "ExecCredential", "status": {{"token": os.environ["PLUGIN_TOKEN"] + str(n),
                  "expirationTimestamp": "2000-01-01T00:00:00Z"}}}}))
""",
    )
    c = transport.load(str(kubeconfig(tmp_path, user)))
    assert c.token == "from-env1" and c.expires is not None and c.expires < time.time()
    http = Transport(c)
    assert http._current().token == "from-env2"  # expired: the plugin ran again


def counted_plugin(tmp_path: Path, body: str) -> dict:
    """A plugin that counts its runs in `runs` and then runs `body` (with `n`, the run's number, and `soon`,
    an expiry 30 s away: inside the early-renewal window, so every use of the token asks for a new one)."""
    return plugin(
        tmp_path,
        f"""
import json, os, sys, pathlib, time, datetime as dt
p = pathlib.Path({str(tmp_path / "runs")!r}); n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n))
soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
{body}
""",
    )


def test_a_renewal_that_fails_keeps_the_token_that_still_works_and_is_tried_again_later(tmp_path, monkeypatch):
    user = counted_plugin(
        tmp_path,
        """
if n > 1:
    print("the identity provider is down", file=sys.stderr); sys.exit(1)
print(json.dumps({"kind": "ExecCredential", "status": {"token": "first", "expirationTimestamp": soon}}))
""",
    )
    http = Transport(transport.load(str(kubeconfig(tmp_path, user))))
    assert http._current().token == "first"  # due for renewal; the plugin fails; the token is kept
    assert http._current().token == "first"  # not run again at once: a failing plugin is not hammered
    assert (tmp_path / "runs").read_text() == "2"
    monkeypatch.setattr(transport, "RENEW_RETRY_SECONDS", 0.0)
    http._retry_at = 0.0
    assert http._current().token == "first" and (tmp_path / "runs").read_text() == "3"
    # Once the token has expired, or the API server refused it, the failure is the caller's to see.
    with pytest.raises(ConfigError, match="identity provider is down"):
        http._current(stale=http.credentials)
    monkeypatch.setattr(http, "credentials", dataclasses.replace(http.credentials, expires=time.time() - 1))
    with pytest.raises(ConfigError, match="identity provider is down"):
        http._current()


def test_no_request_waits_for_a_plugin_while_the_token_still_works(tmp_path):
    gate = tmp_path / "gate"
    user = counted_plugin(
        tmp_path,
        f"""
while n > 1 and not pathlib.Path({str(gate)!r}).exists():
    time.sleep(0.05)
print(json.dumps({{"kind": "ExecCredential", "status": {{"token": "t" + str(n), "expirationTimestamp": soon}}}}))
""",
    )
    http = Transport(transport.load(str(kubeconfig(tmp_path, user))))
    renewer = threading.Thread(target=http._current)
    renewer.start()  # runs the plugin, which blocks on the gate
    while (tmp_path / "runs").read_text() != "2":
        time.sleep(0.01)
    # Every other thread (the lease's among them) sends with the current token meanwhile, at once.
    assert [http._current().token for _ in range(3)] == ["t1"] * 3
    assert renewer.is_alive()
    gate.touch()
    renewer.join(10)
    assert http.credentials.token == "t2" and (tmp_path / "runs").read_text() == "2"


def test_an_exec_plugin_that_fails_shows_its_error(tmp_path):
    user = plugin(tmp_path, "import sys; print('please run aws sso login', file=sys.stderr); sys.exit(3)")
    with pytest.raises(ConfigError, match="exited 3: please run aws sso login"):
        transport.load(str(kubeconfig(tmp_path, user)))
    user = plugin(tmp_path, "print('not json')")
    with pytest.raises(ConfigError, match="printed no ExecCredential"):
        transport.load(str(kubeconfig(tmp_path, user)))


class Api(BaseHTTPRequestHandler):
    """A loopback HTTP server that answers from `self.server.script`: (status, body) per request, recording
    what each request carried."""

    def _answer(self):
        size = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization"),
                                 self.headers.get("Content-Type"), self.rfile.read(size)))  # fmt: skip
        status, body = self.server.script.pop(0)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    server.script, server.seen = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_a_token_refused_is_read_again_once_and_the_request_sent_again(api, tmp_path):
    token = tmp_path / "token"
    token.write_text("old\n")
    path = kubeconfig(tmp_path, {"tokenFile": str(token)}, {"server": f"http://127.0.0.1:{api.server_port}"})
    sent = []
    kube = Kube(Transport(transport.load(str(path)), on_request=lambda m, p: sent.append((m, p))))
    token.write_text("new\n")  # rotated before the first request
    pool = kube.http.pool
    api.script = [(401, {"message": "Unauthorized"}), (200, {"metadata": {"name": "p"}})]
    assert kube.get_pod("ns", "p") == {"metadata": {"name": "p"}}
    assert [s[2] for s in api.seen] == ["Bearer old", "Bearer new"]
    assert kube.http.pool is pool  # a new token keeps the open connections
    assert sent == [("GET", "/api/v1/namespaces/ns/pods/p")] * 2
    api.script = [(401, {"message": "Unauthorized"}), (401, {"message": "Unauthorized"})]
    with pytest.raises(ApiError) as e:  # refused with the fresh token too: said, not looped on
        kube.get_pod("ns", "p")
    assert e.value.status == 401


def test_requests_carry_json_the_patch_type_and_query_and_errors_keep_the_servers_message(api, tmp_path):
    path = kubeconfig(tmp_path, {"token": "t"}, {"server": f"http://127.0.0.1:{api.server_port}"})
    kube = Kube.connect(str(path))
    api.script = [(200, {}), (200, {})]
    assert kube.patch_status("ns", "job", {"phase": "Running"}, uid="u1", before={"phase": "Pending", "x": 1})
    kube.delete_job("ns", "job")
    method, url, auth, ctype, body = api.seen[0]
    assert (method, url, auth, ctype) == (
        "PATCH", "/apis/training.sharded.dev/v1alpha1/namespaces/ns/shardedtrainingjobs/job/status", "Bearer t",
        "application/json-patch+json")  # fmt: skip
    assert json.loads(body) == [{"op": "test", "path": "/metadata/uid", "value": "u1"},
                                {"op": "add", "path": "/status/phase", "value": "Running"},
                                {"op": "remove", "path": "/status/x"}]  # fmt: skip
    assert api.seen[1][:2] == ("DELETE", "/apis/training.sharded.dev/v1alpha1/namespaces/ns/shardedtrainingjobs/"
                                         "job?propagationPolicy=Background")  # fmt: skip
    invalid = {"kind": "Status", "reason": "Invalid", "message": "spec.containers[0].image: Required value"}
    api.script = [(422, invalid), (409, {"reason": "AlreadyExists"}), (404, {}), (200, {"status": {"ok": 1}})]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}
    with pytest.raises(Exception, match=r"spec.containers\[0\].image: Required value") as refused:
        kube.create("ns", pod)
    assert type(refused.value).__name__ == "Refused" and refused.value.reason == "Invalid"
    assert kube.create("ns", pod) is None  # exists already: done
    assert kube.get_job("ns", "gone") is None
    assert kube.token_review("tok", "aud") == {"ok": 1}


def test_a_server_that_does_not_answer_is_unreachable_and_retried_as_a_dropped_connection(tmp_path):
    path = kubeconfig(tmp_path, {"token": "t"}, {"server": "http://127.0.0.1:9"})  # discard port: refused
    http = Transport(transport.load(str(path)))
    calls = []

    @retrying
    def get():
        calls.append(1)
        return http.json("GET", "/api/v1/nodes")

    with pytest.raises(Unreachable, match="GET /api/v1/nodes"):
        get()
    assert len(calls) == 5 and isinstance(Unreachable(), OSError)


def test_the_operator_process_never_loads_the_kubernetes_package():
    """kopf imports it when installed; `python -m sharded_operator` hides it while kopf loads."""
    code = ("import sys, sharded_operator.__main__, sharded_operator.run.handlers; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "trainer")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
