"""A server's stdout reaches the SDK a whole line at a time (its reader is quadratic in a
line's length otherwise), and a line over the bound is a protocol error, not a hang."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio

import subagent.tools.mcp_tools as mcp_tools
from subagent.spec import McpServerSpec
from subagent.tools import _mcp_lines
from subagent.tools._mcp_lines import WholeLines, dropped_line
from subagent.tools.mcp_spawn import prespawn
from tests.subagent.harness import CHILDREN

WAIT_S = 30.0


class Chunks(anyio.abc.ByteReceiveStream):
    """The given chunks, then the end of the stream."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)

    async def aclose(self) -> None:
        pass


async def received(stream: WholeLines) -> list[bytes]:
    out: list[bytes] = []
    while True:
        try:
            out.append(await stream.receive())
        except anyio.EndOfStream:
            return out


async def test_a_line_read_in_many_chunks_comes_out_whole_and_lines_in_one_chunk_together() -> None:
    long = [b"a" * 100] * 50
    stream = WholeLines(Chunks(*long, b"a\nb\nc", b"c\n", b"tail"), max_line=10_000)
    assert await received(stream) == [b"a" * 5000 + b"a\nb\n", b"cc\n", b"tail"]


async def test_a_line_over_the_bound_is_replaced_and_the_lines_around_it_are_kept() -> None:
    stream = WholeLines(Chunks(b"ok 1\nxx", b"x" * 30, b"x" * 30, b"xx\nok 2\n", b"y" * 30, b"y" * 30), max_line=50)
    assert await received(stream) == [b"ok 1\n", dropped_line(50) + b"ok 2\n", dropped_line(50)]
    # Within one chunk too (a pipe read larger than the bound).
    stream = WholeLines(Chunks(b"ok 1\n" + b"z" * 60 + b"\nok 2\n"), max_line=50)
    assert await received(stream) == [b"ok 1\n" + dropped_line(50) + b"ok 2\n"]


@contextmanager
def chunks_the_sdk_reads() -> Iterator[list[int]]:
    """The size of each chunk of text the SDK's stdio reader gets."""
    sizes: list[int] = []
    real = mcp_tools._stdio.TextReceiveStream

    class Spy(real):  # type: ignore[misc, valid-type]
        async def receive(self) -> str:
            text: str = await super().receive()
            sizes.append(len(text))
            return text

    mcp_tools._stdio.TextReceiveStream = Spy
    try:
        yield sizes
    finally:
        mcp_tools._stdio.TextReceiveStream = real


@contextmanager
def never_aborted(kind: str) -> Iterator[trio.CancelScope]:
    with trio.CancelScope() as scope:
        yield scope


async def tree_server(stack: AsyncExitStack, tmp_path: Path) -> Any:
    spec = McpServerSpec(command=sys.executable, args=(str(CHILDREN / "mcp_tree_server.py"),))
    spawned = await prespawn("tree", spec, stack, run_dir=tmp_path, on_group=lambda pgid, alive: None)
    return await mcp_tools.start_server(spawned, spec, stack, abortable=never_aborted)


async def test_a_long_answer_reaches_the_sdk_as_one_chunk(tmp_path: Path) -> None:
    size = 4 * 1024 * 1024
    with chunks_the_sdk_reads() as sizes:
        async with AsyncExitStack() as stack:
            server = await tree_server(stack, tmp_path)
            with trio.fail_after(WAIT_S):
                is_error, text = await server.call("big", {"size": size})
    assert (is_error, len(text)) == (False, size)
    # The answer's line (its text twice: content and structured content) in one piece; the
    # SDK's reader joined 64 KiB chunks one by one before, copying the line each time.
    assert max(sizes) > 2 * size, sorted(sizes)[-5:]


async def test_an_answer_over_the_bound_is_a_protocol_error_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_mcp_lines, "MAX_LINE_BYTES", 1024 * 1024)
    async with AsyncExitStack() as stack:
        server = await tree_server(stack, tmp_path)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.call, "big", {"size": 2 * 1024 * 1024})
            with trio.fail_after(WAIT_S):
                await server.broken.wait()
            nursery.cancel_scope.cancel()
    assert server.protocol_errors == [repr(dropped_line(1024 * 1024).decode().strip())]
