"""``lantern serve`` as a process: it binds 127.0.0.1 only, answers, and on SIGTERM finishes the
request in flight (200) and exits 0; bad flags end with one ``lantern: error:`` line before any
model is loaded."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serve_process

from lantern.cli.main import main

EXIT_TIMEOUT = 30.0


def _busy_rows(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    match = re.search(r"^lantern_busy_rows (\S+)$", text, flags=re.M)
    assert match, text
    return float(match.group(1))


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (the one a default route would use), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent for a UDP connect
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_serve_binds_loopback_answers_and_drains_on_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serve_process(log, "--method", "sjd-coupled", "--max-batch", "2", "--warm-up") as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        assert f"on http://127.0.0.1:{port}" in log.read_text()  # the bound host, as the log says
        assert "--method sjd-coupled, 1 decode thread)" in log.read_text()  # OMP_NUM_THREADS=1: fixed
        outside = _outside_address()
        if outside is not None:  # reachable from this machine only
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{outside}:{port}/health", timeout=5)
        r = httpx.post(f"{url}/v1/images/generations", json={"label": 4, "seed": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["method"] == "sjd-coupled"

        # SIGTERM while a request is in flight: it still completes, then the process exits 0.
        answer: dict[str, Any] = {}

        def post() -> None:
            try:
                answer["response"] = httpx.post(f"{url}/v1/images/generations",
                                                json={"label": 1, "n": 2, "method": "ar"}, timeout=60)
            except httpx.HTTPError as e:  # reported by the assertion below
                answer["error"] = e

        client = threading.Thread(target=post)
        client.start()
        deadline = time.monotonic() + 30
        while _busy_rows(url) == 0:
            assert time.monotonic() < deadline and client.is_alive(), "the request never started decoding"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        client.join(60)
        assert not client.is_alive()
        response = answer.get("response")
        assert response is not None and response.status_code == 200, answer
        assert len(response.json()["data"]) == 2
        assert proc.wait(EXIT_TIMEOUT) == 0, log.read_text()
    text = log.read_text()
    assert "lantern serve: stopped" in text and "Traceback" not in text, text
    with pytest.raises(httpx.ConnectError):  # gone
        httpx.get(f"{url}/health", timeout=5)


def test_ctrl_c_stops_the_server_as_sigterm_does(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) drains and exits 0 with the same last line. Old behaviour (a probe,
    2026-11-29): uvicorn drained, then raised SIGINT again under Python's handler, and the process
    ended with "lantern: interrupted" and exit 130 (what the SIGTERM test above would catch for
    SIGTERM without lantern's handler)."""
    log = tmp_path / "serve.log"
    with serve_process(log, "--method", "ar", "--max-batch", "1") as (proc, url):
        r = httpx.post(f"{url}/v1/images/generations", json={"label": 4, "seed": 2}, timeout=60)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(EXIT_TIMEOUT) == 0, log.read_text()
    text = log.read_text()
    assert text.rstrip().endswith("lantern serve: stopped"), text
    assert "interrupted" not in text and "Traceback" not in text, text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-images-per-request", "100", "--max-queue", "8"], "--max-images-per-request .* --max-queue"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-batch", "0"], "--max-batch must be in 1..256"),
        (["--max-batch", "1000000000", "--warm-up"], "--max-batch must be in 1..256"),  # never started (issue 38)
        (["--max-connections", "0"], "--max-connections must be in 1..65536"),
        (["--body-timeout", "0"], "--body-timeout must be a number of seconds > 0"),
        (["--header-timeout", "inf"], "--header-timeout must be a number of seconds > 0"),
        (["--max-body-bytes", "1000"], "--max-body-bytes .* must hold a prompt of --max-prompt-chars"),
        (["--max-tree-nodes", "0"], "--max-tree-nodes must be >= 1"),
        (["--allowed-hosts", "a.*.example"], "--allowed-hosts: 'a.\\*.example': a wildcard"),
        (["--max-tree-nodes", "8", "--method", "sjd", "--port", "0"],  # after loading: the round is the model's
         "--max-tree-nodes 8 is below --method sjd's default round of 17 nodes"),
        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid'"),
        (["--warm-up-methods", "sjd"], r"--warm-up-methods needs a warm-up \(--compile, or --warm-up\)"),
        (["--warm-up", "--warm-up-methods", "sjd,nope", "--port", "0"],  # after loading: checked against the model
         "--warm-up-methods: nope: must be one of ar, sd, .*, got 'nope'"),
    ],
)
def test_bad_serve_flags_end_with_one_error_line(flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "digits", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lantern: error: ") and err.count("\n") == 1 and re.search(message, err), err


def test_a_taken_port_is_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--model", "no-such-model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "in use" in err, err
    assert time.monotonic() - started < 5
