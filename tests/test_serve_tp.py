"""``torchrun --nproc-per-node 2 -m functional_dit serve --tp 2``: rank 0 serves HTTP,
both ranks run every step on their shard (tiny FLUX.1, gloo on the CPU).

The ``openai`` client's image equals ``fd.sample`` of the request alone (1 uint8 level);
then rank 1 is killed while a request runs: that client gets a 503 within a bounded
time, and torchrun (every rank) exits non-zero. One torchrun start for both checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from test_serve import MSL, _close, _pixels, _port

import functional_dit as fd
from functional_dit import tiny


def _rank_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's children."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            out[rank] = int(pid)
    return out


def test_tp2_server_answers_and_a_killed_rank_is_a_503_and_a_nonzero_exit(tmp_path):
    import openai

    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "functional_dit", "serve"]
    cmd += ["--model", "flux", "--tp", "2", "--port", str(port), "--steps", "2", "--size", "32x32"]
    cmd += ["--max-sequence-length", str(MSL), "--rank-timeout", "20"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < end, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        res = client.images.generate(model="flux", prompt="a red cat", size="32x32", extra_body={"seed": 3})
        pipe = tiny.pipeline("flux")
        ref = fd.sample(fd.from_diffusers(pipe.transformer), pipe, "a red cat", height=32, width=32, steps=2, seed=3,
                        output_type="np", max_sequence_length=MSL)[0]  # fmt: skip
        _close(_pixels(res.data[0].b64_json), (ref * 255).round().astype(int))

        got = {}
        long = {"prompt": "long", "steps": 5000}
        t = threading.Thread(
            target=lambda: got.update(r=httpx.post(url + "/v1/images/generations", json=long, timeout=120))
        )
        t.start()
        while "fd_serve_running_batch_size 1" not in httpx.get(url + "/metrics", timeout=10).text:
            assert time.monotonic() < end + 120 and t.is_alive()
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
        t.join(90)
        assert got["r"].status_code == 503, got["r"].text
        assert time.monotonic() - killed < 60  # bounded by --rank-timeout (20 s) and the poll
        assert proc.wait(90) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
