"""The floor under any router written in Python, for bench/vs_routers.py: a uvloop byte pipe.

Each client connection gets its own connection to the next backend in turn (round robin per
connection) and bytes go both ways untouched: no HTTP parsing, no routing, no record, no metrics.
What it costs per request is what the event loop, the interpreter's callbacks and the four
socket syscalls of a relayed request cost on this machine; a Python router can only add to it.
A reference row, not a router anyone should run: it balances connections, not requests.

    .venv/bin/python -m bench.floor_proxy --port 8100 --backend http://127.0.0.1:8001 --backend ...
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import socket
from urllib.parse import urlsplit

import uvloop


class _Pipe(asyncio.Protocol):
    """One side of a connection pair: what it reads, the peer writes; a peer that cannot keep
    up pauses this side's reading."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.pending: list[bytes] = []  # read before the peer's connection was made

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Pipe):
    def __init__(self, backends) -> None:
        super().__init__()
        self.backends = backends

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect(next(self.backends)))

    async def _connect(self, backend: tuple[str, int]) -> None:
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(_Pipe, *backend)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None:  # the client left meanwhile
            upstream.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        for data in self.pending:
            upstream.transport.write(data)
        self.pending.clear()


async def serve(port: int, backends: list[str]) -> None:
    addresses = [(urlsplit(url).hostname, urlsplit(url).port) for url in backends]
    turns = itertools.cycle(addresses)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(turns), "127.0.0.1", port)
    print(f"floor proxy on http://127.0.0.1:{port} -> {', '.join(backends)}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A uvloop byte pipe: the floor under a Python router.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", action="append", required=True, help="backend URL (repeat for more)")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.backend))


if __name__ == "__main__":
    main()
