"""The wire format between a sandbox and its workers: length-prefixed JSON frames.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON holding one object.
Nothing is pickled: a worker running hostile code can send the parent bytes, never objects, and
the parent bounds what it reads (`MAX_FRAME_BYTES`), how long it waits for the rest of a frame
(a header sent without its body ends at the call's deadline, not never), and how deep the JSON
nests (a deeply nested reply is a malformed frame, not a `RecursionError`).
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, Final

HEADER: Final = struct.Struct(">I")
MAX_FRAME_BYTES: Final = 1 << 20
"""The largest frame either side accepts (1 MiB): a call's arguments or its result."""


class FrameError(ValueError):
    """A frame that is not what the protocol allows: too large, not JSON, not an object."""


class FrameTimeout(TimeoutError):
    """The deadline passed before a whole frame arrived."""


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, ensure_ascii=False, allow_nan=False).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {len(data)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(len(data)) + data


def decode(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise FrameError(f"a frame that is not JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise FrameError(f"a frame holding a {type(message).__name__}, not an object")
    return message


def write_frame(fd: int, message: dict[str, Any]) -> None:
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data) :]


def read_frame_blocking(fd: int) -> dict[str, Any] | None:
    """The next frame from a blocking `fd` (the worker's side: its parent is trusted to send
    whole frames); None at end of file."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    body = _read_exactly(fd, size)
    if body is None:
        raise FrameError("the stream ended inside a frame")
    return decode(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Reads frames from a worker's pipe without ever blocking past a deadline (the parent's
    side: the worker may send anything, or half of something, and then nothing)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()

    def pending(self) -> bool:
        """A whole frame, or an oversize header, is already buffered."""
        if len(self.buffer) < HEADER.size:
            return False
        size: int = HEADER.unpack_from(self.buffer)[0]
        return size > MAX_FRAME_BYTES or len(self.buffer) >= HEADER.size + size

    def feed(self) -> bool:
        """Read what the pipe holds now (call when it polls readable); False at end of file."""
        chunk = os.read(self.fd, 1 << 16)
        self.buffer += chunk
        return bool(chunk)

    def take(self) -> dict[str, Any]:
        """The buffered frame (`pending()` must be true)."""
        (size,) = HEADER.unpack_from(self.buffer)
        if size > MAX_FRAME_BYTES:
            raise FrameError(f"a frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
        body = bytes(self.buffer[HEADER.size : HEADER.size + size])
        del self.buffer[: HEADER.size + size]
        return decode(body)

    def read(self, deadline: float) -> dict[str, Any]:
        """The next frame, waiting until `deadline` (time.monotonic()) at most.

        Raises FrameTimeout at the deadline, EOFError when the worker closed its end, FrameError
        on a malformed frame."""
        while not self.pending():
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameTimeout("no whole frame before the deadline")
            readable, _, _ = select.select([self.fd], [], [], left)
            if readable and not self.feed():
                raise EOFError("the worker closed its pipe")
        return self.take()
