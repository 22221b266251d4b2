"""Port-forward's inputs: the node agent's framing (hack/kubeletserver.py), fed frames as a client sends them
(masked, fragmented, interleaved with pings, split across reads, and hostile: oversized, on the server's
channels), the ports a request names, and the ports `sharded port-forward` is given."""

from __future__ import annotations

import os
import struct

import pytest

from kubeletserver import MAX_FRAME, Forward


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
    from sharded_operator.cli import JobError, forward_ports

    assert forward_ports("8888") == (8888, 8888) and forward_ports("0:8888") == (0, 8888)
    assert forward_ports("18888:8888") == (18888, 8888)
    for hostile in ("", ":", "0", "8888:0", "x:80", "80:x", "65536", "1:2:3", "-1", "\uff18\uff10", "9" * 5000):
        with pytest.raises(JobError, match=r"give \[LOCAL:\]REMOTE ports"):
            forward_ports(hostile)
