"""A TCP proxy on loopback that holds every byte, each way, for `delay` seconds: a slow network (or a slow
API server) between one client and the API server, switched on and off while the client runs."""

from __future__ import annotations

import queue
import socket
import threading
import time


class SlowProxy:
    def __init__(self, upstream: tuple[str, int], delay: float = 0.0):
        self.upstream, self.delay = upstream, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []

    def start(self) -> SlowProxy:
        threading.Thread(target=self._accept, daemon=True, name="slow-proxy").start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                held: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(src, held), daemon=True).start()
                threading.Thread(target=self._send, args=(dst, held), daemon=True).start()

    def _read(self, src: socket.socket, held: queue.Queue) -> None:
        """Each chunk with the time it may go on (the delay as it is when the chunk arrives)."""
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            held.put((time.monotonic() + self.delay, data))
            if not data:
                return

    def _send(self, dst: socket.socket, held: queue.Queue) -> None:
        while True:
            due, data = held.get()
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return
