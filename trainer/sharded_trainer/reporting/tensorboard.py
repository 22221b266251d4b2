"""TensorBoard event files, written by rank 0 next to the checkpoints (`trainer.tensorboard`).

The format is TensorBoard's own (TFRecord framing of `Event` protocol buffers), written here directly so the
trainer image needs neither TensorBoard nor protobuf: per record, its length (uint64, little-endian), the
masked CRC-32C of the length, the bytes, and their masked CRC-32C; an Event holds `wall_time` (field 1,
double), `step` (2, int64) and a `Summary` (5) of `Value`s, each a `tag` (1, string) and a `simple_value`
(2, float). The first event of a file is the `file_version` (3) "brain.Event:2".
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # length-delimited (wire type 2)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int | None = None, scalars: dict[str, float] | None = None,
                 file_version: str | None = None) -> bytes:  # fmt: skip
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        out += _field(5, values)
    return out


def frame(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", masked_crc(length)) + record + struct.pack("<I", masked_crc(record))


class EventWriter:
    """One event file per process start, in `directory` (TensorBoard reads every `*tfevents*` file there)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.dir / name
        self._f = open(self.path, "ab")  # noqa: SIM115 - open for the run, closed by close()
        self._write(encode_event(time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        finite = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if finite:
            self._write(encode_event(time.time(), step=step, scalars=finite))

    def _write(self, record: bytes) -> None:
        self._f.write(frame(record))
        self._f.flush()  # a crash loses at most the record being written; TensorBoard reads what is whole

    def close(self) -> None:
        self._f.close()
