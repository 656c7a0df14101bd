"""What bounds one client's hold on ``lantern serve`` below the API: connections, the time a
request's headers may take, the Host it names, and the uvicorn settings that carry them.

uvicorn bounds a header's size (h11's ``max_incomplete_event_size``) and the idle time between
requests (``timeout_keep_alive``), but not the time a new connection may take to send its headers
nor how many connections are open (``limit_concurrency`` answers a plain-text 503 to *requests*
once the limit is reached, even on the connections inside it; idle sockets that never send one
stay open). :class:`BoundedH11Protocol` adds both, and answers a request h11 cannot parse in the
API's JSON instead of uvicorn's plain text. A request's body is bounded
in size and time where it is read (``lantern.serve.app``); these bounds come before any of that.

The numbers are the flags of ``lantern serve`` (docs/serving.md, "Limits"); behind a reverse
proxy, the proxy's own limits come first (docs/serving.md, "Deploying behind a proxy").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import h11
import uvicorn
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from lantern.serve.limits import HttpLimits

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host header forms (an IPv6 literal keeps its brackets)
HOST_PASSED = "lantern.host_checked"  # scope key set once the host check let a request through


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a cap on open connections.

    The deadline runs from the connection's start, and again from each answer: unlike uvicorn's
    keep-alive timer, bytes trickling in do not reset it, so headers sent a byte at a time are cut
    off. (``limits`` is set per server by :func:`protocol_for`.)"""

    limits: HttpLimits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = HeaderBoundedConnection(h11.SERVER, self.limits.max_header_bytes)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            transport.close()  # an accepted socket costs a file descriptor until it is closed
            return
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        if self.cycle is None or self.cycle.response_complete:  # (pipelined: the next request is here)
            self.loop.call_later(self.limits.header_timeout, self._header_deadline, self.cycle)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed request line or header, or a line and headers
        past ``--max-header-bytes``), refused as every refusal of the API is: one JSON line."""
        body = json.dumps({"error": {"message": "http: not a valid HTTP/1.1 request, or its line and headers "
                                     f"are longer than this server's {self.limits.max_header_bytes} bytes "
                                     "(lantern serve --max-header-bytes)", "field": "http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _header_deadline(self, cycle: Any) -> None:
        """No new request's headers since the deadline was armed: close (nothing can be answered
        before a request line has arrived)."""
        if self.cycle is cycle and not self.transport.is_closing():
            self.transport.close()


class HeaderBoundedConnection(h11.Connection):
    """h11's connection, refusing a request whose line and headers are longer than
    ``max_header_bytes`` however they arrive. h11's own bound (``max_incomplete_event_size``) only
    counts headers still incomplete, so a header block that arrives in one read (up to 256 KiB on
    loopback) passed it."""

    def __init__(self, our_role: type[h11.SERVER], max_header_bytes: int) -> None:
        super().__init__(our_role, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and header_bytes(event) > self.max_header_bytes:
            raise h11.RemoteProtocolError("request line and headers too long", error_status_hint=431)
        return event


def header_bytes(request: h11.Request) -> int:
    """The size of ``request``'s line and headers as sent (less any spaces around header values)."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


def protocol_for(limits: HttpLimits) -> type[BoundedH11Protocol]:
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, limits: HttpLimits, *, graceful_timeout: float, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for ``app`` under ``limits``: always the h11 protocol (the one that takes
    the header bounds; httptools would ignore them if installed)."""
    return uvicorn.Config(
        app, log_level=log_level, lifespan="on", http=protocol_for(limits),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # (a float works: call_later)
        # no limit_concurrency: the protocol closes a connection past --max-connections, so every
        # open one may make requests (and the queue bounds the work, with a JSON 429)
        timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]
    )


def allowed_hosts(bound: str, extra: Sequence[str] = ()) -> list[str]:
    """The Host header values the server answers: this machine's names, the bound address, and
    ``--allowed-hosts``. A page whose name was rebound to 127.0.0.1 sends its own name: refused."""
    hosts = [*LOOPBACK_HOSTS, f"[{bound}]" if ":" in bound else bound, *extra]
    return list(dict.fromkeys(h.lower() for h in hosts))


class HostCheck(TrustedHostMiddleware):
    """Starlette's trusted-host check, refusing as every refusal of the API does (one JSON line,
    ``field: "host"``) instead of its plain text."""

    def __init__(self, app: Any, allowed: Sequence[str]) -> None:
        super().__init__(_MarkPassed(app), allowed_hosts=list(allowed), www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if scope.get("http_version") == "1.0" and not any(name == b"host" for name, _ in scope["headers"]):
            # HTTP/1.0 has no Host header to check, and a browser (what the check guards against:
            # a page rebound to 127.0.0.1) always sends one
            await self.app(scope, receive, send)  # (the app behind the check: _MarkPassed)
            return

        async def send_or_refuse(message: Message) -> None:
            if scope.get(HOST_PASSED):
                await send(message)
            elif message["type"] == "http.response.start":  # Starlette's own refusal: answered here instead
                host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")[:80]
                await JSONResponse({"error": {"message": f"host: {host!r} is not a host of this server "
                                              "(lantern serve --allowed-hosts)", "field": "host"}},
                                   status_code=400)(scope, receive, send)

        await super().__call__(scope, receive, send_or_refuse)


class AbsoluteTarget:
    """A request line in absolute form (``GET http://127.0.0.1:8000/health HTTP/1.1``), which a
    server must accept (RFC 9112, 3.2.2) and uvicorn's h11 protocol passes on as the path (every
    such request was a 404): routed by its path, its authority standing for the Host header
    (RFC 9112, 3.2.2: the server ignores the Host header and uses the target's), so the Host check
    judges the host the target names."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"][:8].lower().startswith(("http://", "https://")):
            target = urlsplit(scope["path"])
            path = target.path or "/"
            headers = [(name, value) for name, value in scope["headers"] if name != b"host"]
            scope = {**scope, "path": path, "raw_path": path.encode("utf-8"),
                     "headers": [*headers, (b"host", target.netloc.encode("latin-1"))]}
        await self.app(scope, receive, send)


class _MarkPassed:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[HOST_PASSED] = True
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, starting the app's drain (``ServeState.drain``) the moment shutdown
    begins: the app fails what is left after the drain timeout with its own answers, so uvicorn's
    graceful timeout (set a little longer) never has to cancel a request."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Any]) -> None:
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        self.drain()
        await super().shutdown(sockets)
