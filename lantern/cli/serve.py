"""``lantern serve``: the HTTP server (lantern.serve) over one loaded model.

It binds 127.0.0.1 unless ``--host`` says otherwise: the server has no authentication and is for
trusted networks only (docs/serving.md), answers only the Host names of this machine, the bound
address and ``--allowed-hosts``, and bounds every request's body, time and round size and the open
connections (docs/serving.md, "Limits"). SIGTERM (or Ctrl-C) stops accepting connections, lets the
requests in flight finish for up to ``--drain-timeout`` seconds, answers what is left with a 503
(streams: an ``error`` event), and exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from lantern.calibration import AUTO, QUALITY_CLASSES, MethodChoice, check_quality
from lantern.cli.common import (
    adapts_threads,
    add_chameleon_args,
    add_compile_arg,
    add_deterministic_arg,
    add_threads_arg,
    add_trust_checkpoint_arg,
    chameleon_options,
    check_compile,
)
from lantern.errors import LanternError, check
from lantern.methods import METHOD_TABLE
from lantern.serve.limits import MIN_ROUND_NODES, ROUND_FACTOR, HttpLimits

MAX_BATCH = 256  # rows of one decode batch: more only grows memory and --warm-up's sizes
MAX_QUEUE = 100_000
MAX_PROMPT_CHARS = 100_000
MAX_CONNECTIONS = 65_536
BYTES_PER_PROMPT_CHAR = 12  # a JSON body's worst case: a character outside the BMP as two \uXXXX escapes
HTTP_DEFAULTS = HttpLimits()
FALLBACK_METHOD = "lantern++"  # no --method and no calibration: the drafter method of the README's fast tier
FALLBACK_NO_DRAFTER = "sjd-coupled"  # ... for a model without a drafter: the lossless training-free one
DRAIN_GRACE = 10.0  # s past --drain-timeout that uvicorn waits for the app's own 503s to be written


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over HTTP (continuous batching, a web page, Prometheus metrics)",
        description="Serve image generation over HTTP: POST /v1/images/generations, GET /health, GET /metrics, "
                    "a web page at /. No authentication: it binds 127.0.0.1 unless --host is given (docs/serving.md).",
    )
    p.add_argument("--model", required=True, help="a preset (digits, photos), a model folder or a Hub repo id")
    p.add_argument("--method", default=None, choices=[*METHOD_TABLE, AUTO],
                   help="the method of requests that name none. auto: the fastest method of --quality's class "
                        "for this model, device and --max-batch, from the model's calibration (lantern calibrate). "
                        f"Default: auto when a calibration exists, else {FALLBACK_METHOD} (or {FALLBACK_NO_DRAFTER} "
                        "for a model without a drafter)")
    p.add_argument("--quality", default=None, choices=list(QUALITY_CLASSES),
                   help="with --method auto: lossless (the target's own distribution) or ar (default: within "
                        "AR's quality on the calibration's yardstick)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the "
                        "unauthenticated server to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port, printed)")
    p.add_argument("--max-batch", type=int, default=8,
                   help=f"rows of the decode batch (default 8, at most {MAX_BATCH})")
    p.add_argument("--max-queue", type=int, default=64,
                   help="images waiting at most; a request that would pass it gets 429 (default 64)")
    p.add_argument("--no-continuous", dest="continuous", action="store_false",
                   help="fill the batch only when it is empty (static batching), instead of at every round")
    p.add_argument("--max-images-per-request", type=int, default=8, help="largest n of one request (default 8)")
    p.add_argument("--max-prompt-chars", type=int, default=1000, help="longest prompt, in characters (default 1000)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds the requests in flight may take to finish before they are "
                        "answered 503 (default 30)")
    add_limit_args(p)
    p.add_argument("--drafter", default=None, metavar="DIR", help="EAGLE drafter folder (default: drafter/ in --model)")
    p.add_argument("--proximity", default=None, metavar="FILE",
                   help="latent proximity table (default: proximity.safetensors in --model)")
    p.add_argument("--t5", default=None, metavar="DIR", help="text-to-image LlamaGen: the T5 encoder folder")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or auto")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="decode --method at every batch size before accepting requests, so that no request "
                        "compiles anything (default: with --compile only; without it --method's weights are "
                        "still loaded and checked at start)")
    p.add_argument("--warm-up-methods", default="", metavar="M,...",
                   help="more methods the warm-up compiles beside --method, at their default settings (a "
                        "compiled server runs every other method and setting eagerly, not compiling while "
                        "requests wait)")
    add_chameleon_args(p)
    add_compile_arg(p)
    add_threads_arg(p)
    p.set_defaults(threads_follow_load=True)  # auto: adapted while serving, not decided once at start
    add_deterministic_arg(p, default=True)  # the server's promise: a request's images do not depend on its batch-mates
    add_trust_checkpoint_arg(p)
    p.set_defaults(func=cmd_serve)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """What bounds one client's hold on the server (docs/serving.md, "Limits")."""
    d = HTTP_DEFAULTS
    g = p.add_argument_group("limits")
    g.add_argument("--max-tree-nodes", type=int, default=None, metavar="N",
                   help="the most nodes one decode round of a request may verify (default: per method, "
                        f"{ROUND_FACTOR}x its default round, at least {MIN_ROUND_NODES}); more is refused (400)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, metavar="BYTES",
                   help=f"largest request body; a larger one is refused as it streams (413; default "
                        f"{d.max_body_bytes})")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes, metavar="BYTES",
                   help=f"largest request line and headers (400; default {d.max_header_bytes})")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="SECONDS",
                   help="seconds a connection has to send a request's headers, whole, from its start and "
                        f"after each answer; then it is closed (default {d.header_timeout:g})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="SECONDS",
                   help=f"seconds a request's body has to arrive, whole (408; default {d.body_timeout:g})")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout, metavar="SECONDS",
                   help=f"seconds an idle connection stays open between requests (default {d.keep_alive_timeout:g})")
    g.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections at most: past it a new one is closed at once "
                        f"(default {d.max_connections})")
    g.add_argument("--allowed-hosts", default="", metavar="HOST[,HOST...]",
                   help="Host header values answered besides localhost, 127.0.0.1, [::1] and --host "
                        "(e.g. a proxy's public name; *.example.com for its subdomains; * for any)")


def check_serve_args(args: argparse.Namespace) -> None:
    """The server's numbers, refused before the model is loaded."""
    check(0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}")
    for flag, value, top in (("--max-batch", args.max_batch, MAX_BATCH), ("--max-queue", args.max_queue, MAX_QUEUE),
                             ("--max-images-per-request", args.max_images_per_request, MAX_QUEUE),
                             ("--max-prompt-chars", args.max_prompt_chars, MAX_PROMPT_CHARS),
                             ("--max-connections", args.max_connections, MAX_CONNECTIONS),
                             ("--max-header-bytes", args.max_header_bytes, 1 << 20),
                             ("--max-body-bytes", args.max_body_bytes, 1 << 30)):
        check(1 <= value <= top, f"{flag} must be in 1..{top}, got {value}")
    check(args.max_tree_nodes is None or args.max_tree_nodes >= 1,
          f"--max-tree-nodes must be >= 1, got {args.max_tree_nodes}")
    check(args.max_images_per_request <= args.max_queue,
          f"--max-images-per-request ({args.max_images_per_request}) must be at most --max-queue ({args.max_queue}): "
          "a larger request could never be queued")
    body = BYTES_PER_PROMPT_CHAR * args.max_prompt_chars + 4096
    check(args.max_body_bytes >= body, f"--max-body-bytes ({args.max_body_bytes}) must hold a prompt of "
                                       f"--max-prompt-chars ({args.max_prompt_chars}): at least {body}")
    for flag, value in (("--drain-timeout", args.drain_timeout), ("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout), ("--keep-alive-timeout", args.keep_alive_timeout)):
        check(0 <= value < float("inf") and (value > 0 or flag == "--drain-timeout"),
              f"{flag} must be a number of seconds {'>= 0' if flag == '--drain-timeout' else '> 0'}, got {value}")
    for host in comma_list(args.allowed_hosts):
        check("*" not in host[1:] and (not host.startswith("*") or host == "*" or host.startswith("*.")),
              f"--allowed-hosts: {host!r}: a wildcard must be a whole first label (*.example.com) or * alone")
    check_compile(args)
    check_quality(args.quality, AUTO if args.method is None else args.method)
    check(warms_up(args) or not comma_list(args.warm_up_methods),
          "--warm-up-methods needs a warm-up (--compile, or --warm-up)")


def warms_up(args: argparse.Namespace) -> bool:
    """Whether the server decodes its methods at every batch size before serving: --warm-up, or by
    default with --compile (so that no request compiles)."""
    return bool(args.warm_up or (args.warm_up is None and args.compile != "off"))


def comma_list(text: str) -> list[str]:
    return [h.strip() for h in text.split(",") if h.strip()]


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes,
                      header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections)


def decode_threads(choice: int | str, device: str, current: int) -> tuple[int, bool]:
    """The decode thread's intra-op threads and whether they follow the machine's load. ``auto`` on
    a CPU: every core (``current``, torch's count), fewer while other processes keep cores busy
    (``lantern.machine.AdaptiveThreads``). The server's own threads (HTTP, VQ decoding, PNG) run
    torch on one thread and take little: on 2 cores, 2 decode threads gave 1.35-1.39x the images/s
    of 1 at 8 clients (benchmarks/RESULTS.md, "OpenMP teams"). A number (``--threads``, already set
    by the command line as torch's count) or another device: ``current``, fixed."""
    return current, choice == "auto" and adapts_threads(device)


def cmd_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    try:
        from lantern.serve.app import create_app
        from lantern.serve.guards import DrainingServer, allowed_hosts, uvicorn_config
    except ImportError as e:
        raise LanternError(f"lantern serve needs the serve extra ({e.name} is missing): "
                           "pip install 'lantern-ar[serve]'") from None
    import torch

    from lantern.api import load
    from lantern.serve.scheduler import Scheduler, side_thread

    threads, adapt = decode_threads(args.threads, args.device, torch.get_num_threads())  # before side_thread
    side_thread()
    sock = bind(args.host, args.port)  # before loading: a taken port fails at once
    pipe = load(args.model, args.drafter, device=args.device, dtype=args.dtype, compile=args.compile, t5=args.t5,
                proximity=args.proximity, deterministic=args.deterministic, **chameleon_options(args))
    scheduler = Scheduler(pipe, max_batch=args.max_batch, max_queue=args.max_queue, continuous=args.continuous,
                          threads=threads, adapt_threads=adapt)
    host, port = sock.getsockname()[:2]
    args.method, auto = server_method(pipe, args.method, args.quality, args.max_batch)
    app = create_app(scheduler, pipeline=pipe, default_method=args.method, auto=auto,
                     max_images_per_request=args.max_images_per_request, max_prompt_chars=args.max_prompt_chars,
                     drain_timeout=args.drain_timeout, model=_model_name(args.model),
                     max_tree_nodes=args.max_tree_nodes, http=http_limits(args),
                     allowed_hosts=allowed_hosts(host, comma_list(args.allowed_hosts)))
    _check_default_round(app.state.serve, args.method)
    condition: int | str = 0 if pipe.kind == "c2i" else "a photo"
    scheduler.resolve(condition, 0, args.method)  # loads and checks --method's drafter and table now
    methods = list(dict.fromkeys([args.method, *comma_list(args.warm_up_methods)]))
    for method in methods[1:]:  # each checked (and its drafter and table read) before any compiles
        try:
            scheduler.resolve(condition, 0, method)
        except LanternError as e:  # resolve names --method, the flag its methods usually come from
            raise LanternError(f"--warm-up-methods: {method}: {str(e).removeprefix('--method ')}") from None
    if warms_up(args):
        scheduler.warm_up(methods, condition)  # in the decode thread, which it starts
    scheduler.start()
    decoding = f"{threads} decode thread{'s' if threads > 1 else ''}{', following the load' if adapt else ''}"
    print(f"lantern serve: {args.model} ({pipe.kind}, --method {args.method}, {decoding}) on "
          f"http://{_url_host(host)}:{port}", flush=True)
    if not ipaddress.ip_address(host).is_loopback:
        print(f"lantern serve: warning: {host} is reachable from other machines and the server has no "
              "authentication (docs/serving.md, Security)", file=sys.stderr, flush=True)
    config = uvicorn_config(app, http_limits(args), graceful_timeout=args.drain_timeout + DRAIN_GRACE)
    server = DrainingServer(config, app.state.serve.drain)
    # uvicorn handles SIGTERM / SIGINT while it serves, then raises the signal again under the
    # handler it found: lantern's for SIGTERM (exit 143), Python's KeyboardInterrupt for SIGINT
    # (exit 130); but a drained server has stopped as asked, and exits 0 either way.
    previous = {sig: signal.signal(sig, _drained) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        scheduler.shutdown(0.0)  # a no-op after the lifespan's; stops the decode thread if startup failed
    if not server.started:
        raise LanternError(f"the server did not start on {host}:{port} (see the log above)")
    print("lantern serve: stopped", file=sys.stderr, flush=True)
    return 0


def server_method(pipe: Any, method: str | None, quality: str | None,
                  max_batch: int) -> tuple[str, MethodChoice | None]:
    """The server's default method, resolved once at start: a named one; ``auto``'s choice from the
    model's calibration at ``max_batch`` (no calibration: a one-line error); with no --method,
    auto's choice when a calibration exists, else lantern++ (sjd-coupled without a drafter), said
    on the console with the command that makes a calibration."""
    if method is not None and method != AUTO:
        return method, None
    try:
        choice = pipe.auto_method(quality, batch_size=max_batch)
    except LanternError as e:
        if method == AUTO:
            raise
        from lantern.serve.plan import runnable_methods

        fallback = FALLBACK_METHOD if FALLBACK_METHOD in runnable_methods(pipe) else FALLBACK_NO_DRAFTER
        print(f"lantern serve: --method {fallback} (no --method given; auto was not possible: {e})", flush=True)
        return fallback, None
    print(f"lantern serve: --method auto --quality {choice.quality}: {choice.explanation}", flush=True)
    return choice.method, choice


def _check_default_round(state: Any, method: str) -> None:
    """--max-tree-nodes below --method's default round would refuse every request that names no method."""
    from lantern.serve.plan import default_round

    nodes, limit = default_round(state.pipeline, method), state.limits.round_nodes[method]
    check(nodes <= limit, f"--max-tree-nodes {limit} is below --method {method}'s default round of {nodes} nodes")


def _model_name(model: str) -> str:
    """What /health calls the model: a preset or Hub id as given, a local folder by its name only
    (its path is nothing a client needs to know)."""
    return Path(model).name if Path(model).exists() else model


def _drained(signum: int, frame: Any) -> None:
    """SIGTERM / SIGINT raised again by uvicorn after its graceful shutdown: nothing left to do."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6, as the address resolves)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise LanternError(f"--host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise LanternError(f"--host {host} --port {port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
