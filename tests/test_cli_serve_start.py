"""``python -m functional_dit serve`` as an operator starts and stops it: a clean start,
one request and a SIGTERM write nothing on stderr (no library notices), and stdout holds
the server's own lines: where it serves, when the drain starts and when it ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT_S = 600  # a cold start (imports, the tiny pipeline) on a loaded 2-core machine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc, url: str, err) -> None:
    end = time.monotonic() + BOOT_S
    while time.monotonic() < end:
        assert proc.poll() is None, open(err.name).read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError(f"server did not start in {BOOT_S} s")


@pytest.mark.slow  # a server subprocess
def test_serve_start_and_drain_write_only_its_own_lines(tmp_path):
    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "functional_dit", "serve", "--model", "flux", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([*cmd, "--steps", "2", "--size", "32x32"], env=env, stdout=out, stderr=err)
        try:
            _wait_up(proc, url, err)
            r = httpx.post(url + "/v1/images/generations", json={"prompt": "a fox"}, timeout=300)
            assert r.status_code == 200, r.text
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert (tmp_path / "err").read_text() == ""
    lines = (tmp_path / "out").read_text().splitlines()
    assert len(lines) == 3 and lines[0] == f"serving flux on {url}", lines
    assert lines[1].startswith("draining: finishing the accepted requests (up to 600 s); new ones get 503"), lines
    assert lines[2].startswith("drained in ") and lines[2].endswith(": every accepted request answered; stopping")
