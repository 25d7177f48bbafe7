"""``torchrun --nproc-per-node 2 -m functional_dit serve --tp 2 | --sp 2 | --dp 2``: rank 0
serves HTTP; tp and sp ranks run every step on their shard (tiny FLUX.1, gloo on the
CPU), dp groups run separate batches.

- tp=2: the ``openai`` client's images, one with a LoRA, equal ``fd.sample`` of the request
  alone (1 uint8 level);
- sp=2: the same with a step cache and true CFG (each branch's First-Block decision is
  summed over the sp ranks);
- dp=2: four concurrent requests (two with step caches) each equal ``fd.sample`` alone, and
  both groups made images (``/metrics``' per-group counter);

then, in each, rank 1 is killed while requests run: every client gets a 503 within a
bounded time, and torchrun (every rank) exits non-zero. One torchrun start per mode.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from test_serve import MSL, _close, _pixels, _port

import functional_dit as fd
import functional_dit.lora as lora
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


@contextlib.contextmanager
def _torchrun(tmp_path, *flags):
    """A 2-rank server with ``flags`` (up and healthy), as (url, process)."""
    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "functional_dit",
    ]
    cmd += ["serve"]  # --standalone: a free rendezvous port (29500 is shared with any other torchrun)
    cmd += ["--model", "flux", *flags, "--port", str(port), "--steps", "2", "--size", "32x32"]
    cmd += ["--max-sequence-length", str(MSL), "--rank-timeout", "20", "--max-steps", str(10**5)]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "torchrun.log", "w")  # noqa: SIM115
    # its own process group: a SIGKILL to torchrun alone would leave its two ranks running
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < end, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # torchrun and whatever rank is still running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


def _reference(prompt, seed, steps=2, cache=None, **kw):
    pipe = tiny.pipeline("flux")
    ref = fd.sample(fd.from_diffusers(pipe.transformer), pipe, prompt, height=32, width=32, steps=steps, seed=seed,
                    output_type="np", max_sequence_length=MSL, cache=cache, **kw)[0]  # fmt: skip
    return (ref * 255).round().astype(int)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _kill_rank_1_while_running(url: str, proc, requests: int) -> None:
    """``requests`` long requests run; rank 1 is killed: each gets a 503, torchrun exits non-zero."""
    got = {}

    def send(i):
        got[i] = httpx.post(url + "/v1/images/generations", json={"prompt": f"long {i}", "steps": 10**5}, timeout=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(requests)]
    [t.start() for t in threads]
    end = time.monotonic() + 120
    while _metric(url, "fd_serve_running_batch_size") < requests:
        assert time.monotonic() < end and all(t.is_alive() for t in threads), got
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)
    [t.join(90) for t in threads]
    assert [got[i].status_code for i in range(requests)] == [503] * requests, [got[i].text for i in got]
    assert time.monotonic() - killed < 60  # bounded by --rank-timeout (20 s) and the poll
    assert proc.wait(90) != 0


@pytest.mark.slow
def test_tp2_server_answers_and_a_killed_rank_is_a_503_and_a_nonzero_exit(tmp_path):
    import openai

    params = fd.from_diffusers(tiny.pipeline("flux").transformer)
    adapter = lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False)
    lora.save(adapter, str(tmp_path / "a.safetensors"))
    with _torchrun(tmp_path, "--tp", "2", f"--lora=a={tmp_path / 'a.safetensors'}") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        res = client.images.generate(model="flux", prompt="a red cat", size="32x32", extra_body={"seed": 3})
        _close(_pixels(res.data[0].b64_json), _reference("a red cat", 3))
        # a LoRA per request on tp-sharded params (its factors split with their columns / rows)
        extra = {"seed": 4, "lora": [{"name": "a", "scale": 0.8}]}
        res = client.images.generate(model="flux", prompt="a dog", size="32x32", extra_body=extra)
        loaded = lora.load(str(tmp_path / "a.safetensors"), params)
        _close(_pixels(res.data[0].b64_json), _reference("a dog", 4, lora=[[(loaded, 0.8)]]))
        assert not np.array_equal(_pixels(res.data[0].b64_json), _reference("a dog", 4))  # the adapter acted
        _kill_rank_1_while_running(url, proc, 1)


@pytest.mark.slow
def test_sp2_server_with_a_step_cache_answers_and_a_killed_rank_is_a_503(tmp_path):
    import openai

    with _torchrun(tmp_path, "--sp", "2") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        extra = {"seed": 5, "steps": 3, "cache": "fbcache:1.2", "true_cfg": 2.0, "negative_prompt": "x"}
        res = client.images.generate(model="flux", prompt="sun", size="32x32", extra_body=extra)
        run = fd.CacheRun("fbcache:1.2")
        _close(_pixels(res.data[0].b64_json), _reference("sun", 5, 3, run, true_cfg=2.0, negative_prompt="x"))
        assert run.skipped() > 0 and _metric(url, "fd_serve_cache_skipped_total") == run.skipped()
        _kill_rank_1_while_running(url, proc, 1)


@pytest.mark.slow
def test_dp2_groups_run_concurrent_requests_and_a_killed_rank_is_a_503(tmp_path):
    bodies = [
        dict(prompt="a red cat", seed=3, steps=3),
        dict(prompt="a dog", seed=4, steps=2, cache="magcache:0.3"),
        dict(prompt="sun", seed=5, steps=3, true_cfg=2.0, negative_prompt="x", cache="fbcache:1.2"),
        dict(prompt="a tree", seed=6, steps=2),
    ]
    with _torchrun(tmp_path, "--dp", "2") as (url, proc):
        got = [None] * len(bodies)

        def send(i):
            got[i] = httpx.post(url + "/v1/images/generations", json=bodies[i], timeout=300)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        [t.start() for t in threads]
        [t.join(300) for t in threads]
        for b, r in zip(bodies, got):
            assert r.status_code == 200, r.text
            kw = {k: b[k] for k in ("true_cfg", "negative_prompt") if k in b}
            run = fd.CacheRun(b["cache"]) if "cache" in b else None
            _close(_pixels(r.json()["data"][0]["b64_json"]), _reference(b["prompt"], b["seed"], b["steps"], run, **kw))
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'fd_serve_group_images_total{group="0"}' in text and 'fd_serve_group_images_total{group="1"}' in text
        _kill_rank_1_while_running(url, proc, 2)  # least loaded: one on each group
