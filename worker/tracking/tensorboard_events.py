"""TensorBoard event files of scalar metrics, written without TensorFlow or tensorboard installed.

An event file is a TFRecord stream of `Event` protocol buffers: per record, the payload's length (uint64 LE),
its masked CRC-32C, the payload, the payload's masked CRC-32C. The first event carries the file version
("brain.Event:2"); each later one a step, a wall time and a `Summary` of scalar values. Only the few protobuf
fields needed are encoded here (field numbers from tensorboard/compat/proto/event.proto and summary.proto),
so every worker writes the file with no extra dependency; TensorBoard (the `tracking` extra) reads it.
"""

from __future__ import annotations

import io
import struct

FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def _scalar_value(tag: str, value: float) -> bytes:
    # Summary.Value: tag = 1 (string), simple_value = 2 (float)
    return _length_delimited(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value)


def _event(wall_time: float, step: int | None = None, *, file_version: str | None = None,
           scalars: dict[str, float] | None = None) -> bytes:
    # Event: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 (Summary)
    out = _field(1, 1) + struct.pack("<d", wall_time)
    if step is not None:
        out += _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        summary = b"".join(_length_delimited(1, _scalar_value(tag, v)) for tag, v in sorted(scalars.items()))
        out += _length_delimited(5, summary)
    return out


def _record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return length + _masked(length) + payload + _masked(payload)


def event_file(steps: dict[int, dict[str, float]], wall_time: float) -> bytes:
    """An event file with one event per step (ascending; steps are non-negative), its scalars under their metric
    names. The metrics table keeps no time per step, so every event carries `wall_time`: plot against steps."""
    out = io.BytesIO()
    out.write(_record(_event(wall_time, file_version=FILE_VERSION)))
    for step in sorted(steps):
        out.write(_record(_event(wall_time, step, scalars=steps[step])))
    return out.getvalue()


def event_file_name(job_id: str, start_time: float) -> str:
    """TensorBoard finds event files by the `tfevents` in their name."""
    return f"events.out.tfevents.{int(start_time)}.{job_id}"
