"""A hostile model server and hostile clients against one `serve` process (issue 56): the
server's memory (RSS) before and after each, and another user's round trip meanwhile.

    .venv/bin/python bench/hostile_bench.py [--size-mb 50]

A real `serve` (embedded mode, its own folder) answers two users; its model is a scripted
server on loopback that, turn by turn, sends: one event line of `--size-mb` MB without a
newline; a gzip bomb (`--size-mb` × 4 MB of newlines in about 200 KB); a 503 with a
`--size-mb` × 4 MB body; one valid answer of `--size-mb` MB in one event... cut down to 1 MiB
events by the event bound (so an answer of many 512 KiB events, to reach the answer bound).
Then a client sends a `--size-mb` × 4 MB chunked body to `/accounts/login/`, unauthenticated.
For each: the turn's outcome, the server's RSS before and at its highest while it ran (read
from /proc every 20 ms), and the slowest of the other user's `GET /sessions` meanwhile.
Memory is measured here, not asserted in tests: on a shared machine it flakes.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.procs import ServeProcess, embedded_env, manage, migrate_embedded  # noqa: E402

MiB = 1024 * 1024
Writer = Callable[[asyncio.StreamWriter], Any]


def event(text: str) -> bytes:
    import json

    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class HostileModel:
    """An HTTP/1.1 server on loopback whose every answer is the scenario set last."""

    def __init__(self) -> None:
        self.scenario: Writer | None = None
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            assert self.scenario is not None
            await self.scenario(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def send_until_closed(writer: asyncio.StreamWriter, piece: bytes, total: int) -> None:
    sent = 0
    while sent < total:
        writer.write(piece)
        await writer.drain()
        sent += len(piece)


def scenarios(size: int) -> dict[str, Writer]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"

    async def long_line(writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"\r\ndata: ")
        await send_until_closed(writer, b"x" * 64 * 1024, size)

    # Made ahead: compressing it is the bench's work, not the server's.
    packer = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    body = packer.compress(b"data: ") + b"".join(
        packer.compress(b"\n" * MiB) for _ in range(size * 4 // MiB)
    )
    body += packer.flush()

    async def bomb(writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()

    async def error_body(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/html\r\n"
            b"Content-Length: %d\r\n\r\n" % (size * 4)
        )
        await send_until_closed(writer, b"<p>down</p>" * 6000, size * 4)

    async def big_answer(writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"\r\n")
        piece = event("y" * 512 * 1024)
        await send_until_closed(writer, piece, size)
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()

    return {
        "one endless event line": long_line,
        "a gzip bomb": bomb,
        "a 503 with a huge body": error_body,
        "an answer of many large events": big_answer,
    }


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Watch:
    """The server's highest RSS and the other user's slowest round trip while it runs."""

    def __init__(self, pid: int, api: httpx.Client) -> None:
        self.pid, self.api = pid, api
        self.before = rss_kb(pid)
        self.peak = self.before
        self.slowest = 0.0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._memory, daemon=True),
            threading.Thread(target=self._reads, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _memory(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_kb(self.pid))
            time.sleep(0.02)

    def _reads(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.api.get("/sessions")
            self.slowest = max(self.slowest, time.monotonic() - started)
            time.sleep(0.05)

    def done(self) -> str:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        return (
            f"RSS {self.before / 1024:.0f} -> peak {self.peak / 1024:.0f} MB, "
            f"after {rss_kb(self.pid) / 1024:.0f} MB; other user's slowest read "
            f"{self.slowest * 1000:.0f} ms"
        )


def token_for(env: dict[str, str], name: str) -> str:
    done = manage("issue_token", name, "--create-user", env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def chunked_login(port: int, total: int) -> str:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"a" * 64 * 1024)
    sent = 0
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += 64 * 1024
    except OSError:
        pass
    status = sock.recv(200).split(b"\r\n", 1)[0].decode()
    sock.close()
    return f"{status or 'closed'} after {sent / MiB:.1f} MB sent"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=50)
    args = parser.parse_args()
    size = args.size_mb * MiB
    model = HostileModel()
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as folder:
        env = embedded_env(
            Path(folder),
            LLM_BASE_URL=f"http://127.0.0.1:{model.port}/v1",
            LLM_MODEL="m",
            CHAT_RATE_LIMIT_PER_MINUTE="100000",
        )
        migrate_embedded(env)
        attacker, other = token_for(env, "attacker"), token_for(env, "other")
        with ServeProcess(Path(folder), env) as server:
            assert server.proc is not None
            pid = server.proc.pid
            base = f"{server.base}/api/v1"
            api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {attacker}"})
            reader = httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {other}"}, timeout=60
            )
            reader.post("/sessions", json={"dialog_id": "mine"})
            session = api.post("/sessions", json={"dialog_id": "hostile"}).json()["session_id"]
            for name, scenario in scenarios(size).items():
                model.scenario = scenario
                watch = Watch(pid, reader)
                started = time.monotonic()
                turn = api.post(f"/sessions/{session}/messages", json={"content": name}).json()
                while True:
                    state = api.get(f"/turns/{turn['turn_id']}").json()
                    if state["status"] in ("completed", "failed", "cancelled"):
                        break
                    time.sleep(0.1)
                took = time.monotonic() - started
                error = (state.get("error") or {}).get("kind", "")
                print(f"{name}: {state['status']} {error} in {took:.1f} s; {watch.done()}")
            watch = Watch(pid, reader)
            outcome = chunked_login(server.port, size * 4)
            print(f"a chunked {args.size_mb * 4} MB login body: {outcome}; {watch.done()}")


if __name__ == "__main__":
    main()
