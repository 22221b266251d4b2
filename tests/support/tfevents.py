"""A reader of TensorBoard event files for tests, written from the format's description alone (TFRecord framing,
protobuf wire format), sharing no code with the trainer's writer."""

from __future__ import annotations

import struct
from pathlib import Path


def crc32c(data: bytes) -> int:
    """Bit by bit (the writer uses a table): CRC-32C, reflected polynomial 0x82F63B78."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    c = crc32c(data)
    return ((c >> 15 | c << 17) + 0xA282EAD8) % 2**32


def records(path: Path) -> list[bytes]:
    raw, out, at = path.read_bytes(), [], 0
    while at < len(raw):
        header = raw[at : at + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[at + 8 : at + 12])[0] == masked(header), f"length CRC at {at}"
        body = raw[at + 12 : at + 12 + n]
        assert struct.unpack("<I", raw[at + 12 + n : at + 16 + n])[0] == masked(body), f"data CRC at {at}"
        out.append(body)
        at += 16 + n
    return out


def fields(buf: bytes) -> list[tuple[int, int | float | bytes]]:
    """(field number, value) in order; varints as ints, fixed64 as double, fixed32 as float, bytes as bytes."""
    out, at = [], 0

    def varint() -> int:
        nonlocal at
        shift = value = 0
        while True:
            b = buf[at]
            at += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while at < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 1:
            out.append((number, struct.unpack("<d", buf[at : at + 8])[0]))
            at += 8
        elif wire == 5:
            out.append((number, struct.unpack("<f", buf[at : at + 4])[0]))
            at += 4
        elif wire == 2:
            n = varint()
            out.append((number, buf[at : at + n]))
            at += n
        else:
            raise ValueError(f"wire type {wire}")
    return out


def events(path: Path) -> list[dict]:
    """Each Event as {"wall_time", "step", "file_version", "scalars": {tag: value}}."""
    out = []
    for rec in records(path):
        event: dict = {"scalars": {}}
        for number, value in fields(rec):
            if number == 1:
                event["wall_time"] = value
            elif number == 2:
                event["step"] = value
            elif number == 3:
                event["file_version"] = value.decode()
            elif number == 5:
                for _, v in fields(value):
                    tag = next(x for n, x in fields(v) if n == 1).decode()
                    event["scalars"][tag] = next(x for n, x in fields(v) if n == 2)
        out.append(event)
    return out
