"""The kubelet's endpoints for the node agent's pods, so that `kubectl logs`, `sharded logs` and
`sharded port-forward` work on the local stack exactly as on a cluster: the API server proxies
`GET /containerLogs/<namespace>/<pod>/<container>?follow=true&tailLines=N` and the WebSocket upgrade of
`GET /portForward/<namespace>/<pod>?port=P` to the node's kubelet port.

TLS both ways, as a kubelet does it: this server presents a certificate from the local cluster's CA (the
API server verifies it with --kubelet-certificate-authority) and accepts only clients with a certificate
from that CA (the API server's --kubelet-client-certificate). Bound to loopback.

Port-forward speaks the kubelet's WebSocket protocol (`v4.channel.k8s.io`, what the Python client and
API-server proxies use): two channels per port, data (2i) and error (2i+1), each opened by a frame holding
the port (2 bytes, little-endian); every later binary frame is its channel byte and then data. Each port
is a TCP connection to 127.0.0.1:<port> inside the pod's network namespace, as the kubelet makes it, so a
server the pod binds to loopback only (JupyterLab without a token) is reachable through the API server's
authorization and from nowhere else.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import select
import ssl
import struct
import subprocess
import sys
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
# (namespace, pod) -> the network namespace of its running sandbox, or None if it does not run here
Netns = Callable[[str, str], str | None]
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PORT_FORWARD_PROTOCOLS = ("v4.channel.k8s.io", "")  # binary channels; not the base64 variant
MAX_FRAME = 16 << 20  # a client frame larger than this ends the stream
MAX_PORTS = 16
# Run inside the pod's network namespace: one TCP connection to the pod's port, its bytes on stdin/stdout.
RELAY = """
import os, socket, sys, threading
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
except OSError as e:
    sys.stderr.write(f"error forwarding port {sys.argv[1]} to pod: {e}"); sys.exit(1)
s.settimeout(None)
def up():
    while b := os.read(0, 65536):
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while b := s.recv(65536):
    os.write(1, b)
"""


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
    """Serves container logs and port-forwards until stop(); `port` is what the node advertises as its kubelet
    endpoint."""

    def __init__(self, pki: Path, locate: Locate, netns: Netns):
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

        self.locate, self.netns = locate, netns
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
        if len(parts) != 4 or parts[0] != "containerLogs":
            req.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> and /portForward are served here")
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

    # --- port-forward -----------------------------------------------------------------------------
    def _port_forward(self, req: BaseHTTPRequestHandler, namespace: str, pod: str, values: list[str]) -> None:
        ports = requested_ports(values)
        if ports is None:
            req.send_error(400, f"ports: give 1 to {MAX_PORTS} port numbers (1-65535)")
            return
        key = req.headers.get("Sec-WebSocket-Key")
        if req.headers.get("Upgrade", "").lower() != "websocket" or not key:
            req.send_error(400, "port-forward is served over WebSocket (v4.channel.k8s.io) only")
            return
        offered = [p.strip() for p in req.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        protocol = next((p for p in PORT_FORWARD_PROTOCOLS if p in offered), None)
        if protocol is None:
            req.send_error(400, f"none of the WebSocket protocols {offered} is served; use v4.channel.k8s.io")
            return
        netns = self.netns(namespace, pod)
        if netns is None:
            req.send_error(404, f"pod {namespace}/{pod} does not run on this node")
            return
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        head = ["HTTP/1.1 101 Switching Protocols", "Upgrade: websocket", "Connection: Upgrade",
                f"Sec-WebSocket-Accept: {accept}"] + ([f"Sec-WebSocket-Protocol: {protocol}"] if protocol else [])
        req.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode())
        req.wfile.flush()
        req.close_connection = True
        Forward(req.connection, netns, ports, self._stop).run()


class Forward:
    """One port-forward stream: WebSocket frames from the client to one relay process per port (inside the
    pod's network namespace) and back. One thread does all reads and writes of the TLS socket: an SSL
    connection is not safe to read and write from two threads at once."""

    def __init__(self, conn: ssl.SSLSocket, netns: str, ports: list[int], stop: threading.Event):
        self.conn, self.stop = conn, stop
        self.relays = [
            subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-c", RELAY, str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
            )
            for port in ports
        ]
        self.ports = ports
        self.buf = b""
        self.frames: list[bytes] = []  # a fragmented message's parts so far

    def run(self) -> None:
        try:
            for i, port in enumerate(self.ports):  # each channel opens with its port number
                self.send(bytes([2 * i]) + struct.pack("<H", port))
                self.send(bytes([2 * i + 1]) + struct.pack("<H", port))
            self._loop()
        except (OSError, ssl.SSLError, ValueError):
            pass  # the client went away, or broke the protocol: end the stream
        finally:
            for relay in self.relays:
                relay.kill()
                relay.wait()
            with contextlib.suppress(OSError, ssl.SSLError):
                self.send(struct.pack("!H", 1000), opcode=0x8)

    def _loop(self) -> None:
        open_relays = {relay.stdout.fileno(): i for i, relay in enumerate(self.relays)}
        while open_relays and not self.stop.is_set():
            ready = [self.conn] if self.conn.pending() else select.select([self.conn, *open_relays], [], [], 1.0)[0]
            for source in ready:
                if source is self.conn:
                    data = self.conn.recv(1 << 16)
                    if not data:
                        return
                    self.buf += data
                    if not self._frames_in():
                        return  # a close frame
                    continue
                i = open_relays[source]
                data = os.read(source, 1 << 16)
                if data:
                    self.send(bytes([2 * i]) + data)
                    continue
                # The pod's side ended: say why on the error channel if the relay failed, then close it.
                error = self.relays[i].stderr.read().decode(errors="replace").strip()
                if self.relays[i].wait() != 0 and error:
                    self.send(bytes([2 * i + 1]) + error[-1000:].encode())
                del open_relays[source]

    def _frames_in(self) -> bool:
        """Handle every whole frame in the buffer; False once the client sent a close frame."""
        while len(self.buf) >= 2:
            b0, b1 = self.buf[0], self.buf[1]
            length, at = b1 & 0x7F, 2
            if length == 126:
                if len(self.buf) < 4:
                    return True
                length, at = struct.unpack("!H", self.buf[2:4])[0], 4
            elif length == 127:
                if len(self.buf) < 10:
                    return True
                length, at = struct.unpack("!Q", self.buf[2:10])[0], 10
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes")
            masked = b1 & 0x80
            end = at + (4 if masked else 0) + length
            if len(self.buf) < end:
                return True
            payload = self.buf[end - length : end]
            if masked:  # clients mask every frame: XOR with the 4-byte key, as one big integer
                key = (self.buf[at : at + 4] * (length // 4 + 1))[:length]
                payload = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(length, "big")
            self.buf = self.buf[end:]
            opcode, fin = b0 & 0x0F, b0 & 0x80
            if opcode == 0x8:
                return False
            if opcode == 0x9:
                self.send(payload, opcode=0xA)
                continue
            if opcode in (0x0, 0x1, 0x2):
                self.frames.append(payload)
                if fin:
                    self._deliver(b"".join(self.frames))
                    self.frames = []
        return True

    def _deliver(self, message: bytes) -> None:
        if not message:
            return
        channel, data = message[0], message[1:]
        if channel % 2 or channel // 2 >= len(self.relays):
            return  # the error channels are the server's to write
        relay = self.relays[channel // 2]
        if relay.poll() is None and data:
            with contextlib.suppress(BrokenPipeError):
                relay.stdin.write(data)

    def send(self, payload: bytes, opcode: int = 0x2) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode]) + (
            bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 1 << 16
            else bytes([127]) + struct.pack("!Q", n)
        )  # fmt: skip
        self.conn.sendall(head + payload)
