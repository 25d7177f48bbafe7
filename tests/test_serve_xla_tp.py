"""``torchrun --nproc-per-node 2 -m functional_dit serve --xla-buckets 1,2 --xla-warmup``
with ``--tp 2`` and with ``--sp 2``: the fixed-shape backend (`functional_dit.serve._xla`,
eager on the CPU over gloo: a check of a deployment's batching without a TPU) on sharded
params, every rank running the same padded step graphs in the same order.

Through the ``openai`` client, one torchrun start per mode: a request alone, then a long
request with a LoRA and a short one sent while it runs (mixed step counts: the short one's
steps all run in bucket 2 beside it), on sp also a true-CFG request; each image within
1 uint8 level of ``fd.sample`` of that request alone in one process (measured: 0), the
LoRA request not equal to the same request without it; ``/metrics``' rows and per-bucket
step counters exactly those steps; then SIGTERM to rank 0 with a request running: it is
answered, and torchrun (every rank) exits 0. ``--dp 2`` (a whole model per rank, each
group its own fixed-shape batches): two requests at once, one per group, each equal to
``fd.sample`` alone, ``/metrics``' rows and bucket steps summed over both groups; where
torch_xla is installed once more with ``--device xla`` (``PJRT_DEVICE=CPU python -m pytest
tests/test_serve_xla_tp.py``: each rank its own XLA device), no compile after warm-up on
either rank. (``--device xla --tp/--sp`` is refused: docs/xla.md "Under torchrun".)
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from test_serve import _close, _pixels
from test_serve_tp import _metric, _rank_pids, _reference, _torchrun

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
DEVICES = ["cpu"] + (["xla"] if HAS_XLA else [])  # dp=2 on torch_xla too, where it is installed
LONG, SHORT = 40, 4  # steps of the request running and of the one that joins it


def _metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("fd_serve_xla"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _generate(client, prompt: str, **extra) -> np.ndarray:
    res = client.images.generate(model="flux", prompt=prompt, size="32x32", extra_body=extra)
    return _pixels(res.data[0].b64_json)


def _wait_running(url: str, thread: threading.Thread) -> None:
    end = time.monotonic() + 120
    while _metric(url, "fd_serve_running_batch_size") < 1:
        assert time.monotonic() < end and thread.is_alive(), "the request never ran"
        time.sleep(0.02)


def _serve_and_drain(tmp_path, mode: str, cfg: bool) -> None:
    """One torchrun start with ``mode`` (``--tp`` / ``--sp``): the requests, the counters, the drain."""
    import openai

    params = fd.from_diffusers(tiny.pipeline("flux").transformer)
    path = str(tmp_path / "a.safetensors")
    lora.save(lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False), path)
    flags = (mode, "2", "--xla-buckets", "1,2", "--xla-warmup", f"--lora=a={path}")
    with _torchrun(tmp_path, *flags) as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert _metrics(url)["fd_serve_xla_warmup_seconds"] > 0  # warmed before /health turned 200
        _close(_generate(client, "a red cat", seed=3, steps=3), _reference("a red cat", 3, 3))
        steps = {1: 3}
        if cfg:  # its own key (CFG rows): alone in bucket 1
            got = _generate(client, "sun", seed=5, steps=3, true_cfg=2.0, negative_prompt="x")
            _close(got, _reference("sun", 5, 3, true_cfg=2.0, negative_prompt="x"))
            steps[1] += 3
        got = {}
        ad = {"lora": [{"name": "a", "scale": 0.8}]}
        long = threading.Thread(target=lambda: got.update(long=_generate(client, "a dog", seed=4, steps=LONG, **ad)))
        long.start()
        _wait_running(url, long)
        got["short"] = _generate(client, "a tree", seed=6, steps=SHORT)
        long.join(300)
        adapter = lora.load(path, params)
        _close(got["long"], _reference("a dog", 4, LONG, lora=[[(adapter, 0.8)]]))
        assert not np.array_equal(got["long"], _reference("a dog", 4, LONG))  # the adapter acted
        _close(got["short"], _reference("a tree", 6, SHORT))
        m = _metrics(url)  # the short request's steps all in bucket 2, beside the long one's
        assert m['fd_serve_xla_rows_total{kind="item"}'] == sum(steps.values()) + LONG + SHORT
        assert m['fd_serve_xla_rows_total{kind="pad"}'] == 0  # at most 2 items: buckets 1 and 2 fit exactly
        buckets = {k: v for k, v in m.items() if k.startswith("fd_serve_xla_bucket_steps_total")}
        want = {1: steps[1] + LONG - SHORT, 2: SHORT}
        assert buckets == {f'fd_serve_xla_bucket_steps_total{{bucket="{b}"}}': n for b, n in want.items()}, m
        assert m["fd_serve_xla_compiles_after_warmup_total"] == 0
        _drain(url, proc, tmp_path / "torchrun.log")


def _drain(url: str, proc, log) -> None:
    """SIGTERM to rank 0 with a request running: it is answered; every rank exits 0."""
    got = {}
    t = threading.Thread(target=lambda: got.update(r=httpx.post(url + "/v1/images/generations",
                         json={"prompt": "last", "steps": 60, "seed": 9}, timeout=300)))  # fmt: skip
    t.start()
    _wait_running(url, t)
    os.kill(_rank_pids(proc.pid)[0], signal.SIGTERM)
    t.join(300)
    assert got["r"].status_code == 200, got["r"].text
    assert proc.wait(120) == 0, open(log).read()[-4000:]


@pytest.mark.slow
def test_tp2_fixed_backend_equals_fd_sample_and_drains(tmp_path):
    _serve_and_drain(tmp_path, "--tp", cfg=False)


@pytest.mark.slow
def test_sp2_fixed_backend_equals_fd_sample_and_drains(tmp_path):
    _serve_and_drain(tmp_path, "--sp", cfg=True)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_dp2_fixed_backend_groups_and_metrics_summed_over_groups(tmp_path, device):
    import openai

    with _torchrun(tmp_path, "--device", device, "--dp", "2", "--xla-buckets", "1,2", "--xla-warmup") as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        bodies = {"a red cat": (3, 5), "a dog": (4, 3)}  # prompt: (seed, steps)
        got = {}
        threads = [
            threading.Thread(target=lambda p=p, s=s, n=n: got.update({p: _generate(client, p, seed=s, steps=n)}))
            for p, (s, n) in bodies.items()
        ]
        [t.start() for t in threads]
        [t.join(300) for t in threads]
        for p, (s, n) in bodies.items():
            _close(got[p], _reference(p, s, n))
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'fd_serve_group_images_total{group="1"} 1' in text  # the second request ran on group 1
        rows, end = sum(n for _, n in bodies.values()), time.monotonic() + 30
        while (m := _metrics(url))['fd_serve_xla_rows_total{kind="item"}'] < rows:  # group 1's: the next turn
            assert time.monotonic() < end, m
            time.sleep(0.2)
        assert m['fd_serve_xla_rows_total{kind="item"}'] == rows and m['fd_serve_xla_rows_total{kind="pad"}'] == 0
        assert m['fd_serve_xla_bucket_steps_total{bucket="1"}'] == rows  # each group's batch of one
        assert m["fd_serve_xla_compiles_after_warmup_total"] == 0  # (on xla: both ranks' torch_xla counts)
        assert (m["fd_serve_xla_compiles_total"] > 0) == (device == "xla")
        _drain(url, proc, tmp_path / "torchrun.log")
