"""``python -m functional_dit serve``: a live server on 127.0.0.1, driven as users drive it.

Two servers of the tiny FLUX.1 pipeline start once for the module (32x32 images, a
32-token text limit, two LoRA files): A (``--max-batch 4 --max-queue 16 --journal``) and
B (``--request-timeout 30``). The oracle is ``fd.sample`` of the same request
alone in this process: every image within 1 uint8 level per pixel.

- the ``openai`` client's ``images.generate`` (extension fields in ``extra_body``);
- 16 concurrent requests with mixed prompts, seeds, step counts and two LoRAs;
- a request arriving while another runs joins its batch (``/metrics``' joined counter);
- a request of another size joins the running one's model calls (mixed resolutions,
  ``/metrics``' fd_serve_mixed_resolution_calls_total), each image equal to fd.sample alone;
  so on Qwen-Image, FLUX.3 and Qwen-Image 2.1 servers (prompts of two lengths too; 2.1
  with its prefix KV caches);
- four requests with step caches (FBC, MagCache, TaylorSeer, FasterCache) join a no-cache
  request's batch, each equal to ``fd.sample`` of it alone with that cache;
- FLUX.3's flow map and Qwen-Image 2.1 served (a server each): CFG and a step cache,
  equal to ``fd.sample``;
- ``--model`` resolves names as ``generate`` does (``tiny:flux``; errors name ``--model``);
- each bad input is a 400 naming its field; a full queue a 429 with Retry-After; clients
  that disconnect leave the batch (running and queued back to 0); a slow request a 504;
- SIGTERM drains (server A, the last test to use it: its request timeout is the default
  600 s, so a loaded machine's slow steps cannot turn the drained request into a 504):
  503 to new requests, the running one answered, exit status 0, the journal holding it
  accepted and done; ``--resume-journal`` (in process) re-runs an
  unfinished journal entry to the same image and fails one it cannot run, by name.
Every wait is bounded; the servers are stopped by the fixture.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny

MSL = 32
TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOOT_S = 600  # a cold start (imports, the tiny pipeline) on a loaded 2-core machine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp, *extra, model="flux", msl=MSL, env=None):
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--model", model, "--port", str(self.port), "--steps", "2", "--size", "32x32"]
        args += ["--max-sequence-length", str(msl)] if msl else []
        args += list(extra)
        env = {**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})}
        self.log = open(os.path.join(tmp, f"server-{self.port}.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "functional_dit", "serve", *args], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip

    def wait_up(self) -> None:
        end = time.monotonic() + BOOT_S
        while time.monotonic() < end:
            assert self.proc.poll() is None, open(self.log.name).read()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"server did not start in {BOOT_S} s")

    def metrics(self) -> dict:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def post(self, body, timeout=120.0):
        return httpx.post(self.url + "/v1/images/generations", json=body, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("serve"))
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    paths, loras_dir = {}, os.path.join(tmp, "loras")  # server c's --lora-dir
    os.makedirs(os.path.join(loras_dir, "sub"))
    for name, rank, seed in (("a", 4, 1), ("b", 2, 2)):
        paths[name] = os.path.join(loras_dir, f"{name}.safetensors")
        lora.save(lora.init(params.config, rank=rank, alpha=8.0, seed=seed, zero_b=False), paths[name])
    shutil.copy(paths["a"], os.path.join(tmp, "outside.safetensors"))  # a valid file out of --lora-dir
    os.symlink(os.path.join(tmp, "outside.safetensors"), os.path.join(loras_dir, "link.safetensors"))
    open(os.path.join(loras_dir, "junk.safetensors"), "wb").write(b"not a safetensors file")
    loras = [f"--lora={n}={p}" for n, p in paths.items()]
    journal = os.path.join(tmp, "journal.jsonl")
    big = ("--max-steps", str(10**6))  # the anchor, timeout and full-queue requests run "forever"
    a = Server(tmp, *loras, "--max-batch", "4", "--max-queue", "16", "--journal", journal, *big)
    b = Server(tmp, "--request-timeout", "30", *big)
    # the defaults (--max-steps 200), adapter "a" from start-up, more from --lora-dir, the token from the environment
    c = Server(tmp, f"--lora=a={paths['a']}", "--lora-dir", loras_dir, env={"FD_SERVE_ADMIN_TOKEN": TOKEN})
    d = Server(tmp, "--max-batch", "1", *big)  # priorities: one image runs at a time
    try:
        a.wait_up(), b.wait_up(), c.wait_up(), d.wait_up()
        adapters = {n: lora.load(p, params) for n, p in paths.items()}
        servers = dict(a=a, b=b, c=c, d=d)
        yield dict(**servers, params=params, pipe=pipe, adapters=adapters, journal=journal, tmp=tmp, paths=paths)
    finally:
        a.stop(), b.stop(), c.stop(), d.stop()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def _reference(env, prompts, seeds, steps, lora_lists=None, **kw) -> list[np.ndarray]:
    # fd.sample of several prompts in one call: only for requests without a step cache (a
    # cache decides per call; a served image decides alone: `cache._items`)
    """fd.sample's uint8 images (its "np" output rounded as PIL images are)."""
    lists = None
    if lora_lists is not None and any(lora_lists):
        lists = [[(env["adapters"][n], s) for n, s in ls] for ls in lora_lists]
    out = fd.sample(env["params"], env["pipe"], prompts, height=32, width=32, steps=steps, seed=seeds, lora=lists,
                    output_type="np", max_sequence_length=MSL, **kw)  # fmt: skip
    return [(img * 255).round().astype(int) for img in out]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert np.abs(got - want).max() <= 1  # 1 uint8 level: batch vs alone GEMMs (measured 0 levels)


def test_openai_client_images_equal_fd_sample(env):
    import openai

    client = openai.OpenAI(base_url=env["a"].url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"seed": 7, "steps": 2, "lora": [{"name": "a", "scale": 0.8}], "true_cfg": 2.0, "negative_prompt": "dim"}
    res = client.images.generate(model="flux", prompt="a lighthouse", n=2, size="32x32", extra_body=extra)
    want = _reference(env, ["a lighthouse"] * 2, [7, 8], 2, [[("a", 0.8)]] * 2, true_cfg=2.0, negative_prompt="dim")
    assert len(res.data) == 2
    for d, w in zip(res.data, want):
        _close(_pixels(d.b64_json), w)
    assert [m.id for m in client.models.list().data] == ["flux"]


@pytest.mark.parametrize(
    "model, kind, cache",
    [("flux3-distilled", "flux3-distilled", "magcache:0.3"), ("tiny:qwen-image-2.1", "qwen-image-2.1", "fbcache:1.5")],
)
def test_new_families_served_with_cfg_and_a_cache_equal_fd_sample(tmp_path, model, kind, cache):
    """FLUX.3's step-distilled pipeline (a flow map: each image's prediction targets its own
    next timestep) and Qwen-Image 2.1 (each image its own model call, its own prefix KV
    caches and a cache state per CFG branch), each on a server of its own, through the
    openai client: two images with true CFG and a step cache, each equal to ``fd.sample``
    alone with that cache (as RGB: Qwen-Image 2.1's images are RGBA), which skipped steps."""
    import openai

    server = Server(str(tmp_path), model=model, msl=None)
    try:
        server.wait_up()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        extra = {"seed": 7, "steps": 3, "true_cfg": 2.0, "negative_prompt": "dim", "cache": cache}
        res = client.images.generate(model=model, prompt="a lighthouse", n=2, size="32x32", extra_body=extra)
    finally:
        server.stop()
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    skipped = 0
    for j, d in enumerate(res.data):
        run = fd.CacheRun(cache)
        want = fd.sample(params, pipe, "a lighthouse", height=32, width=32, steps=3, seed=7 + j, true_cfg=2.0,
                         negative_prompt="dim", cache=run)[0]  # fmt: skip
        _close(_pixels(d.b64_json), np.asarray(want.convert("RGB")).astype(int))
        skipped += run.skipped()
    assert skipped > 0, "the cache must skip some steps, or the test shows nothing"


def test_16_concurrent_mixed_requests_all_correct(env):
    server, names = env["a"], [[], [("a", 1.0)], [("b", 0.5)], [("a", 0.5), ("b", 1.0)]]
    bodies = [
        dict(prompt=f"scene {i % 5}", seed=100 + i, steps=2 + i % 2, size="32x32",
             lora=[{"name": n, "scale": s} for n, s in names[i % 4]])
        for i in range(16)
    ]  # fmt: skip
    got = [None] * 16

    def send(i):
        got[i] = server.post(bodies[i], timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join(320) for t in threads]
    assert [r.status_code for r in got] == [200] * 16, [r.text[:200] for r in got if r.status_code != 200]
    for steps in (2, 3):
        idx = [i for i in range(16) if bodies[i]["steps"] == steps]
        want = _reference(env, [bodies[i]["prompt"] for i in idx], [bodies[i]["seed"] for i in idx], steps,
                          [names[i % 4] for i in idx])  # fmt: skip
        for i, w in zip(idx, want):
            _close(_pixels(got[i].json()["data"][0]["b64_json"]), w)


def test_the_prompt_check_leaves_the_engines_tokenizer_as_the_engine_set_it():
    """The HTTP side checks a prompt's length with its own tokenizer copy. A fast tokenizer
    holds padding and truncation as settings on the object; with one shared object, the
    check (no padding) between the engine thread's setting max_length padding and its
    encoding left that prompt unpadded: 7 tokens where 32 were asked, another image (seen
    in test_16_concurrent_mixed_requests_all_correct, 1 run in 10)."""
    from functional_dit.serve import _app, _engine

    pipe = tiny.pipeline("flux")
    service = _app.Service(_engine.Engine(fd.from_diffusers(pipe.transformer), pipe), "flux", defaults={},
                           limits={"max_sequence_length": MSL})  # fmt: skip
    tok = pipe.tokenizer_2
    padded = dict(padding="max_length", max_length=MSL, truncation=True)
    tok("scene 0", **padded)  # the engine's encode_prompt sets these on the backend, then encodes
    settings = (tok.backend_tokenizer.padding, tok.backend_tokenizer.truncation)
    assert settings[0] is not None  # the check below would clear them on a shared object
    service._prompt_length("prompt", "a prompt of several words")
    assert (tok.backend_tokenizer.padding, tok.backend_tokenizer.truncation) == settings
    assert service.tokenizer is not tok


@contextlib.contextmanager
def _anchor(server, before: dict, **fields):
    """A request of 10**6 steps (never done, on any machine) sent on a raw socket, running
    (two steps taken) on entry; the socket is closed on exit, so it leaves at the next
    step. Whatever is sent meanwhile joins a running batch, however fast or loaded the
    machine (a 2,000-step first request finished too early unloaded and took over 300 s
    at load 9 on 2 cores)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps(dict(prompt="anchor", steps=10**6, **fields)).encode()
    head = "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        end = time.monotonic() + 120
        while server.metrics()["fd_serve_step_seconds_count"] < before["fd_serve_step_seconds_count"] + 2:
            assert time.monotonic() < end, "the anchor request never ran two steps"
            time.sleep(0.05)
        yield
    finally:
        sock.close()


def test_a_request_arriving_mid_batch_joins_it(env):
    server = env["a"]
    before = server.metrics()
    with _anchor(server, before):
        second = server.post(dict(prompt="short", steps=2, seed=3), timeout=300)
    after = server.metrics()
    assert second.status_code == 200
    assert after["fd_serve_joined_running_batch_total"] >= before["fd_serve_joined_running_batch_total"] + 1
    _close(_pixels(second.json()["data"][0]["b64_json"]), _reference(env, ["short"], [3], 2)[0])


def test_two_sizes_share_model_calls_and_equal_fd_sample_alone(env):
    """Mixed resolutions (on by default): a 48x48 request for two images with true CFG
    joins the running 32x32 anchor's model calls (three images in one padded call, within
    --max-padding), /metrics counts each such call, and each image equals ``fd.sample``
    of it alone at its size."""
    server = env["a"]
    before = server.metrics()
    body = dict(prompt="wide", size="48x48", n=2, steps=2, seed=5, true_cfg=2.0, negative_prompt="dim")
    with _anchor(server, before):
        res = server.post(body, timeout=300)
    after = server.metrics()
    assert res.status_code == 200, res.text
    calls = after["fd_serve_mixed_resolution_calls_total"] - before["fd_serve_mixed_resolution_calls_total"]
    assert calls >= 2, "both steps of the 48x48 images shared a call with the 32x32 anchor"
    want = fd.sample(env["params"], env["pipe"], "wide", height=48, width=48, steps=2, seed=5, num_images_per_prompt=2,
                     true_cfg=2.0, negative_prompt="dim", output_type="np", max_sequence_length=MSL)  # fmt: skip
    for d, w in zip(res.json()["data"], want):
        got = _pixels(d["b64_json"])
        assert got.shape[:2] == (48, 48)
        _close(got, (w * 255).round().astype(int))


CACHES = ["fbcache:0.8", "magcache:0.3", "taylorseer:interval=2,warmup=1,order=1", "fastercache:skip=2"]


def test_per_request_caches_join_a_no_cache_batch_and_equal_fd_sample_alone(env):
    """A no-cache request runs (`_anchor`); four requests with step caches, sent by the openai client, join its batch
    (the joined counter) and each equals fd.sample of it alone with that cache."""
    import openai

    server = env["a"]
    before = server.metrics()
    with _anchor(server, before):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = [None] * len(CACHES)

        def send(i):
            extra = {"seed": 20 + i, "steps": 5, "cache": CACHES[i]}
            if i == 3:  # two branches, each deciding alone
                extra |= {"true_cfg": 2.0, "negative_prompt": "dim"}
            got[i] = client.images.generate(model="flux", prompt=f"cached {i}", size="32x32", extra_body=extra)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(CACHES))]
        [t.start() for t in threads]
        [t.join(300) for t in threads]
    skipped = 0
    for i, spec in enumerate(CACHES):
        run = fd.CacheRun(spec)
        kw = dict(true_cfg=2.0, negative_prompt="dim") if i == 3 else {}
        want = _reference(env, [f"cached {i}"], [20 + i], 5, cache=run, **kw)[0]
        _close(_pixels(got[i].data[0].b64_json), want)
        skipped += run.skipped()
    after = server.metrics()
    assert skipped >= 4 and after["fd_serve_cache_skipped_total"] - before["fd_serve_cache_skipped_total"] == skipped
    assert after["fd_serve_joined_running_batch_total"] >= before["fd_serve_joined_running_batch_total"] + 4


@pytest.mark.parametrize(
    "body, field",
    [
        ("{not json", "body"),
        ([1, 2], "body"),
        (dict(prompt="x", model="other"), "model"),
        (dict(prompt="x", lora=[{"name": "zzz"}]), "lora[0].name"),
        (dict(prompt="x", size="30x32"), "size"),
        (dict(prompt="x", size="big"), "size"),
        (dict(prompt="x", steps=0), "steps"),
        (dict(prompt="x", n=5), "n"),
        (dict(prompt="word " * 100), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="x", response_format="url"), "response_format"),
        (dict(prompt="x", cache="fbcache:x"), "cache"),
        (dict(prompt="x", cache="bogus"), "cache"),
        (dict(prompt="x", cache=5), "cache"),
        (dict(prompt="x", cache="taylorseer:interval=0"), "cache"),
        (dict(prompt="x", colour="red"), "colour"),
        (dict(prompt="x", seed=2**64), "seed"),  # was a 500: "Overflow when unpacking long long"
        (dict(prompt="x", seed=-1), "seed"),
        (dict(prompt="x", seed=2**64 - 1, n=2), "seed"),  # image 1 would get seed 2**64
        (dict(prompt="x", seed=1.5), "seed"),
        (dict(prompt="x", seed=True), "seed"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(env, body, field):
    server = env["a"]
    if isinstance(body, str):
        r = httpx.post(server.url + "/v1/images/generations", content=body, timeout=30)
    else:
        r = server.post(body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: expected "), err


def test_the_top_seed_works_and_equals_fd_sample(env):
    r = env["a"].post(dict(prompt="edge", seed=2**64 - 1, steps=2), timeout=300)
    assert r.status_code == 200, r.text
    _close(_pixels(r.json()["data"][0]["b64_json"]), _reference(env, ["edge"], [2**64 - 1], 2)[0])


def test_steps_over_max_steps_is_a_400_naming_steps(env):
    """Server c runs with the default --max-steps 200: 200 is served, 201 refused before it is queued."""
    r = env["c"].post(dict(prompt="x", steps=201), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "steps" and err["message"] == "steps: expected an int from 1 to 200 (--max-steps), got 201"
    assert env["c"].metrics()["fd_serve_queue_depth"] == 0


SEED_ERROR = "error: --seed: expected an int from 0 to 2**64 - 1, got {!r}"


def test_generate_takes_the_same_seed_rule_from_a_shell(tmp_path, capsys):
    """``generate --seed`` refuses what the server's ``seed`` refuses (one rule,
    `functional_dit.sampling.bad_seed`), as a one-line argparse error naming --seed: -1 from a
    shell, 2**64 and a word in process (the same parser)."""
    from _cli import one_line_error

    argv = ["generate", "--model", "flux", "--prompt", "x", "--out", str(tmp_path / "x.png")]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "functional_dit", *argv, "--seed", "-1"], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip() == SEED_ERROR.format("-1"), done.stderr
    for seed in (str(2**64), "x"):
        assert one_line_error([*argv, f"--seed={seed}"], capsys) == SEED_ERROR.format(seed)
    assert not (tmp_path / "x.png").exists()


MISSING = 'error: serve needs starlette and uvicorn: pip install -e ".[serve]"'


def test_serve_without_its_extra_prints_one_line(tmp_path, capsys, monkeypatch):
    """``pip install -e .`` without ``[serve]``: the import is blocked (``sys.modules[name] = None``
    makes ``import name`` fail as a missing module does); ``serve`` prints one line, no
    traceback: starlette blocked in a shell's ``python -m functional_dit serve``, uvicorn in process."""
    from _cli import one_line_error

    code = "import sys, runpy; sys.modules['starlette'] = None; runpy.run_module('functional_dit', run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code, "serve", "--model", "flux"], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stderr == MISSING + "\n" and done.stdout == "", done.stderr
    monkeypatch.setitem(sys.modules, "python_multipart", None)  # the edits' form parser, of the same extra
    assert one_line_error(["serve", "--model", "flux"], capsys) == MISSING.replace(
        "starlette and uvicorn", "python-multipart (the edits uploads)"
    )
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert one_line_error(["serve", "--model", "flux"], capsys) == MISSING


def test_full_queue_is_429_with_retry_after_and_disconnected_clients_leave(env):
    server, codes, retry = env["a"], [], []
    before = server.metrics()

    def send():
        try:  # the client gives up after 4 s: its connection closes, its images must leave
            r = server.post(dict(prompt="busy", n=4, steps=10**5), timeout=4)  # never done within 4 s
            codes.append(r.status_code)
            if r.status_code == 429:
                retry.append(r.headers.get("retry-after"))
        except httpx.TimeoutException:
            codes.append("gone")

    threads = [threading.Thread(target=send) for _ in range(6)]  # 24 images: 4 run at most, 16 queue, the rest 429
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert codes.count(429) >= 1 and "gone" in codes, codes
    assert all(r is not None and r.isdigit() and int(r) >= 1 for r in retry), retry
    end = time.monotonic() + 60
    while (m := server.metrics())["fd_serve_running_batch_size"] or m["fd_serve_queue_depth"]:
        assert time.monotonic() < end, f"disconnected clients still hold the batch: {m}"
        time.sleep(0.2)
    key = 'fd_serve_requests_total{status="499"}'
    assert m[key] >= before.get(key, 0) + 1


def test_request_timeout_is_a_504(env):
    # 10**6 steps cannot finish within server b's 30 s on any machine (1,000 did, unloaded)
    r = env["b"].post(dict(prompt="slow", steps=10**6), timeout=120)
    assert r.status_code == 504 and "request_timeout" in r.json()["error"]["message"]


STEPS_DRAIN = 150


def test_sigterm_drains_and_exits_0(env):
    server = env["a"]  # not b: 150 steps took over b's 30 s request timeout at load 8 on 2 cores
    end = time.monotonic() + 60
    while any(server.metrics()[k] for k in ("fd_serve_running_batch_size", "fd_serve_queue_depth")):
        assert time.monotonic() < end, "the server never went idle"  # an earlier test's request leaves first
        time.sleep(0.02)
    running = {}
    # enough steps to be still running when SIGTERM comes (3 finished between two polls, unloaded)
    t = threading.Thread(
        target=lambda: running.update(r=server.post(dict(prompt="last", steps=STEPS_DRAIN, seed=9), timeout=600))
    )
    t.start()
    while not server.metrics()["fd_serve_running_batch_size"]:
        assert time.monotonic() < end and t.is_alive(), "the request never ran"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    while httpx.get(server.url + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < end, "no drain"
        time.sleep(0.02)
    assert server.post(dict(prompt="late"), timeout=30).status_code == 503
    t.join(600)
    assert running["r"].status_code == 200
    assert server.proc.wait(60) == 0
    _close(_pixels(running["r"].json()["data"][0]["b64_json"]), _reference(env, ["last"], [9], STEPS_DRAIN)[0])
    events = [json.loads(line) for line in open(env["journal"])]
    last = [e for e in events if e.get("body", {}).get("prompt") == "last"]
    assert len(last) == 1 and {"event": "done", "id": last[0]["id"], "status": 200} in events


def test_model_names_resolve_as_generate_does(env, capsys):
    """``--model`` takes generate's names: ``tiny:KIND`` is the tiny pipeline at seed 0
    (the same weights as ``flux``), a bare preset name the released model; an unknown tiny
    kind and a missing preset are one-line errors naming ``--model`` (Kontext, once refused
    here, is served: its edits, tests/test_serve_edits.py)."""
    import torch.utils._pytree as pytree
    from _cli import one_line_error

    from functional_dit.cli import serve

    params, pipe = serve.load_model("tiny:flux")
    assert type(pipe).__name__ == "FluxPipeline"
    assert all(
        torch.equal(a, b) for a, b in zip(pytree.tree_leaves(params.tree), pytree.tree_leaves(env["params"].tree))
    )
    for name, says in (
        ("tiny:nope", "tiny:KIND"),
        ("qwen-image", "preset 'qwen-image'"),
    ):
        err = one_line_error(["serve", "--model", name, "--port", "1"], capsys)
        assert "--model" in err and says in err, err


def test_resume_journal_reruns_unfinished_requests(env, tmp_path):
    from functional_dit.serve import _app, _engine, _journal

    path = str(tmp_path / "j.jsonl")
    lines = [
        {"event": "accepted", "id": "r1", "body": {"prompt": "again", "seed": 4, "lora": [{"name": "a"}]}},
        {"event": "accepted", "id": "r2", "body": {"prompt": "finished"}},
        {"event": "done", "id": "r2", "status": 200},
        {"event": "accepted", "id": "r3", "body": {"prompt": "x", "lora": [{"name": "gone"}]}},
    ]
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in lines)
        f.write('{"event": "accepted", "id": "torn", "bo')  # a crash mid-write
    engine = _engine.Engine(env["params"], env["pipe"], {"a": env["adapters"]["a"]}, max_batch=4)
    limits = dict(n=4, multiple=16, max_size=2048, max_sequence_length=MSL)
    service = _app.Service(engine, "flux", defaults=dict(steps=2, size="32x32"), limits=limits)
    service.journal = _journal.Journal(path)
    assert _journal.resume(path, service, engine.submit) == 1
    for _ in range(20):  # 1 encode + 2 steps in a few turns; bounded
        engine.turn()
        if engine.idle():
            break
    service.journal.close()
    got = np.asarray(Image.open(tmp_path / "j.jsonl.results" / "r1-0.png").convert("RGB")).astype(int)
    _close(got, _reference(env, ["again"], [4], 2, [[("a", 1.0)]])[0])
    records = [
        json.loads(line)
        for line in open(path).read().splitlines()
        if not line.startswith('{"event": "accepted", "id": "torn"')
    ]
    done = {e["id"]: e["status"] for e in records if e["event"] == "done"}
    assert done["r1"] == "resumed" and done["r3"].startswith("failed: lora[0].name: expected")
    assert _journal.unfinished(path) == []


# ---------------------------------------------------------------- adapters at run time (server c)


def _admin(server, method, path, body=None, headers=AUTH):
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=120)


def _names(server) -> dict:
    return {e["name"]: e for e in httpx.get(server.url + "/v1/loras", timeout=30).json()["data"]}


def _refused(r, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status, err
    return err["message"]


@pytest.mark.parametrize(
    "headers, status",
    [({}, 401), ({"Authorization": "Basic " + TOKEN}, 401), ({"Authorization": "Bearer wrong"}, 403),
     ({"Authorization": "Bearer " + TOKEN[:-1]}, 403)],
)  # fmt: skip
def test_changing_adapters_needs_the_admin_token(env, headers, status):
    """No token or another scheme: 401 (with WWW-Authenticate); a wrong token: 403; nothing changes."""
    c = env["c"]
    for method, path, body in (
        ("POST", "/v1/loras", {"name": "t", "path": "b.safetensors"}),
        ("DELETE", "/v1/loras/a", None),
    ):
        r = _admin(c, method, path, body, headers)
        _refused(r, status, "Authorization")
        assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)
    assert "t" not in _names(c) and "a" in _names(c)


def test_a_server_without_a_token_keeps_its_adapters(env):
    """Server b has no --admin-token (nor the variable): changes are a 403 whatever is sent; the list is open."""
    b = env["b"]
    msg = _refused(_admin(b, "POST", "/v1/loras", {"name": "t", "path": "b.safetensors"}), 403, "Authorization")
    assert "--admin-token" in msg and "FD_SERVE_ADMIN_TOKEN" in msg
    _refused(_admin(b, "DELETE", "/v1/loras/t"), 403, "Authorization")
    assert httpx.get(b.url + "/v1/loras", timeout=30).json() == {"object": "list", "data": []}


@pytest.mark.parametrize(
    "path",
    ["../outside.safetensors", "sub/../../outside.safetensors", "sub/../a.safetensors", "ABS_OUT", "ABS_IN",
     "link.safetensors", "missing.safetensors", "sub", "junk.safetensors", "", 5],
)  # fmt: skip
def test_a_path_escaping_the_lora_dir_or_no_adapter_is_a_400_naming_path(env, path):
    """Absolute paths and '..' parts are refused as written (even one resolving inside), a
    symlink by where it resolves; a missing file, a folder without the adapter file and a
    file that is no safetensors are 400s naming path too."""
    c = env["c"]
    path = {"ABS_OUT": os.path.join(env["tmp"], "outside.safetensors"), "ABS_IN": env["paths"]["a"]}.get(path, path)
    msg = _refused(_admin(c, "POST", "/v1/loras", {"name": "esc", "path": path}), 400, "path")
    assert msg.startswith("path: expected ")
    assert "esc" not in _names(c)


def test_an_adapter_added_at_run_time_equals_it_loaded_at_start_up_and_delete_then_use_is_a_400(env):
    """POST loads b.safetensors' sibling a.safetensors as "late": the openai client's image
    with "late" is bitwise the PNG with "a" (the same file, loaded at start-up; one process,
    the same ops) and differs from no adapter. A second POST of the name is a 409, a bad
    name a 400; after DELETE, a request naming it is a 400 naming lora[0].name."""
    import openai

    c = env["c"]
    r = _admin(c, "POST", "/v1/loras", {"name": "late", "path": "a.safetensors"})
    assert r.status_code == 200, r.text
    entry = _names(c)["late"]
    assert entry == r.json() and entry["path"] == "a.safetensors" and entry["ranks"] == [4] and entry["scales"] == [2.0]
    _refused(_admin(c, "POST", "/v1/loras", {"name": "late", "path": "b.safetensors"}), 409, "name")
    _refused(_admin(c, "POST", "/v1/loras", {"name": "../x", "path": "b.safetensors"}), 400, "name")
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def png(names):
        extra = {"seed": 5, "steps": 2, "lora": [{"name": n, "scale": 0.7} for n in names]}
        return client.images.generate(model="flux", prompt="a fox", size="32x32", extra_body=extra).data[0].b64_json

    late, start_up, none = png(["late"]), png(["a"]), png([])
    assert late == start_up and late != none
    assert _admin(c, "DELETE", "/v1/loras/late").json() == {"name": "late", "deleted": True}
    _refused(c.post(dict(prompt="a fox", lora=[{"name": "late"}])), 400, "lora[0].name")
    _refused(_admin(c, "DELETE", "/v1/loras/late"), 404, "name")
    assert "late" not in _names(c) and "late" not in httpx.get(c.url + "/v1/models").json()["lora"]


STEPS_KEPT = 200  # the default --max-steps: long enough to be running when the DELETE comes


def test_a_request_in_flight_keeps_its_adapter_across_a_delete(env):
    c = env["c"]
    assert _admin(c, "POST", "/v1/loras", {"name": "brief", "path": "b.safetensors"}).status_code == 200
    before, out = c.metrics(), {}
    body = dict(prompt="kept", seed=11, steps=STEPS_KEPT, lora=[{"name": "brief"}])
    t = threading.Thread(target=lambda: out.update(r=c.post(body, timeout=600)))
    t.start()
    end = time.monotonic() + 120
    while c.metrics()["fd_serve_step_seconds_count"] < before["fd_serve_step_seconds_count"] + 2:
        assert time.monotonic() < end and t.is_alive(), "the request never ran two steps"
        time.sleep(0.01)
    assert _admin(c, "DELETE", "/v1/loras/brief").status_code == 200
    assert t.is_alive(), "the request finished before the delete: the test shows nothing"
    _refused(c.post(dict(prompt="x", lora=[{"name": "brief"}])), 400, "lora[0].name")  # new requests cannot
    t.join(600)
    assert out["r"].status_code == 200, out["r"].text
    want = _reference(env, ["kept"], [11], STEPS_KEPT, [[("b", 1.0)]])[0]
    _close(_pixels(out["r"].json()["data"][0]["b64_json"]), want)


def test_adapter_memory_shows_in_metrics(env):
    c = env["c"]
    size = sum(t.numel() * t.element_size() for t in env["adapters"]["b"].leaves())
    m0 = c.metrics()
    assert _admin(c, "POST", "/v1/loras", {"name": "mem", "path": "b.safetensors"}).json()["bytes"] == size
    m1 = c.metrics()
    assert (m1["fd_serve_loras"], m1["fd_serve_lora_bytes"]) == (
        m0["fd_serve_loras"] + 1,
        m0["fd_serve_lora_bytes"] + size,
    )
    assert _admin(c, "DELETE", "/v1/loras/mem").status_code == 200
    m2 = c.metrics()
    assert (m2["fd_serve_loras"], m2["fd_serve_lora_bytes"]) == (m0["fd_serve_loras"], m0["fd_serve_lora_bytes"])


def test_run_time_adapters_are_refused_under_torchrun_and_need_a_folder(tmp_path, capsys, monkeypatch):
    """Under torchrun rank 0 alone would change its adapters: --lora-dir, --admin-token and
    the token's environment variable are one-line errors before anything loads."""
    from _cli import one_line_error

    monkeypatch.setenv("WORLD_SIZE", "2")
    for extra in (["--lora-dir", str(tmp_path)], ["--admin-token", "t"]):
        err = one_line_error(["serve", "--model", "flux", "--port", "1", *extra], capsys)
        assert "under torchrun" in err and "--lora NAME=PATH" in err, err
    monkeypatch.setenv("FD_SERVE_ADMIN_TOKEN", "t")
    assert "under torchrun" in one_line_error(["serve", "--model", "flux", "--port", "1"], capsys)
    monkeypatch.setenv("WORLD_SIZE", "1")
    err = one_line_error(["serve", "--model", "flux", "--port", "1", "--lora-dir", str(tmp_path / "no")], capsys)
    assert err.startswith("error: --lora-dir: expected a folder"), err


# ---------------------------------------------------------------- priorities and deadlines (server d: --max-batch 1)


def _idle(server) -> dict:
    end = time.monotonic() + 120
    while (m := server.metrics())["fd_serve_running_batch_size"] or m["fd_serve_queue_depth"]:
        assert time.monotonic() < end, f"the server never went idle: {m}"
        time.sleep(0.05)
    return m


def _steps_seen(server, before: dict, n: int, alive) -> None:
    end = time.monotonic() + 120
    while server.metrics()["fd_serve_step_seconds_count"] < before["fd_serve_step_seconds_count"] + n:
        assert time.monotonic() < end and alive(), "the request never ran"
        time.sleep(0.01)


STEPS_LOW = 150  # still running when the high-priority request comes (3 steps between two polls, unloaded)


def test_a_preempted_request_resumes_to_the_bitwise_same_image(env):
    """A priority-0 request runs (batch full: --max-batch 1); a priority-5 one arrives,
    takes its place at the next step and is answered while the first still waits; the
    first resumes where it stopped. Its PNG is bitwise the PNG of the same request run
    uninterrupted on the same server (one process, the same ops: a batch of one each step)."""
    d = env["d"]
    before, out = _idle(d), {}
    low = dict(prompt="patient", seed=31, steps=STEPS_LOW)
    t = threading.Thread(target=lambda: out.update(r=d.post(low, timeout=600)))
    t.start()
    _steps_seen(d, before, 2, t.is_alive)
    high = d.post(dict(prompt="urgent", seed=32, steps=2, priority=5), timeout=300)
    assert high.status_code == 200 and t.is_alive(), "the high-priority request did not overtake"
    t.join(600)
    assert out["r"].status_code == 200
    after = _idle(d)
    assert after["fd_serve_preempted_total"] == before["fd_serve_preempted_total"] + 1
    again = d.post(low, timeout=600)
    assert again.json()["data"][0]["b64_json"] == out["r"].json()["data"][0]["b64_json"]
    _close(_pixels(high.json()["data"][0]["b64_json"]), _reference(env, ["urgent"], [32], 2)[0])
    assert d.metrics()['fd_serve_latency_seconds_count{priority="5"}'] >= 1


def test_waiting_requests_are_admitted_by_priority(env):
    """A priority-100 request holds the only slot; priorities 0, 1 and 3 queue behind it in
    that order of arrival; once it leaves they finish 3, 1, 0 (each alone: --max-batch 1),
    and the order makes no preemption (each runs after the one before it finished)."""
    d = env["d"]
    before, finished, threads = _idle(d), [], []
    with _anchor(d, before, priority=100):
        for k, p in enumerate((0, 1, 3)):
            body = dict(prompt=f"queued {p}", seed=40 + p, steps=6, priority=p)  # 6 steps between two answers
            threads.append(
                threading.Thread(target=lambda b=body: finished.append((b["priority"], d.post(b, timeout=300))))
            )
            threads[-1].start()
            end = time.monotonic() + 60
            while d.metrics()["fd_serve_queue_depth"] < k + 1:
                assert time.monotonic() < end, "the request was never queued"
                time.sleep(0.02)
    [t.join(300) for t in threads]
    assert [p for p, _ in finished] == [3, 1, 0]
    assert all(r.status_code == 200 for _, r in finished)
    assert d.metrics()["fd_serve_preempted_total"] == before["fd_serve_preempted_total"]  # none outranked the anchor


def test_a_passed_deadline_is_a_504_with_the_steps_done_then_the_server_is_healthy(env):
    d = env["d"]
    _idle(d)
    t0 = time.monotonic()
    r = d.post(dict(prompt="late", steps=10**5, deadline_ms=2000), timeout=120)  # 10**6 takes seconds to set up
    took = time.monotonic() - t0
    err = r.json()["error"]
    assert r.status_code == 504 and err["param"] == "deadline_ms" and err["message"].startswith("deadline_ms: ")
    assert err["steps"] == [10**5] and 1 <= err["steps_done"][0] < 10**5, err
    assert 2.0 <= took < 12.0  # at the deadline, not at --request-timeout (600 s); 50 ms polls on a loaded machine
    _idle(d)  # its image left the batch
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    ok = d.post(dict(prompt="after", seed=3, steps=2, deadline_ms=60000), timeout=300)
    assert ok.status_code == 200
    _close(_pixels(ok.json()["data"][0]["b64_json"]), _reference(env, ["after"], [3], 2)[0])
    assert d.metrics()['fd_serve_requests_total{status="504"}'] >= 1


@pytest.mark.parametrize(
    "body, field",
    [(dict(priority=1.5), "priority"), (dict(priority=101), "priority"), (dict(priority=True), "priority"),
     (dict(deadline_ms=0), "deadline_ms"), (dict(deadline_ms="soon"), "deadline_ms"),
     (dict(deadline_ms=-5), "deadline_ms")],
)  # fmt: skip
def test_bad_priority_and_deadline_are_400s(env, body, field):
    r = env["d"].post(dict(prompt="x", **body), timeout=30)
    assert _refused(r, 400, field).startswith(f"{field}: expected ")


def test_the_order_is_a_virtual_arrival_so_nothing_starves():
    """Priority p is a head start of p * aging seconds: a priority-0 job that waited longer
    than that goes first; the order of two waiting jobs never changes."""
    from functional_dit.serve import _engine

    eng = _engine.Engine.__new__(_engine.Engine)
    eng.aging = 10.0
    old = _engine.Job("old", [], None, priority=0, arrived=100.0)
    newer = _engine.Job("new", [], None, priority=3, arrived=125.0)  # within 30 s: goes first
    later = _engine.Job("later", [], None, priority=3, arrived=131.0)  # past 30 s: after the old one
    assert eng.order(newer, 0) < eng.order(old, 0) < eng.order(later, 0)


def test_mixed_resolution_flags_are_checked_by_name(capsys):
    """``--mixed-resolution`` takes on or off, ``--max-padding`` a ratio of at least 1:
    anything else is a one-line error naming the flag, before a model loads."""
    from _cli import one_line_error

    for flag, value in (("--mixed-resolution", "maybe"), ("--max-padding", "0.5"), ("--max-padding", "nan")):
        err = one_line_error(["serve", "--model", "flux", flag, value], capsys)
        assert flag in err, err


@pytest.mark.parametrize(
    "model, kind",
    [
        ("tiny:qwen-image", "qwen-image"),
        ("tiny:flux3-distilled", "flux3-distilled"),
        ("tiny:qwen-image-2.1", "qwen-image-2.1"),
    ],
)
def test_qwen_image_sizes_share_calls_and_equal_fd_sample(tmp_path, model, kind):
    """A 64x32 request joins a running 32x32 one (another prompt length too) on a server of
    its own: Qwen-Image, FLUX.3 (its prompts padded to one length) and Qwen-Image 2.1 (one
    padded layout, each image its own positions; its prefix KV caches: the newcomer's first
    step extracts its own in a call apart, its later steps share the anchor's cached call)
    pack both sizes into one call (counted in /metrics; --max-padding 2, the tiny model's
    prompts being as long as its images), and the image equals ``fd.sample`` of it alone
    (as RGB: 2.1's images are RGBA)."""
    server = Server(str(tmp_path), "--max-steps", str(10**6), "--max-padding", "2", model=model, msl=None)
    body = dict(prompt="a wide view", size="64x32", steps=3, seed=5)
    try:
        server.wait_up()
        before = server.metrics()
        with _anchor(server, before):
            res = server.post(body, timeout=300)
        after = server.metrics()
    finally:
        server.stop()
    assert res.status_code == 200, res.text
    calls = after["fd_serve_mixed_resolution_calls_total"] - before["fd_serve_mixed_resolution_calls_total"]
    assert calls >= 2
    pipe = tiny.pipeline(kind)
    want = fd.sample(fd.from_diffusers(pipe.transformer), pipe, "a wide view", height=32, width=64, steps=3, seed=5)[0]
    got = _pixels(res.json()["data"][0]["b64_json"])
    assert got.shape[:2] == (32, 64)
    _close(got, np.asarray(want.convert("RGB")).astype(int))
