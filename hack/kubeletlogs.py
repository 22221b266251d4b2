"""The kubelet's container-log endpoint for the node agent's pods, so that `kubectl logs` and `sharded logs`
work on the local stack exactly as on a cluster: the API server proxies
`GET /containerLogs/<namespace>/<pod>/<container>?follow=true&tailLines=N` to the node's kubelet port.

TLS both ways, as a kubelet does it: this server presents a certificate from the local cluster's CA (the
API server verifies it with --kubelet-certificate-authority) and accepts only clients with a certificate
from that CA (the API server's --kubelet-client-certificate). Bound to loopback.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOST = "127.0.0.1"
FOLLOW_POLL_SECONDS = 0.2

# (namespace, pod) -> (the container's log file, whether its process still runs), or None if unknown
Locate = Callable[[str, str], tuple[Path, bool] | None]


def tail_lines(data: bytes, n: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:]) if n > 0 else b""


class LogServer:
    """Serves container logs until stop(); `port` is what the node advertises as its kubelet endpoint."""

    def __init__(self, pki: Path, locate: Locate):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / "kubelet.crt", pki / "kubelet.key")
        context.load_verify_locations(pki / "ca.crt")
        context.verify_mode = ssl.CERT_REQUIRED  # only the API server (a client certificate of our CA) reads logs
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._serve(self)

            def log_message(self, *args) -> None:  # quiet: the API server retries are not news
                pass

        self.locate = locate
        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kubelet-logs", daemon=True)

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            req.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served here")
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
