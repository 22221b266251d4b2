"""The kubelet's endpoints for the node agent's pods, so that `kubectl logs`, `sharded logs` and
`sharded port-forward` work on the local stack exactly as on a cluster: the API server proxies
`GET /containerLogs/<namespace>/<pod>/<container>?follow=true&tailLines=N` and the WebSocket upgrade of
`GET /portForward/<namespace>/<pod>?port=P` to the node's kubelet port.

TLS both ways, as a kubelet does it: this server presents a certificate from the local cluster's CA (the
API server verifies it with --kubelet-certificate-authority) and accepts only clients with a certificate
from that CA (the API server's --kubelet-client-certificate). Bound to loopback.

Exec (`GET /exec/<namespace>/<pod>/<container>?command=...&input=1&output=1&error=1`, what the API server
sends for `pods/exec`) runs the command in the pod as the kubelet's runtime would, in the pod's network,
mount and UTS namespaces with its environment (process mode) or `docker exec` in its container, and
streams it over the same WebSocket protocol: stdin on channel 0, stdout 1, stderr 2, and the exit as a
Status on channel 3. No TTY.

Port-forward speaks the kubelet's WebSocket protocol (`v4.channel.k8s.io`, what the Python client and
API-server proxies use): two channels per port, data (2i) and error (2i+1), each opened by a frame holding
the port (2 bytes, little-endian); every later binary frame is its channel byte and then data. Each port
is a TCP connection to 127.0.0.1:<port> inside the pod's network namespace, as the kubelet makes it, so a
server the pod binds to loopback only (JupyterLab without a token) is reachable through the API server's
authorization and from nowhere else.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from localstack.streams import Exec, Forward

HOST = "127.0.0.1"
FOLLOW_POLL_SECONDS = 0.2

# (namespace, pod) -> (the container's log file, whether its process still runs), or None if unknown
Locate = Callable[[str, str], tuple[Path, bool] | None]
# (namespace, pod) -> the network namespace of its running sandbox, or None if it does not run here
Netns = Callable[[str, str], str | None]
# (namespace, pod) -> the argv prefix that runs a command inside its running container, or None
Enter = Callable[[str, str], list[str] | None]
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PROTOCOLS = ("v4.channel.k8s.io", "")  # binary channels; not the base64 variant
MAX_COMMAND = 256  # arguments of one exec
MAX_PORTS = 16


def exec_request(query: dict[str, list[str]]) -> tuple[list[str], bool] | str:
    """The command of an exec request and whether it reads stdin, or what is wrong with the request. The API
    server asks with input/output/error/tty; `stdin`/`stdout`/`stderr` are accepted as well."""

    def on(*names: str) -> bool:
        return any(v in ("1", "true", "True") for n in names for v in query.get(n, []))

    command = query.get("command", [])
    if not command or len(command) > MAX_COMMAND or sum(map(len, command)) > 1 << 16:
        return f"command: give 1 to {MAX_COMMAND} arguments, 64 KiB in all"
    if on("tty"):
        return "tty: this node serves exec without a terminal; leave tty off (kubectl exec -i, not -it)"
    return command, on("input", "stdin")


def tail_lines(data: bytes, n: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:]) if n > 0 else b""


def requested_ports(values: list[str]) -> list[int] | None:
    """The ports of a port-forward request (each value may list several, comma-separated); None if any is not a
    port number, or there are none or more than MAX_PORTS."""
    texts = [p.strip() for v in values for p in v.split(",") if p.strip()][: MAX_PORTS + 1]
    numbers = all(len(t) <= 5 and t.isascii() and t.isdigit() and 0 < int(t) < 65536 for t in texts)
    if not numbers or not 0 < len(texts) <= MAX_PORTS:
        return None
    return [int(t) for t in texts]


class KubeletServer:
    """Serves container logs, exec and port-forwards until stop(); `port` is what the node advertises as its
    kubelet endpoint."""

    def __init__(self, pki: Path, locate: Locate, netns: Netns, enter: Enter):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / "kubelet.crt", pki / "kubelet.key")
        context.load_verify_locations(pki / "ca.crt")
        context.verify_mode = ssl.CERT_REQUIRED  # only the API server (a client certificate of our CA) reads logs
        server = self

        class Handler(BaseHTTPRequestHandler):
            rbufsize = 0  # unbuffered: after a WebSocket upgrade no frame bytes may sit in a read buffer

            def do_GET(self) -> None:
                server._serve(self)

            def log_message(self, *args) -> None:  # quiet: the API server retries are not news
                pass

        self.locate, self.netns, self.enter = locate, netns, enter
        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kubelet-server", daemon=True)

    def start(self) -> KubeletServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        parts = url.path.strip("/").split("/")
        if parts[0] == "portForward" and len(parts) in (3, 4):  # /portForward/<namespace>/<pod>[/<uid>]
            query = urllib.parse.parse_qs(url.query)  # the API server asks with `port`, a client of ours `ports`
            self._port_forward(req, parts[1], parts[2], query.get("port", []) + query.get("ports", []))
            return
        if parts[0] == "exec" and len(parts) in (4, 5):  # /exec/<namespace>/<pod>[/<uid>]/<container>
            self._exec(req, parts[1], parts[2], urllib.parse.parse_qs(url.query))
            return
        if len(parts) != 4 or parts[0] != "containerLogs":
            req.send_error(404, "only /containerLogs/<namespace>/<pod>/<container>, /exec and /portForward are served")
            return
        found = self.locate(parts[1], parts[2])
        if found is None:
            req.send_error(404, f"pod {parts[1]}/{parts[2]} has not run on this node")
            return
        query = urllib.parse.parse_qs(url.query)
        follow = query.get("follow", ["false"])[0] == "true"
        tail = int(query["tailLines"][0]) if "tailLines" in query else None
        path, _ = found
        req.send_response(200)
        req.send_header("Content-Type", "text/plain")
        req.end_headers()  # HTTP/1.0: the body ends when the connection closes
        try:
            with open(path, "rb") as f:
                data = f.read()
                req.wfile.write(data if tail is None else tail_lines(data, tail))
                req.wfile.flush()
                while follow and not self._stop.is_set():
                    chunk = f.read()
                    if chunk:
                        req.wfile.write(chunk)
                        req.wfile.flush()
                        continue
                    running = (self.locate(parts[1], parts[2]) or (path, False))[1]
                    if not running:  # the container ended: send what it wrote last, then end the stream
                        req.wfile.write(f.read())
                        break
                    time.sleep(FOLLOW_POLL_SECONDS)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # the reader went away (Ctrl-C on `kubectl logs -f`)

    # --- exec and port-forward: WebSocket streams -----------------------------------------------------
    def _upgrade(self, req: BaseHTTPRequestHandler, what: str) -> str | None:
        """The WebSocket protocol to answer with, or None after refusing the request."""
        if req.headers.get("Upgrade", "").lower() != "websocket" or not req.headers.get("Sec-WebSocket-Key"):
            req.send_error(400, f"{what} is served over WebSocket (v4.channel.k8s.io) only")
            return None
        offered = [p.strip() for p in req.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        protocol = next((p for p in PROTOCOLS if p in offered), None)
        if protocol is None:
            req.send_error(400, f"none of the WebSocket protocols {offered} is served; use v4.channel.k8s.io")
        return protocol

    @staticmethod
    def _switch(req: BaseHTTPRequestHandler, protocol: str) -> None:
        key = req.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        head = [
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Accept: {accept}",
        ] + ([f"Sec-WebSocket-Protocol: {protocol}"] if protocol else [])
        req.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode())
        req.wfile.flush()
        req.close_connection = True

    def _port_forward(self, req: BaseHTTPRequestHandler, namespace: str, pod: str, values: list[str]) -> None:
        ports = requested_ports(values)
        problem = None if ports else f"ports: give 1 to {MAX_PORTS} port numbers (1-65535)"
        self._stream(req, "port-forward", problem, lambda: self.netns(namespace, pod), f"{namespace}/{pod}",
                     lambda netns: Forward(req.connection, netns, ports, self._stop))  # fmt: skip

    def _exec(self, req: BaseHTTPRequestHandler, namespace: str, pod: str, query: dict[str, list[str]]) -> None:
        request = exec_request(query)
        problem = request if isinstance(request, str) else None
        self._stream(req, "exec", problem, lambda: self.enter(namespace, pod), f"{namespace}/{pod}",
                     lambda prefix: Exec(req.connection, [*prefix, *request[0]], request[1], self._stop))  # fmt: skip

    def _stream(self, req: BaseHTTPRequestHandler, what: str, problem: str | None, find: Callable[[], Any],
                pod: str, start: Callable[[Any], Exec | Forward]) -> None:  # fmt: skip
        """Refuse a malformed request, one not over WebSocket and one for a pod that does not run here (before
        switching protocols, so the client reads why); otherwise switch and run the stream to its end."""
        if problem:
            req.send_error(400, problem)
            return
        protocol = self._upgrade(req, what)
        if protocol is None:
            return
        found = find()
        if found is None:
            req.send_error(404, f"pod {pod} does not run on this node")
            return
        self._switch(req, protocol)
        start(found).run()
