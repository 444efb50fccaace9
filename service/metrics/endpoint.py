"""/metrics over HTTP, served from the daemon's event loop: one request per connection, read within
a deadline and a size bound, answered with the registry's exposition (made on the loop's bounded
default pool), then closed. Past MAX_WAITING connections still sending their request, the oldest
is closed: connections held open without a request cost a descriptor each for at most
REQUEST_SECONDS, never a thread, and cannot keep a scraper that asks at once from its answer. A
port already taken does not stop the daemon: the endpoint logs it and tries again every
RETRY_SECONDS, and the daemon serves its groups meanwhile."""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections import OrderedDict

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("nodecomm.server")

MAX_WAITING = 64
REQUEST_SECONDS = 5.0  # to send the request head, and to take the answer
MAX_HEAD_BYTES = 8192
RETRY_SECONDS = 5.0


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        self.host, self.port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._retry: asyncio.Task | None = None
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # oldest first

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it listens, once it does."""
        if self._server is None:
            return None
        return self.host, self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        """Listen now, or, where the port is taken, keep trying in the background."""
        if not await self._listen():
            self._retry = asyncio.ensure_future(self._keep_trying())

    async def _listen(self) -> bool:
        try:
            self._server = await asyncio.start_server(self._answer, self.host, self.port, limit=MAX_HEAD_BYTES)
        except OSError as error:
            log.warning(
                f"metrics: cannot listen on {self.host}:{self.port} ({error.strerror}); trying again every "
                f"{RETRY_SECONDS:.0f} s, groups are served meanwhile",
                extra={"metrics_address": f"{self.host}:{self.port}"},
            )
            return False
        if self._retry is not None:
            log.info("metrics: listening", extra={"metrics_address": f"{self.host}:{self.port}"})
        return True

    async def _keep_trying(self) -> None:
        while True:
            await asyncio.sleep(RETRY_SECONDS)
            if await self._listen():
                return

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) >= MAX_WAITING:
            oldest, _ = self._waiting.popitem(last=False)
            oldest.transport.abort()  # its readuntil ends: closed below, in its own call
        self._waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_SECONDS)
            finally:
                self._waiting.pop(writer, None)
            status, headers, body = await self._respond(head)
            lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
            lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            writer.write("\r\n".join(lines).encode() + (b"" if head.startswith(b"HEAD ") else body))
            await asyncio.wait_for(writer.drain(), REQUEST_SECONDS)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # slow, oversized or gone: closed below
        finally:
            writer.close()

    async def _respond(self, head: bytes) -> tuple[str, dict[str, str], bytes]:
        request, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, *_ = request.split(" ") + ["", ""]
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if target.split("?")[0] not in ("/metrics", "/"):
            return "404 Not Found", {"Content-Type": "text/plain"}, b"not found: try /metrics\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", {"Allow": "GET, HEAD", "Content-Type": "text/plain"}, b""
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = await asyncio.get_running_loop().run_in_executor(None, encoder, self.registry)
        answer = {"Content-Type": content_type}
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            answer["Content-Encoding"] = "gzip"
        return "200 OK", answer, body
