"""The gateway's upstream client against a scripted HTTP server on loopback: bodies by length,
chunks and connection close, keep-alive reuse, a dead pooled connection retried once, reads
that time out without losing data, refused connections; and the stream-chunk reader."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

import socket
import struct

import uvloop

from gateway.http_client import BadResponse, ConnectFailed, Disconnected, HttpClientError, Origin, UpstreamClient
from protocol.sse import EventSplitter
from protocol.stream_chunks import MalformedEvent, decode_events, strip_token_ids
from tests.servers import free_port


class Scripted:
    """A server that answers each request with the next scripted action: bytes to send (a list:
    sent apart, a pause between), or "close" (hang up without answering)."""

    def __init__(self, actions: list) -> None:
        self.actions = list(actions)
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.actions:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                action = self.actions.pop(0)
                if action == "close":
                    break
                for part in action:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                if action and action[-1].endswith(b"\r\n\r\nbye"):  # an until-close body
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def run(coro):
    return asyncio.run(coro)


async def serve(script: Scripted):
    port = free_port()
    server = await asyncio.start_server(script.handle, "127.0.0.1", port)
    return server, Origin(f"http://127.0.0.1:{port}")


CHUNKED = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n",
           b"5\r\nhello\r\n", b"6\r\n world\r\n0\r\n\r\n"]


def test_chunked_and_sized_bodies_arrive_whole_over_one_kept_alive_connection():
    async def main():
        script = Scripted([CHUNKED, [b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\nRetry-After: 3\r\n\r\nnope"]])
        server, origin = await serve(script)
        client = UpstreamClient(connect_timeout_s=2)
        first = await client.post(origin, "/v1/completions", b'{"a": 1}', "req-1")
        assert first.status == 200 and first.headers["content-type"] == "text/event-stream"
        assert await first.read() == b"hello world"
        first.release()
        second = await client.post(origin, "/v1/completions", b"{}")
        assert second.status == 404 and second.headers["retry-after"] == "3" and await second.read() == b"nope"
        second.release()
        assert script.connections == 1  # the second request reused the first one's connection
        assert b"x-request-id: req-1" in script.requests[0] and script.requests[0].endswith(b'{"a": 1}')
        await client.close()
        server.close()
    run(main())


def test_a_pooled_connection_the_replica_closed_is_replaced_and_a_mid_answer_close_is_an_error():
    async def main():
        script = Scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], "close",
                           [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"],
                           [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"]])
        server, origin = await serve(script)
        client = UpstreamClient(connect_timeout_s=2)
        response = await client.post(origin, "/x", b"{}")
        assert await response.read() == b"ok"
        response.release()
        again = await client.post(origin, "/x", b"{}")  # its pooled connection dies unanswered: a fresh one
        assert await again.read() == b"ok"
        again.release()
        assert script.connections == 2
        broken = await client.post(origin, "/x", b"{}")
        with pytest.raises(Disconnected):
            await broken.read()
        broken.close()
        await client.close()
        server.close()
    run(main())


def test_a_read_that_times_out_loses_nothing_and_an_until_close_body_ends_with_the_connection():
    async def main():
        script = Scripted([[b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhi", b" there", b"\r\n\r\nbye"]])
        server, origin = await serve(script)
        client = UpstreamClient(connect_timeout_s=2)
        response = await client.post(origin, "/x", b"{}")
        loop = asyncio.get_running_loop()
        got = await response.read_some(loop.time() + 1)
        with pytest.raises(TimeoutError):
            await response.read_some(loop.time() + 0.001)
        got += await response.read()
        assert got == b"hi there\r\n\r\nbye"
        response.release()
        await client.close()
        server.close()
    run(main())


def test_a_connections_timer_outliving_a_short_deadline_never_cuts_a_later_longer_one():
    """One timer per connection, kept across answers: a wait whose deadline is later than the
    timer's re-arms it instead of timing out, and a wait whose deadline is earlier moves it."""
    async def main():
        slow = [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"a", b"b", b"c", b"d", b"e"]
        script = Scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], slow, slow])
        server, origin = await serve(script)
        client = UpstreamClient(connect_timeout_s=2)
        loop = asyncio.get_running_loop()
        first = await client.post(origin, "/x", b"{}", deadline=loop.time() + 0.05)
        assert await first.read(loop.time() + 0.05) == b"ok"  # the timer stays armed for +0.05 s
        first.release()
        started = loop.time()
        second = await client.post(origin, "/x", b"{}", deadline=loop.time() + 5)  # the same connection
        assert await second.read(loop.time() + 5) == b"abcde" and loop.time() - started > 0.08
        second.release()
        third = await client.post(origin, "/x", b"{}", deadline=loop.time() + 5)
        started = loop.time()
        with pytest.raises(TimeoutError):
            await third.read(loop.time() + 0.03)
        assert 0.025 < loop.time() - started < 1
        third.close()
        assert script.connections == 1
        await client.close()
        server.close()
    run(main())


def test_refused_and_garbage_answers_are_named():
    async def main():
        client = UpstreamClient(connect_timeout_s=2)
        with pytest.raises(ConnectFailed) as refused:
            await client.post(Origin(f"http://127.0.0.1:{free_port()}"), "/x", b"{}")
        assert refused.value.refused
        server, origin = await serve(Scripted([[b"SPDY/9 what\r\n\r\n"]]))
        with pytest.raises(BadResponse):
            await client.post(origin, "/x", b"{}")
        await client.close()
        server.close()
    run(main())


def test_a_replica_that_resets_each_connection_at_once_is_a_disconnect_never_a_crash():
    """A replica dying as the gateway connects (SIGKILL mid-chaos: the kernel completed the
    handshake, then RSTs): on uvloop, as the gateway runs, a write to a transport that just closed
    raised RuntimeError, which the proxy answered as a 500 instead of trying another replica."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    origin = Origin(f"http://127.0.0.1:{listener.getsockname()[1]}")

    async def main():
        loop = asyncio.get_running_loop()
        resets = 0

        async def reset_each():
            nonlocal resets
            while True:
                conn, _ = await loop.sock_accept(listener)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST
                resets += 1

        acceptor = asyncio.create_task(reset_each())
        client = UpstreamClient(connect_timeout_s=2)
        outcomes = []
        for _ in range(40):
            try:
                await client.post(origin, "/v1/completions", b"{}", deadline=loop.time() + 2)
                outcomes.append("answered")
            except HttpClientError as exc:
                outcomes.append(type(exc).__name__)
        acceptor.cancel()
        await client.close()
        return outcomes, resets

    outcomes, resets = uvloop.run(main())
    listener.close()
    assert resets >= 1
    assert set(outcomes) <= {"Disconnected", "ConnectFailed"}, outcomes


def chunk(**fields) -> bytes:
    return b"data: " + msgspec.json.encode({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                                            **fields})


def test_events_decode_in_one_batch_or_one_by_one_and_odd_ones_are_named():
    events = [chunk(choices=[{"index": 0, "text": "a", "token_ids": [1], "prompt_token_ids": [5, 6]}]),
              chunk(choices=[{"index": 0, "text": "b", "token_ids": [2], "finish_reason": "length"}]),
              chunk(choices=[], usage={"prompt_tokens": 2, "completion_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": 0}}),
              b"data: [DONE]"]
    kept, chunks = decode_events(events)
    assert kept == events[:3] and [c.choices[0].token_ids for c in chunks[:2]] == [[1], [2]]
    assert chunks[0].choices[0].prompt_token_ids == [5, 6] and chunks[2].usage.prompt_tokens == 2
    # Comments, multi-line data, non-object JSON: taken one at a time, same chunks.
    odd = [b": keep-alive", b"data: {\"id\": \"c\",\ndata: \"choices\": [{\"index\": 0, \"text\": \"x\"}]}", b"data: 5"]
    kept, chunks = decode_events(odd)
    assert len(chunks) == 1 and chunks[0].choices[0].text == "x" and kept[0].count(b"data: ") == 2
    # A later event without the space after `data:`, or with a second line: one at a time too.
    for second in (b"data:" + events[1][6:], events[1] + b"\ndata: "):
        kept, chunks = decode_events([events[0], second])
        assert [c.choices[0].token_ids for c in chunks] == [[1], [2]] and kept[1].startswith(events[1])
    with pytest.raises(MalformedEvent):
        decode_events([b"data: {\"choices\": 7}"])
    with pytest.raises(MalformedEvent):
        decode_events([b"data: not json"])
    # One event a read (a token stream's usual read): the same chunks, the same errors, skips.
    for one in events[:3]:
        kept, chunks = decode_events([one])
        assert kept == [one] and chunks == decode_events(events[:3])[1][events.index(one):events.index(one) + 1]
    assert decode_events([b"data: 5"]) == ([], []) and decode_events([b"data: [DONE]"]) == ([], [])
    for bad in (b"data: {\"choices\": 7}", b"data: not json"):
        with pytest.raises(MalformedEvent):
            decode_events([bad])


def test_a_byte_stream_splits_into_the_same_events_however_it_is_cut():
    """EventSplitter: events one per read (its fast path), several per read, split mid-event or
    mid-separator, CRLF framed, blank ones dropped: always the same events, in order."""
    events = [chunk(choices=[{"index": 0, "text": t, "token_ids": [i]}]) for i, t in enumerate("abc")]
    events.append(b"data: [DONE]")
    stream = b"".join(e + b"\n\n" for e in events)
    for cuts in ([len(e) + 2 for e in events], [1] * 8 + [len(stream)], [7, 3, 200, 1, 2, 500], [len(stream)]):
        for framing in (b"\n", b"\r\n"):
            data = stream.replace(b"\n", framing)
            splitter, got, at = EventSplitter(), [], 0
            for size in cuts:
                got += splitter.feed(data[at:at + size])
                at += size
            got += splitter.feed(data[at:]) + splitter.flush()
            assert got == events, (cuts, framing)
    assert EventSplitter().feed(b" \n\n") == [] and EventSplitter().feed(b"\n\n") == []


@pytest.fixture(params=["C", "Python"])
def cut(request, monkeypatch):
    """Each test of the token-ID cut runs with protocol/_strip_ids.c and with the Python cuts."""
    from protocol import stream_chunks
    if request.param == "C" and stream_chunks._native_strip is None:
        pytest.skip("protocol/_strip_ids.c was not built (no C compiler at install)")
    monkeypatch.setattr(stream_chunks, "NATIVE", request.param == "C")


def test_token_ids_are_cut_from_the_bytes_wherever_the_key_sits_and_never_from_text(cut):
    payload = (b'{"prompt_token_ids": [1, 2],"choices":[{"token_ids":[3],"text":"say \\"token_ids\\":[9]"},'
               b'{"text":"x", "token_ids": null},{"token_ids":[4]}]}')
    stripped = strip_token_ids(payload)
    assert msgspec.json.decode(stripped) == {"choices": [{"text": 'say "token_ids":[9]'}, {"text": "x"}, {}]}
    # The compact form replicas write, with the key's bytes inside a text too.
    compact = (b'{"choices":[{"index":0,"text":"a,\\"token_ids\\":[1]","finish_reason":null,"token_ids":[7,8],'
               b'"prompt_token_ids":null}],"prompt_token_ids":[1,2]}')
    assert strip_token_ids(compact) == b'{"choices":[{"index":0,"text":"a,\\"token_ids\\":[1]","finish_reason":null}]}'


def test_a_long_answers_token_ids_are_cut_the_same_way_and_its_prompt_ids_first(cut):
    """Past FIND_ABOVE_BYTES the compact members are cut by a scan for the key, not the regex: the
    same bytes come out, text that spells a key stays, and a list holding anything but IDs is left
    to the general pattern. strip_prompt_token_ids cuts only the prompt's (long answers only)."""
    from protocol.stream_chunks import _COMPACT_TOKEN_IDS, _TOKEN_IDS, FIND_ABOVE_BYTES, strip_prompt_token_ids

    prompt = b",".join(b"%d" % i for i in range(2000))
    answer = (b'{"id":"c","choices":[{"index":0,"text":"a,\\"token_ids\\":[1],\\"prompt_token_ids\\":[2]",'
              b'"logprobs":null,"finish_reason":"length","prompt_token_ids":[' + prompt + b'],"token_ids":[7,8]},'
              b'{"index":1,"text":"x","token_ids":null,"odd":{"token_ids":[1,"2"]}}],'
              b'"usage":{"prompt_tokens":2000},"prompt_token_ids":[' + prompt + b"]}")
    assert len(answer) > FIND_ABOVE_BYTES
    reference = _COMPACT_TOKEN_IDS.sub(b"", answer)
    reference = _TOKEN_IDS.sub(b"", reference) if b'token_ids"' in reference else reference
    stripped = strip_token_ids(answer)
    assert stripped == reference
    assert msgspec.json.decode(stripped) == {
        "id": "c", "usage": {"prompt_tokens": 2000},
        "choices": [{"index": 0, "text": 'a,"token_ids":[1],"prompt_token_ids":[2]', "logprobs": None,
                     "finish_reason": "length"},
                    {"index": 1, "text": "x", "odd": {"token_ids": [1, "2"]}}]}
    only_prompt = msgspec.json.decode(strip_prompt_token_ids(answer))
    assert "prompt_token_ids" not in only_prompt and "prompt_token_ids" not in only_prompt["choices"][0]
    assert only_prompt["choices"][0]["token_ids"] == [7, 8] and only_prompt["choices"][1]["token_ids"] is None
    short = b'{"choices":[{"prompt_token_ids":[1],"token_ids":[2]}]}'
    assert strip_prompt_token_ids(short) == short  # a short answer is decoded whole
    # Keys that only end like the IDs' stay, whichever cut runs.
    vendor = b'{"a":1,"my_token_ids":[1],"prompt_prompt_token_ids":[2],"xprompt_token_ids":[3],"pad":"' \
             + b"x" * FIND_ABOVE_BYTES + b'"}'
    assert strip_token_ids(vendor) == vendor and strip_prompt_token_ids(vendor) == vendor


def test_the_c_cut_removes_exactly_what_the_compact_pattern_does():
    """protocol/_strip_ids.c against the regex it replaces, on payloads made of the pieces that
    trip a key scan (keys with and without their comma, lists that are not IDs, escaped quotes)."""
    import random
    import re

    from protocol import stream_chunks
    if stream_chunks._native_strip is None:
        pytest.skip("protocol/_strip_ids.c was not built (no C compiler at install)")
    prompt_only = re.compile(rb',"prompt_token_ids":(?:\[[\d,]*\]|null)')
    pieces = [b',"token_ids":', b',"prompt_token_ids":', b'"token_ids":', b'token_ids":', b',"', b'prompt_', b"[",
              b"]", b"1", b"23", b",", b"null", b"nul", b"{", b"}", b'"', b" ", b"x", b'\\"']
    rng = random.Random(7)
    for _ in range(20000):
        payload = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert stream_chunks._native_strip(payload, True) == stream_chunks._COMPACT_TOKEN_IDS.sub(b"", payload)
        assert stream_chunks._native_strip(payload, False) == prompt_only.sub(b"", payload)


ANSWERS = [  # (one read from a replica, whether the C reader takes it whole; the rest is llhttp's)
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 2\r\n"
     b"Date: Thu, 03 Dec 2026 18:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.13.2\r\n\r\n{}", True),
    (b"HTTP/1.1 200 OK\r\ndate: x\r\nserver: uvicorn\r\ncontent-length: 11\r\ncontent-type: application/json\r\n"
     b"\r\n{\"a\": \"b\"}\n", True),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nX-A: 1\r\nx-a: 2\r\n\r\n", True),  # the last value wins
    (b"HTTP/1.1 503 \r\nContent-Length: 1\r\nRetry-After: 3\r\n\r\nx", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}", False),                # the rest comes later
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n{}", False),                # more than the answer
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\nContent-Length:  2\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\nX-A: caf\xc3\xa9\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", False),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),
    (b"HTTP/1.1 200 OK\r\n\r\n{}", False),                                     # up to the close
    (CHUNKED[0] + CHUNKED[1] + CHUNKED[2], True),                          # a whole chunked answer
    (CHUNKED[0], False),                                                   # its head alone
    (CHUNKED[0] + CHUNKED[1], False),                                      # the rest comes later
    (CHUNKED[0] + CHUNKED[1] + CHUNKED[2] + b"5\r\nhello\r\n", False),    # more than the answer
    (CHUNKED[0] + b"0\r\n\r\n", True),                                   # an empty body
    (CHUNKED[0].replace(b"chunked", b"Chunked") + b"A\r\n0123456789\r\n005\r\nhello\r\n0\r\n\r\n", True),
    (CHUNKED[0] + b"5;x=1\r\nhello\r\n0\r\n\r\n", False),                # a chunk extension
    (CHUNKED[0] + b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n", False),     # a trailer
    (CHUNKED[0] + b"5 \r\nhello\r\n0\r\n\r\n", False),
    (CHUNKED[0] + b"5\r\nhello\n0\r\n\r\n", False),
    (CHUNKED[0] + b"5\r\nhell\r\n0\r\n\r\n", False),
    (CHUNKED[0] + b"10000000000000000\r\nhello\r\n0\r\n\r\n", False),     # 17 hex digits
    (CHUNKED[0].replace(b"chunked", b"gzip, chunked") + b"0\r\n\r\n", False),
    (CHUNKED[0].replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n") + b"0\r\n\r\n", False),
    (CHUNKED[0].replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + b"0\r\n\r\n", False),
]


@pytest.mark.parametrize("data,plain", ANSWERS, ids=range(len(ANSWERS)))
def test_the_c_answer_reader_reads_a_whole_plain_answer_as_llhttp_does(data, plain, monkeypatch):
    from gateway import http_client
    if http_client._plain_response is None:
        pytest.skip("gateway/_http_head.c was not built (no C compiler at install)")
    assert (http_client._plain_response(data) is not None) == plain

    class Transport:
        def write(self, data): pass
        def close(self): pass
        def is_closing(self): return False
        def pause_reading(self): pass

    def read() -> tuple:
        conn = http_client._Connection(asyncio.new_event_loop(), ("h", 1))
        conn.loop.close()
        conn.transport = Transport()
        conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")
        conn.data_received(data)
        return (conn.status, conn.headers, b"".join(conn._body), conn._state, conn.error is None, conn.reusable())
    native = read()
    monkeypatch.setattr(http_client, "NATIVE", False)
    assert native == read()


def test_a_whole_chunked_stream_is_read_in_c_as_llhttp_reads_it(monkeypatch):
    """Streams of SSE events cut into chunks at random (sizes in either case of hex, with leading
    zeros), whole and cut short: where the C reader takes one, it gives what llhttp gives."""
    import random

    from gateway import http_client
    if http_client._plain_response is None:
        pytest.skip("gateway/_http_head.c was not built (no C compiler at install)")
    rng = random.Random(11)
    taken = 0
    for _ in range(300):
        body = b"".join(b'data: {"choices":[{"text":"%d"}]}\n\n' % rng.randint(0, 10 ** rng.randint(1, 9))
                        for _ in range(rng.randint(0, 20)))
        chunks, at = [], 0
        while at < len(body):
            size = rng.randint(1, 90)
            part = body[at:at + size]
            digits = rng.choice(["%x", "%X", "00%x"]) % len(part)
            chunks.append(digits.encode() + b"\r\n" + part + b"\r\n")
            at += size
        data = CHUNKED[0] + b"".join(chunks) + b"0\r\n\r\n"
        if rng.random() < 0.3:
            data = data[:rng.randint(len(CHUNKED[0]), len(data) - 1)]
        plain = http_client._plain_response(data)
        if plain is None:
            assert data.endswith(b"0\r\n\r\n") is False
            continue
        taken += 1
        assert plain == (200, {"transfer-encoding": "chunked", "content-type": "text/event-stream"}, body)
        monkeypatch.setattr(http_client, "NATIVE", False)
        conn = http_client._Connection(asyncio.new_event_loop(), ("h", 1))
        conn.loop.close()
        conn._state = http_client._HEAD
        conn.data_received(data)
        monkeypatch.setattr(http_client, "NATIVE", True)
        assert (conn.status, conn.headers, b"".join(conn._body), conn._state) == (plain[0], plain[1], plain[2],
                                                                                  http_client._DONE)
    assert taken > 150
