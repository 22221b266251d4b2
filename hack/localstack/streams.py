"""The kubelet's streaming endpoints from the node side: exec and port-forward over WebSocket channels
(`v4.channel.k8s.io`), each stream served by one thread."""

from __future__ import annotations

import abc
import contextlib
import json
import os
import select
import signal
import ssl
import struct
import subprocess
import sys
import threading

MAX_FRAME = 16 << 20  # a client frame larger than this ends the stream
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


def exit_status(code: int) -> bytes:
    """The v4 error channel's last word, as the kubelet writes it: a Status the client reads its exit code from."""
    if code == 0:
        return json.dumps({"metadata": {}, "status": "Success"}).encode()
    return json.dumps({
        "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
        "message": f"command terminated with non-zero exit code: exit status {code}",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }).encode()  # fmt: skip


class Stream(abc.ABC):
    """A server's side of one WebSocket stream of numbered channels (each binary message is its channel byte,
    then data). One thread does all reads and writes of the TLS socket: an SSL connection is not safe to read
    and write from two threads at once. Subclasses say what a client's message is for and when it ends."""

    def __init__(self, conn: ssl.SSLSocket, stop: threading.Event):
        self.conn, self.stop = conn, stop
        self.buf = b""
        self.frames: list[bytes] = []  # a fragmented message's parts so far

    def client_data(self) -> bool:
        """Read what the client sent and handle its whole messages; False once it closed or went away."""
        data = self.conn.recv(1 << 16)
        if not data:
            return False
        self.buf += data
        return self._frames_in()

    def wait(self, sources: list) -> list:
        """The sources (with the client's socket first) that have something to read, within a second."""
        if self.conn.pending():
            return [self.conn]
        return select.select([self.conn, *sources], [], [], 1.0)[0]

    @abc.abstractmethod
    def deliver(self, channel: int, data: bytes) -> None:
        """Handle one whole message the client sent on `channel`."""

    def close(self) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            self.send(struct.pack("!H", 1000), opcode=0x8)

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
                    message = b"".join(self.frames)
                    self.frames = []
                    if message:
                        self.deliver(message[0], message[1:])
        return True

    def send(self, payload: bytes, opcode: int = 0x2) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode]) + (
            bytes([n]) if n < 126 else bytes([126]) + struct.pack("!H", n) if n < 1 << 16
            else bytes([127]) + struct.pack("!Q", n)
        )  # fmt: skip
        self.conn.sendall(head + payload)


class Exec(Stream):
    """One exec: the command's stdout and stderr to channels 1 and 2, channel 0 to its stdin, and its exit
    status on channel 3 once both outputs ended. A client that goes away kills the command."""

    def __init__(self, conn: ssl.SSLSocket, argv: list[str], stdin: bool, stop: threading.Event):
        super().__init__(conn, stop)
        self.proc: subprocess.Popen | None = None
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, bufsize=0, start_new_session=True,
            )  # fmt: skip
        except OSError as e:  # as a shell says it, with its exit code
            self.error = f"{argv[0]}: {e.strerror}\n"

    def run(self) -> None:
        if self.proc is None:
            with contextlib.suppress(OSError, ssl.SSLError):
                self.send(bytes([2]) + self.error.encode())
                self.send(bytes([3]) + exit_status(127))
            self.close()
            return
        try:
            outputs = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
            while outputs and not self.stop.is_set():
                for source in self.wait(list(outputs)):
                    if source is self.conn:
                        if not self.client_data():
                            return
                        continue
                    data = os.read(source, 1 << 16)
                    if data:
                        self.send(bytes([outputs[source]]) + data)
                    else:
                        del outputs[source]
            if not outputs:
                self.send(bytes([3]) + exit_status(self.proc.wait()))
        except (OSError, ssl.SSLError, ValueError):
            pass  # the client went away, or broke the protocol: end the stream
        finally:
            if self.proc.poll() is None:  # nobody reads it any more: as the kubelet does, it goes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.close()

    def deliver(self, channel: int, data: bytes) -> None:
        if channel == 0 and self.proc.stdin is not None and self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(data)


class Forward(Stream):
    """One port-forward stream: WebSocket frames from the client to one relay process per port (inside the
    pod's network namespace) and back."""

    def __init__(self, conn: ssl.SSLSocket, netns: str, ports: list[int], stop: threading.Event):
        super().__init__(conn, stop)
        self.relays = [
            subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-c", RELAY, str(port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
            )
            for port in ports
        ]
        self.ports = ports

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
            self.close()

    def _loop(self) -> None:
        open_relays = {relay.stdout.fileno(): i for i, relay in enumerate(self.relays)}
        while open_relays and not self.stop.is_set():
            for source in self.wait(list(open_relays)):
                if source is self.conn:
                    if not self.client_data():
                        return
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

    def deliver(self, channel: int, data: bytes) -> None:
        if channel % 2 or channel // 2 >= len(self.relays):
            return  # the error channels are the server's to write
        relay = self.relays[channel // 2]
        if relay.poll() is None and data:
            with contextlib.suppress(BrokenPipeError):
                relay.stdin.write(data)
