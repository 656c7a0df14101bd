"""The server's bounds as plain numbers, with nothing to import: the CLI shows their defaults
without loading the ``serve`` extra. ``lantern.serve.guards`` and ``lantern.serve.app`` apply the
HTTP ones, ``lantern.serve.plan`` the round's."""

from __future__ import annotations

from dataclasses import dataclass

# A round may verify ROUND_FACTOR times the nodes of its method's default round, or MIN_ROUND_NODES
# if more: the papers' largest trees (58-64 nodes) stay allowed on a model whose defaults are small,
# at a cost (digits, one CPU thread, batch 4: 3 ms per forward at 2 nodes, 10 ms at 17, 30 ms at
# 64). ``lantern serve --max-tree-nodes`` sets one number for every method instead.
ROUND_FACTOR = 4
MIN_ROUND_NODES = 64


@dataclass(frozen=True)
class HttpLimits:
    """The server's bounds on bodies, time and connections (``lantern serve``'s flags)."""

    max_body_bytes: int = 1 << 20  # nginx's client_max_body_size default; a full request is < 10 kB
    max_header_bytes: int = 16 << 10  # h11's default: a request line and headers larger get 400
    header_timeout: float = 10.0  # a connection's next request line and headers, whole
    body_timeout: float = 30.0  # a request's body, whole, from its headers' arrival
    keep_alive_timeout: float = 5.0  # an idle connection between requests (uvicorn's timeout_keep_alive)
    max_connections: int = 256  # open at once; past it a new connection is closed at once
