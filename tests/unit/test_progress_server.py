"""The /progress server on loopback, driven with raw sockets: bodies in many TCP segments are read whole,
half-sent requests and stalled bodies are cut off, and connections beyond the cap are closed as they come."""

from __future__ import annotations

import asyncio
import json
import time

from sharded_operator.run import web

HOST = "127.0.0.1"


async def serve(limit: int = 4, header_seconds: float = 0.5, body_seconds: float = 0.5):
    seen: list[bytes] = []

    async def take(auth, body):
        seen.append(body)
        return 200, {"bytes": len(body)}

    guard = web.ConnectionGuard(limit, header_seconds)
    runner = await web.start(web.progress_app(take, body_seconds, guard), HOST, 0, guard)
    return runner, guard, guard.port, seen


async def connect(port: int):
    return await asyncio.open_connection(HOST, port)


def request(body: bytes, length: int | None = None) -> tuple[bytes, bytes]:
    head = (f"POST /progress HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode()  # fmt: skip
    return head, body


async def answer(reader) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    body = await asyncio.wait_for(reader.readexactly(length), 5)
    return int(head.split()[1]), json.loads(body)


def run(coro):
    return asyncio.run(coro)


def test_a_body_in_many_segments_is_read_whole():
    async def go():
        runner, _guard, port, seen = await serve()
        body = json.dumps({"x": "y" * 3000}).encode()
        reader, writer = await connect(port)
        head, _ = request(body)
        writer.write(head)
        for i in range(0, len(body), 500):  # six segments, apart in time as a slow network sends them
            writer.write(body[i : i + 500])
            await writer.drain()
            await asyncio.sleep(0.03)
        status, reply = await answer(reader)
        await runner.cleanup()
        return status, reply, seen

    status, reply, seen = run(go())
    assert status == 200 and reply["bytes"] == len(seen[0]) and json.loads(seen[0])["x"] == "y" * 3000


def test_a_half_sent_request_is_closed_after_the_header_deadline():
    async def go():
        runner, guard, port, seen = await serve()
        reader, writer = await connect(port)
        writer.write(b"POST /progress HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        start = time.monotonic()
        data = await asyncio.wait_for(reader.read(), 5)
        took = time.monotonic() - start
        open_after = len(guard.open)
        await runner.cleanup()
        return data, took, open_after, seen

    data, took, open_after, seen = run(go())
    assert data == b"" and took < 3 and open_after == 0 and seen == []


def test_a_stalled_body_gets_408_and_nothing_is_taken():
    async def go():
        runner, _guard, port, seen = await serve()
        reader, writer = await connect(port)
        head, body = request(b'{"step": 1}', length=200)  # promises 200 bytes, sends 11
        writer.write(head + body)
        status, reply = await answer(reader)
        await runner.cleanup()
        return status, reply, seen

    status, reply, seen = run(go())
    assert status == 408 and "did not arrive" in reply["error"] and seen == []


def test_an_oversized_body_is_refused_with_413():
    from sharded_api.contract import MAX_REPORT_BYTES

    async def go():
        runner, _guard, port, seen = await serve()
        reader, writer = await connect(port)
        head, body = request(b"x" * (MAX_REPORT_BYTES + 10))
        writer.write(head + body)
        status, _reply = await answer(reader)
        await runner.cleanup()
        return status, seen

    status, seen = run(go())
    assert status == 413 and seen == []


def test_connections_beyond_the_cap_are_closed_and_the_server_still_answers_after():
    async def go():
        runner, guard, port, _seen = await serve(limit=3, header_seconds=30)
        idle = [await connect(port) for _ in range(3)]  # three peers holding connections open
        await asyncio.sleep(0.1)
        reader, writer = await connect(port)
        extra = await asyncio.wait_for(reader.read(), 5)  # the fourth is closed at once
        refused = guard.refused
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.1)
        reader, writer = await connect(port)
        head, body = request(b"{}")
        writer.write(head + body)
        status, _ = await answer(reader)
        await runner.cleanup()
        return extra, refused, status

    extra, refused, status = run(go())
    assert extra == b"" and refused == 1 and status == 200
