"""The HTTP side of ``serve``: the OpenAI images API on Starlette (ASGI), run by uvicorn.

``POST /v1/images/generations`` takes the OpenAI body (``model``, ``prompt``, ``n``,
``size`` "WxH", ``response_format`` "b64_json") and this server's extension fields in the
same body (``seed``, ``steps``, ``guidance``, ``true_cfg``, ``negative_prompt``, ``lora``:
``[{"name", "scale"}]``, ``cache``, ``priority``, ``deadline_ms``: the engine's order and a
504 with the steps done), answers ``{"created", "data": [{"b64_json"}]}`` (PNG),
and errors as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``. Bad input
is a 400 whose message names the field, the expected and the actual value, checked
before the request is queued; a full queue is a 429 with ``Retry-After``; a request past
``request_timeout`` is a 504 and leaves its batch; a client that disconnects leaves its
batch at the next step; while draining (SIGTERM, SIGINT) new requests get 503.
``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus text) report the rest;
``/v1/loras`` lists and changes the adapters (`functional_dit.serve._loras`).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import re
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from ..pipelines import sampling
from . import _edits, _engine, _loras, _ranks
from ._errors import BadRequest, error

FIELDS = {"model", "prompt", "n", "size", "response_format", "user", "quality", "style"}
FIELDS |= {"seed", "steps", "guidance", "true_cfg", "negative_prompt", "lora", "cache", "priority", "deadline_ms"}
PRIORITIES = 100  # priority is an int in [-100, 100] (a label of /metrics' latency)


def _number(body, field, kind, lo, default):
    v = body.get(field, default)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok or not _fp32(v, kind) or v < lo:
        raise BadRequest(field, f"{'an int' if kind is int else 'a finite number'} ≥ {lo}", v)
    return kind(v)


def _fp32(v, kind) -> bool:
    """A float field's value fits float32: JSON's NaN, Infinity and 1e39 (as the model's
    guidance or CFG scale) made the model call raise, which stopped the engine (every
    client a 503)."""
    return kind is int or abs(v) <= FP32_MAX  # False for NaN; exact for an int of any size


FP32_MAX = 3.4028234663852886e38


class Service:
    """The checks and the state the routes share: engine, model name, limits, journal."""

    def __init__(self, engine: _engine.Engine, model: str, *, defaults: dict, limits: dict, journal=None, loras=None):
        self.engine, self.model, self.defaults, self.limits = engine, model, defaults, limits
        self.journal, self.draining = journal, False
        self.loras = loras or _loras.Loras(engine.adapters)  # the names new requests may use
        # The prompt-length check runs on the event loop's thread, so it gets its own copy of
        # the tokenizer: a fast tokenizer keeps padding and truncation as settings on the
        # object, and a check (no padding) between the engine thread's setting them and its
        # encoding left an engine prompt unpadded (7 tokens where max_length 32 was asked:
        # a batch of its own and another image; test_16_concurrent_mixed_requests_all_correct
        # failed 1 run in 10 so).
        pipe = engine.ctx.pipe
        # the main text encoder's: T5 for FLUX.1; FLUX.3's "tokenizer" and Qwen-Image 2.1's
        # "processor" are Qwen3-VL processors, whose first argument is images: their text tokenizer
        tokenizer = next(t for n in ("tokenizer_2", "tokenizer", "processor") if (t := getattr(pipe, n, None)))
        self.tokenizer = copy.deepcopy(getattr(tokenizer, "tokenizer", tokenizer))

    def requests(self, body) -> list:
        """The body as one `sampling.Request` per image (BadRequest on the first bad field)."""
        if not isinstance(body, dict):
            raise BadRequest("body", "a JSON object", type(body).__name__)
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise BadRequest(unknown[0], f"one of the fields {sorted(FIELDS)}", body[unknown[0]])
        if body.get("model") not in (None, self.model):
            raise BadRequest("model", f"{self.model!r} (GET /v1/models)", body.get("model"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt", "a non-empty string", prompt)
        n = _number(body, "n", int, 1, 1)
        if n > self.limits["n"]:
            raise BadRequest("n", f"an int from 1 to {self.limits['n']} (--max-images)", n)
        if body.get("response_format", "b64_json") != "b64_json":
            raise BadRequest(
                "response_format", "'b64_json' (this server stores no files to link)", body["response_format"]
            )
        width, height = self._size(body.get("size", self.defaults["size"]))
        steps = _number(body, "steps", int, 1, self.defaults["steps"])
        if steps > self.limits.get("max_steps", steps):
            raise BadRequest("steps", f"an int from 1 to {self.limits['max_steps']} (--max-steps)", steps)
        seed = body.get("seed", 0)
        if (want := sampling.bad_seed(seed, n)) is not None:
            raise BadRequest("seed", want, seed)
        neg = body.get("negative_prompt")
        if neg is not None and not isinstance(neg, str):
            raise BadRequest("negative_prompt", "a string or null", neg)
        cache = self._cache(body.get("cache"), steps)
        self._prompt_length("prompt", prompt)
        if neg:
            self._prompt_length("negative_prompt", neg)
        kw = dict(
            height=height, width=width, steps=steps, guidance=_number(body, "guidance", float, 0, None),
            true_cfg=_number(body, "true_cfg", float, 0, None), negative_prompt=neg, lora=self._lora(body.get("lora")),
            max_sequence_length=self.limits["max_sequence_length"], cache=cache,
        )  # fmt: skip
        out = [sampling.Request(prompt, seed=seed + j, **kw) for j in range(n)]
        self._backend_check(out[0], dict(body, size=f"{width}x{height}"))
        return out

    def _backend_check(self, req, body) -> None:
        """What the engine's backend refuses (the XLA backend: step caches, sizes not warmed
        under --xla-strict), as a 400 naming the field."""
        refuse = getattr(self.engine.backend, "refuse", None)
        bad = None if refuse is None else refuse(req)
        if bad is not None:
            raise BadRequest(bad[0], bad[1], body.get(bad[0]))

    def order(self, body) -> tuple:
        """(``priority``, ``deadline_ms`` or None) of a checked body (BadRequest naming either)."""
        p = body.get("priority", 0)
        if isinstance(p, bool) or not isinstance(p, int) or abs(p) > PRIORITIES:
            raise BadRequest("priority", f"an int from -{PRIORITIES} to {PRIORITIES} (higher first)", p)
        ms = body.get("deadline_ms")
        ok = ms is None or (isinstance(ms, (int, float)) and not isinstance(ms, bool) and 0 < ms < float("inf"))
        if not ok:
            raise BadRequest("deadline_ms", "a positive number of milliseconds from arrival, or null", ms)
        return p, ms

    def _cache(self, value, steps: int):
        """The ``cache`` spec (None for none), parsed as ``fd.sample(cache=...)`` parses it."""
        if value is None:
            return None
        want = "null, 'none' or a step-cache spec such as 'fbcache:0.08', 'magcache:0.06' or 'taylorseer:interval=4'"
        if not isinstance(value, str):
            raise BadRequest("cache", want, value)
        try:
            config = sampling.cache_config(value, steps)
        except ValueError as e:
            raise BadRequest("cache", f"{want} ({e})", value) from None
        if config is not None and self.engine.ctx.model is not None and not self.engine.ctx.model.step_cache:
            raise BadRequest("cache", f"null or 'none' (no step caching for {self.engine.ctx.fam} yet)", value)
        return value

    def _size(self, size):
        m = re.fullmatch(r"(\d+)x(\d+)", size) if isinstance(size, str) else None
        multiple, top = self.limits["multiple"], self.limits["max_size"]
        want = f"'WxH' with W and H positive multiples of {multiple} up to {top}"
        if m is None:
            raise BadRequest("size", want, size)
        w, h = int(m[1]), int(m[2])
        if not (0 < w <= top and 0 < h <= top) or w % multiple or h % multiple:
            raise BadRequest("size", want, size)
        return w, h

    def _lora(self, value) -> tuple:
        if value is None:
            return ()
        adapters = self.loras.adapters  # one view for the whole body (a POST / DELETE replaces it)
        names = sorted(adapters)
        if not isinstance(value, list):
            raise BadRequest("lora", "a list of {name, scale}", value)
        out = []
        for k, e in enumerate(value):
            if not isinstance(e, dict) or set(e) - {"name", "scale"} or "name" not in e:
                raise BadRequest(f"lora[{k}]", "an object {name, scale}", e)
            if e["name"] not in adapters:
                raise BadRequest(f"lora[{k}].name", f"one of the loaded adapters {names}", e["name"])
            scale = e.get("scale", 1.0)
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not _fp32(scale, float):
                raise BadRequest(f"lora[{k}].scale", "a finite number", scale)
            out.append((adapters[e["name"]], float(scale)))
        return tuple(out)

    def _prompt_length(self, field: str, text: str) -> None:
        """The prompt's tokens in the main text encoder's tokenizer, against the limit."""
        limit = self.limits["max_sequence_length"] or 512
        n = len(self.tokenizer(text, add_special_tokens=True).input_ids)
        if n > limit:
            raise BadRequest(field, f"at most {limit} tokens (the model's max_sequence_length)", f"{n} tokens")


def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def app(service: Service, request_timeout: float) -> Starlette:
    """The ASGI app over ``service``."""
    engine, metrics = service.engine, service.engine.metrics

    def answer(status: int, response):
        metrics.requests[status] += 1
        return response

    async def models(_):
        data = [{"id": service.model, "object": "model", "created": 0, "owned_by": "functional_dit"}]
        return JSONResponse({"object": "list", "data": data, "lora": sorted(service.loras.adapters)})

    async def health(_):
        status = "draining" if service.draining else ("failed" if engine.error else "ok")
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    async def prometheus(_):
        text = _prometheus(engine) + "\n".join(_loras.metrics(service.loras)) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/images/generations", _generations(service, request_timeout, answer), methods=["POST"]),
        Route("/v1/images/edits", _generations(service, request_timeout, answer, _edits.requests), methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", prometheus),
        *_loras.routes(service, answer),
    ]
    return Starlette(routes=routes)


def _generations(service: Service, request_timeout: float, answer, parse=None):
    """``POST /v1/images/generations``: checks, the journal, the queue, then `_wait`.
    ``parse(request, service) -> (body, requests)``: another body (the multipart edits,
    `functional_dit.serve._edits.requests`); by default the JSON body."""
    engine = service.engine

    async def generations(request: HTTPRequest):
        arrived = time.monotonic()
        if service.draining:
            return answer(503, error(503, "the server is shutting down (draining); retry on another"))
        if engine.error is not None:
            return answer(503, error(503, f"the model failed: {engine.error}"))
        try:
            if parse is None:
                body = await _json(request)
                reqs = service.requests(body)
                _edits.text_only(engine.ctx.pipe)  # an edit pipeline's server: edits only
            else:
                body, reqs = await parse(request, service)
            priority, deadline_ms = service.order(body)
        except BadRequest as e:
            return answer(400, error(400, str(e), e.field))
        except ClientDisconnect:  # gone before its body arrived (was an unhandled 500): nothing queued
            return answer(499, PlainTextResponse("client closed request", status_code=499))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(images, err):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result((images, err)))

        job = _engine.Job(uuid.uuid4().hex, reqs, deliver, body=body, priority=priority, arrived=arrived)
        if service.journal is not None:  # before it can run
            service.journal.accepted(job.id, body)
        try:
            engine.submit(job)
        except _engine.QueueFull as e:
            _journal_done(service, job, 429)
            return answer(429, error(429, f"queue full: {e}", headers={"Retry-After": str(_retry_after(engine))}))
        return await _wait(request, job, fut, (request_timeout, deadline_ms), service, answer)

    return generations


async def _json(request: HTTPRequest):
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("body", "a JSON object", (await request.body())[:80].decode(errors="replace")) from None


async def _wait(request, job, fut, limits: tuple, service, answer):
    """The job's images, or: the client left (its images leave at the next step), or
    504 past ``limits`` (``request_timeout`` s, ``deadline_ms`` ms or None, from arrival)
    with the steps each image had done."""
    timeout, ms = limits
    deadline = job.arrived + (timeout if ms is None else min(timeout, ms / 1000))
    while not fut.done():
        await asyncio.wait([fut], timeout=0.05)
        if fut.done():
            break
        if await request.is_disconnected():
            job.cancelled = True
            _journal_done(service, job, 499)
            return answer(499, PlainTextResponse("client closed request", status_code=499))
        if service.engine.error is not None:
            _journal_done(service, job, 503)
            return answer(503, error(503, f"the model failed: {service.engine.error}"))
        if time.monotonic() > deadline:
            return _late(service, job, timeout, ms, answer)
    images, err = fut.result()
    if err is not None and service.engine.error is not None:  # the model (a rank) failed, not this request
        _journal_done(service, job, 503)
        return answer(503, error(503, f"the model failed: {type(err).__name__}: {err}"))
    if err is not None:
        _journal_done(service, job, 500)
        return answer(500, error(500, f"{type(err).__name__}: {err}"))
    _journal_done(service, job, 200)
    service.engine.metrics.answered(job.priority, time.monotonic() - job.arrived)
    data = [{"b64_json": _png(img)} for img in images]
    return answer(200, JSONResponse({"created": int(time.time()), "data": data}))


def _late(service, job, timeout: float, ms, answer):
    """504: the job leaves its batch at the next step; the body says what it had done."""
    job.cancelled = True
    _journal_done(service, job, 504)
    if ms is not None and ms / 1000 < timeout:
        message, param = f"deadline_ms: the images took over {ms:g} ms", "deadline_ms"
    else:
        message, param = f"request_timeout: the images took over {timeout:g} s", None
    done = dict(steps_done=list(job.progress), steps=[r.steps for r in job.requests])
    return answer(504, error(504, message, param, extra=done))


def _journal_done(service, job, status: int) -> None:
    if service.journal is not None:
        service.journal.done(job.id, status)


def _retry_after(engine) -> int:
    """Seconds until the queue likely has room: the queued images' steps at the mean step time."""
    mean = engine.metrics.step_seconds / max(engine.metrics.steps, 1)
    return max(1, int(mean * max(engine.queued(), 1)) + 1)


def _prometheus(engine) -> str:
    m = engine.metrics
    lines = [
        "# TYPE fd_serve_queue_depth gauge",
        f"fd_serve_queue_depth {engine.queued()}",
        "# TYPE fd_serve_running_batch_size gauge",
        f"fd_serve_running_batch_size {engine.running()}",
        "# TYPE fd_serve_images_per_second gauge",
        f"fd_serve_images_per_second {m.images_per_second():.6g}",
        "# TYPE fd_serve_images_total counter",
        f"fd_serve_images_total {m.images}",
        "# TYPE fd_serve_preempted_total counter",
        f"fd_serve_preempted_total {m.preempted}",
        "# TYPE fd_serve_mixed_resolution_calls_total counter",
        f"fd_serve_mixed_resolution_calls_total {m.mixed_calls}",
        "# TYPE fd_serve_joined_running_batch_total counter",
        f"fd_serve_joined_running_batch_total {m.joined}",
        "# TYPE fd_serve_step_seconds summary",
        f"fd_serve_step_seconds_sum {m.step_seconds:.6g}",
        f"fd_serve_step_seconds_count {m.steps}",
        "# TYPE fd_serve_last_step_seconds gauge",
        f"fd_serve_last_step_seconds {m.last_step_seconds:.6g}",
        "# TYPE fd_serve_cache_skipped_total counter",
        f"fd_serve_cache_skipped_total {m.cache_skipped + (engine.others.cache_skipped() if engine.others else 0)}",
        "# TYPE fd_serve_requests_total counter",
    ]
    lines += [f'fd_serve_requests_total{{status="{s}"}} {n}' for s, n in sorted(m.requests.items())]
    lines += _ranks.groups_metric(m.groups)
    lines += ["# TYPE fd_serve_latency_seconds summary"]  # arrival to answer of 200s, per priority
    for p, (total, count) in sorted(m.latency.items()):
        lines += [f'fd_serve_latency_seconds_sum{{priority="{p}"}} {total:.6g}',
                  f'fd_serve_latency_seconds_count{{priority="{p}"}} {count}']  # fmt: skip
    lines += getattr(engine.backend, "metrics", list)()  # the XLA backend's compiles, transfers, padding
    return "\n".join(lines) + "\n"
