"""``serve --xla-buckets 1,2,4 --xla-warmup --xla-strict``: the server on the fixed-shape
step graphs (`functional_dit.serve._xla`), driven over HTTP as users drive it.

On the CPU (the suite) the padded steps run eagerly; where torch_xla is installed the same
tests run once more with ``--device xla`` (``PJRT_DEVICE=CPU python -m pytest
tests/test_serve_xla.py``, docs/xla.md "Serving"): there ``fd_serve_xla_compiles_total``
must not move after warm-up. A stream of requests arriving alone, three at once and two at
once, with mixed step counts, true CFG and a LoRA: each image within 2 uint8 levels of
``fd.sample`` of it alone on the CPU (measured: ≤ 1 on both); an unwarmed size is a 400
naming size, a step cache a 400 naming cache; SIGTERM drains and exits 0. Qwen-Image
(its text padded to one length): prompts of other token counts than warm-up's, with and
without CFG, equal ``fd.sample`` and compile nothing. Without torch_xla, ``--device xla``
is one line naming what to install.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import numpy as np
import pytest
from test_serve import MSL, Server, _pixels

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
DEVICES = ["cpu"] + (["xla"] if HAS_XLA else [])
FLAGS = ("--xla-buckets", "1,2,4", "--xla-warmup", "--xla-strict", "--max-steps", "400")


@pytest.fixture(scope="module", params=DEVICES)
def env(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("serve_xla"))
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    path = os.path.join(tmp, "a.safetensors")
    lora.save(lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False), path)
    server = Server(tmp, f"--lora=a={path}", "--device", request.param, *FLAGS)
    try:
        server.wait_up()
        yield dict(server=server, params=params, pipe=pipe, adapter=lora.load(path, params))
    finally:
        server.stop()


def _alone(env, body, msl=MSL) -> np.ndarray:
    lo = [(env["adapter"], e["scale"]) for e in body.get("lora", [])] or None
    kw = {k: body[k] for k in ("true_cfg", "negative_prompt") if k in body}
    img = fd.sample(env["params"], env["pipe"], body["prompt"], height=32, width=32, steps=body["steps"],
                    seed=body["seed"], lora=lo, output_type="np", max_sequence_length=msl, **kw)[0]  # fmt: skip
    return (img * 255).round().astype(int)


def _at_once(server, bodies) -> list:
    out = [None] * len(bodies)

    def post(k):
        out[k] = server.post(bodies[k], timeout=600)

    threads = [threading.Thread(target=post, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


@pytest.mark.slow
def test_stream_equals_fd_sample_alone_and_compiles_nothing_after_warmup(env):
    server = env["server"]
    before = server.metrics()
    assert before["fd_serve_xla_compiles_after_warmup_total"] == 0
    B = lambda p, seed, steps, **kw: dict(prompt=p, seed=seed, steps=steps, size="32x32", **kw)  # noqa: E731
    waves = [
        [B("a red cat", 1, 3)],  # alone
        [B("a dog", 2, 6), B("sky", 3, 8, lora=[{"name": "a", "scale": 0.8}]), B("a boat", 4, 7)],  # bucket 4
        [B("a red cat", 5, 2, lora=[{"name": "a", "scale": 0.5}]), B("a tree", 6, 5, true_cfg=2.0)],
    ]
    for wave in waves:
        for body, r in zip(wave, _at_once(server, wave)):
            assert r.status_code == 200, r.text
            got = _pixels(r.json()["data"][0]["b64_json"])
            assert np.abs(got - _alone(env, body)).max() <= 2, body
    lora_free = _alone(env, B("sky", 3, 8))
    assert np.abs(_alone(env, waves[1][1]) - lora_free).max() > 2  # the LoRA request differs without it
    after = server.metrics()
    assert after["fd_serve_xla_compiles_total"] == before["fd_serve_xla_compiles_total"]
    assert after["fd_serve_xla_compiles_after_warmup_total"] == 0
    assert after['fd_serve_xla_rows_total{kind="item"}'] == 3 + 6 + 8 + 7 + 2 + 5  # every item's every step
    # every step ran at a bucket: item + pad rows are the buckets' rows; a step of 3 items
    # (wave 2, if its three overlapped: arrival order on a loaded machine decides) ran in
    # bucket 4 with one pad row, the only bucket these waves can pad
    buckets = {int(k.split('"')[1]): v for k, v in after.items() if k.startswith("fd_serve_xla_bucket_steps_total")}
    pads = after['fd_serve_xla_rows_total{kind="pad"}']
    assert pads + after['fd_serve_xla_rows_total{kind="item"}'] == sum(b * n for b, n in buckets.items())
    assert set(buckets) <= {1, 2, 4} and (pads > 0) == (buckets.get(4, 0) > 0)


@pytest.mark.slow
def test_unwarmed_size_and_step_cache_are_400s_naming_them(env):
    server = env["server"]
    r = server.post(dict(prompt="a cat", size="64x64"))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "size", err
    assert err["message"] == "size: expected one of the warmed sizes 32x32 (--xla-strict), got '64x64'"
    r = server.post(dict(prompt="a cat", size="32x32", cache="fbcache:0.08"))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "cache" and "not under --device xla" in err["message"], err


@pytest.mark.slow
def test_sigterm_drains_and_exits_0(env):
    server = env["server"]
    running = {}
    t = threading.Thread(target=lambda: running.update(r=server.post(dict(prompt="last", steps=40, seed=9), 600)))
    t.start()
    end = time.monotonic() + 120
    while not server.metrics()["fd_serve_running_batch_size"]:
        assert time.monotonic() < end and t.is_alive(), "the request never ran"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    t.join(600)
    assert running["r"].status_code == 200
    assert server.proc.wait(120) == 0


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_device_xla_without_torch_xla_is_one_line(capsys):
    from _cli import one_line_error

    err = one_line_error(["serve", "--model", "flux", "--device", "xla"], capsys)
    assert err.startswith('error: serve --device xla needs torch_xla: pip install "torch_xla"'), err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--xla-buckets", "0,2"], "error: --xla-buckets: expected positive batch sizes such as 1,2,4,8, got '0,2'"),
        (["--xla-buckets", "1,2", "--xla-strict"], "error: --xla-strict: expected with --xla-warmup"),
        (["--xla-warmup"], "error: --xla-warmup/--xla-strict: expected with --device xla or --xla-buckets"),
        (["--xla-buckets", "1", "--xla-warmup", "--xla-sizes", "32"], "error: --xla-sizes: expected sizes WxH"),
        (
            ["--xla-buckets", "1", "--xla-cache", "/tmp"],
            "error: --xla-cache: expected with --device xla, got --device cpu",
        ),
        # tp / sp on XLA devices: refused by name (the fixed backend runs them on the CPU, under torchrun)
        (["--device", "xla", "--tp", "2"], "error: --tp/--sp: expected 1 with --device xla, got --tp 2 --sp 1"),
        (["--device", "xla", "--sp", "2"], "error: --tp/--sp: expected 1 with --device xla, got --tp 1 --sp 2"),
        # --tp/--sp/--dp without torchrun: the world size named
        (
            ["--xla-buckets", "1,2", "--tp", "2"],
            "error: --dp/--sp/--tp: expected dp*sp*tp = torchrun's WORLD_SIZE (1), got 1*1*2 = 2",
        ),
    ],
)
def test_bad_xla_flags_are_one_line_errors(flags, message, capsys):
    from _cli import one_line_error

    assert one_line_error(["serve", "--model", "flux", *flags], capsys).startswith(message)


@pytest.fixture(scope="module", params=DEVICES)
def qwen(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("serve_xla_qwen"))
    pipe = tiny.pipeline("qwen-image")
    params = fd.from_diffusers(pipe.transformer)
    server = Server(tmp, "--device", request.param, *FLAGS, model="tiny:qwen-image", msl=None)
    try:
        server.wait_up()
        yield dict(server=server, params=params, pipe=pipe)
    finally:
        server.stop()


@pytest.mark.slow
def test_qwen_image_prompts_of_any_length_compile_nothing_after_warmup(qwen):
    """Qwen-Image's text (as long as its prompt) is padded to one length: prompts and
    negative prompts of other token counts than warm-up's share its graphs."""
    server = qwen["server"]
    before = server.metrics()["fd_serve_xla_compiles_total"]
    B = lambda p, seed, steps, **kw: dict(prompt=p, seed=seed, steps=steps, size="32x32", **kw)  # noqa: E731
    wave = [
        B("a big blue dog on a green hill at noon", 2, 4),
        B("sky", 3, 5),
        B("a boat on a lake, oil painting", 4, 3, true_cfg=3.0, negative_prompt="blurry, low quality"),
    ]
    for body, r in zip(wave, _at_once(server, wave)):
        assert r.status_code == 200, r.text
        assert np.abs(_pixels(r.json()["data"][0]["b64_json"]) - _alone(qwen, body, None)).max() <= 2, body
    after = server.metrics()
    assert after["fd_serve_xla_compiles_total"] == before and after["fd_serve_xla_compiles_after_warmup_total"] == 0
