"""Port-forward's and exec's inputs: the node agent's framing (hack/localstack/kubelet.py), fed frames as a client
sends them (masked, fragmented, interleaved with pings, split across reads, and hostile: oversized, on the
server's channels), the ports a request names, the ports `sharded port-forward` is given, and exec run for
real over a socket pair: output channels, stdin, the exit Status, hostile requests and a client that leaves."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

import pytest

from localstack.kubelet import MAX_COMMAND, exec_request
from localstack.streams import MAX_FRAME, Exec, Forward


class Sink:
    def __init__(self):
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


class Relay:
    def __init__(self):
        self.stdin = self
        self.got = b""

    def poll(self):
        return None

    def write(self, data: bytes) -> None:
        self.got += data


def frame(payload: bytes, opcode: int = 0x2, fin: bool = True, mask: bytes | None = None) -> bytes:
    n = len(payload)
    mask = os.urandom(4) if mask is None else mask
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n) if n < 1 << 16 else (
        bytes([0x80 | 127]) + struct.pack("!Q", n))  # fmt: skip
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([(0x80 if fin else 0) | opcode]) + size + mask + body


def forward(ports: int = 2) -> Forward:
    f = object.__new__(Forward)  # no relay processes: Relay stands in for each
    f.conn, f.relays, f.ports, f.buf, f.frames = Sink(), [Relay() for _ in range(ports)], [1] * ports, b"", []
    return f


def test_masked_frames_reach_their_port_and_fragments_join():
    f = forward()
    big = os.urandom(70_000)  # a 64-bit length
    f.buf = frame(b"\x00hello") + frame(b"\x02" + big) + frame(b"\x00par", fin=False) + frame(b"ts", opcode=0x0)
    assert f._frames_in()
    assert f.relays[0].got == b"helloparts" and f.relays[1].got == big and f.buf == b""


def test_a_frame_split_across_reads_waits_for_its_rest():
    f = forward()
    whole = frame(b"\x00" + b"x" * 300)
    for i in range(len(whole)):  # byte by byte, as TLS records may cut it
        f.buf += whole[i : i + 1]
        assert f._frames_in()
    assert f.relays[0].got == b"x" * 300


def test_ping_is_answered_and_close_ends_the_stream():
    f = forward()
    f.buf = frame(b"are you there", opcode=0x9) + frame(struct.pack("!H", 1000), opcode=0x8) + frame(b"\x00late")
    assert not f._frames_in()
    assert f.conn.sent == bytes([0x8A, 13]) + b"are you there"  # an unmasked pong with the ping's payload
    assert f.relays[0].got == b""  # nothing after the close is delivered


def test_hostile_frames_are_refused():
    f = forward()
    f.buf = frame(b"\x01not yours") + frame(b"\x07no such channel") + frame(b"")
    assert f._frames_in() and f.relays[0].got == f.relays[1].got == b""  # error channels are the server's
    f.buf = bytes([0x82, 0x80 | 127]) + struct.pack("!Q", MAX_FRAME + 1)
    with pytest.raises(ValueError, match="a frame of"):
        f._frames_in()


def test_port_forward_ports_are_read_as_local_and_remote_and_bad_ones_refused():
    from sharded_operator.cli.main import JobError, forward_ports

    assert forward_ports("8888") == (8888, 8888) and forward_ports("0:8888") == (0, 8888)
    assert forward_ports("18888:8888") == (18888, 8888)
    for hostile in ("", ":", "0", "8888:0", "x:80", "80:x", "65536", "1:2:3", "-1", "\uff18\uff10", "9" * 5000):
        with pytest.raises(JobError, match=r"give \[LOCAL:\]REMOTE ports"):
            forward_ports(hostile)


class Plain:
    """The server's end of a socket pair where the TLS socket would be (nothing is ever buffered in it)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def pending(self) -> int:
        return 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)


def server_messages(sock: socket.socket) -> list[tuple[int, bytes]]:
    """(channel, data) of every binary message the server sent until it closed; the close frame ends it."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    out, at = [], 0
    while at < len(data):
        opcode, n, at = data[at] & 0x0F, data[at + 1] & 0x7F, at + 2
        if n == 126:
            n, at = struct.unpack("!H", data[at : at + 2])[0], at + 2
        elif n == 127:
            n, at = struct.unpack("!Q", data[at : at + 8])[0], at + 8
        payload, at = data[at : at + n], at + n
        if opcode == 0x8:
            break
        out.append((payload[0], payload[1:]))
    return out


def run_exec(argv: list[str], stdin: bool = False, send: bytes = b"") -> list[tuple[int, bytes]]:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ex = Exec(Plain(ours), argv, stdin, threading.Event())
        t = threading.Thread(target=lambda: (ex.run(), ours.shutdown(socket.SHUT_RDWR)))
        t.start()
        if send:
            theirs.sendall(send)
        got = server_messages(theirs)
        t.join(10)
    return got


def channel(messages: list[tuple[int, bytes]], n: int) -> bytes:
    return b"".join(d for c, d in messages if c == n)


def test_exec_streams_stdout_and_stderr_apart_and_ends_with_the_exit_status():
    got = run_exec(["sh", "-c", "echo out; echo err >&2; head -c 100000 /dev/zero; exit 3"])
    assert channel(got, 1) == b"out\n" + bytes(100000) and channel(got, 2) == b"err\n"
    assert got[-1][0] == 3  # the Status comes last, as the Python client and kubectl read it
    status = json.loads(got[-1][1])
    assert status["status"] == "Failure" and status["reason"] == "NonZeroExitCode"
    assert status["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
    assert json.loads(channel(run_exec(["true"]), 3)) == {"metadata": {}, "status": "Success"}


def test_exec_feeds_channel_zero_to_stdin_and_drops_other_channels():
    send = frame(b"\x01not stdin") + frame(b"\x00he") + frame(b"\x05nor this") + frame(b"\x00llo")
    got = run_exec(["head", "-c", "5"], stdin=True, send=send)
    assert channel(got, 1) == b"hello"


def test_a_client_that_leaves_kills_the_command():
    ours, theirs = socket.socketpair()
    ex = Exec(Plain(ours), ["sleep", "300"], False, threading.Event())
    t = threading.Thread(target=ex.run)
    t.start()
    theirs.close()
    t.join(10)
    assert not t.is_alive() and ex.proc.returncode == -9
    ours.close()


def test_exec_requests_are_bounded_and_refuse_a_terminal():
    assert exec_request({"command": ["ls", "-l"], "output": ["1"]}) == (["ls", "-l"], False)
    assert exec_request({"command": ["cat"], "input": ["1"]}) == (["cat"], True)
    assert exec_request({"command": ["cat"], "stdin": ["true"]}) == (["cat"], True)
    for hostile, message in (
        ({}, "command: give 1 to"),
        ({"command": ["x"] * (MAX_COMMAND + 1)}, "command: give 1 to"),
        ({"command": ["x" * (1 << 17)]}, "64 KiB"),
        ({"command": ["sh"], "tty": ["1"]}, "tty: this node serves exec without a terminal"),
    ):
        assert message in exec_request(hostile)


def test_exec_of_a_program_that_does_not_exist_says_so_and_exits_127():
    got = run_exec(["/no/such/program"])
    assert b"/no/such/program: No such file or directory" in channel(got, 2)
    assert json.loads(channel(got, 3))["details"]["causes"][0]["message"] == "127"


def test_sharded_exec_takes_every_word_after_the_double_dash_as_the_commands(capsys, monkeypatch):
    from sharded_operator.cli import main as cli
    from sharded_operator.cli.main import main

    for wrong in (["exec", "llm"], ["exec", "llm", "--"], ["list", "--", "ls"]):
        assert main(wrong) == 1  # before any cluster is asked
        assert "exec runs the command after --" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(cli, "run", lambda a: seen.append(a) or 0)
    assert main(["exec", "llm", "--node", "1", "--", "python", "-m", "x", "--node", "--", "-h"]) == 0
    assert (seen[0].name, seen[0].node, seen[0].cmd) == ("llm", 1, ["python", "-m", "x", "--node", "--", "-h"])
