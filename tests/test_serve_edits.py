"""``POST /v1/images/edits`` on a live ``serve --model flux`` (127.0.0.1), driven through
httpx multipart and the official ``openai`` client's ``images.edit``.

One server of the tiny FLUX.1 pipeline (2 steps, a 32-token text limit, one LoRA,
``--max-upload-bytes 200000 --max-upload-pixels 9000``). The oracle is the stock pipeline
of the job built from the same components (``FluxImg2ImgPipeline`` / ``FluxInpaintPipeline``
``.from_pipe``) run by ``fd.sample`` alone in this process: every image within 1 uint8 level.

- img2img (strength given, and the stock default 0.6 when left out), inpainting, an
  image of 40x48 with no ``size`` (answered at 32x48, the image's size floored to 16) and
  a text-to-image request, all sent at once (edits join the running batches);
- the openai client's ``images.edit``: inpainting with a LoRA (``lora`` as a JSON string)
  and n=2, and an OpenAI-style mask (transparent = repaint) giving the same image;
- each bad upload a 400 naming its field, checked before queuing (httpx and the client).

Slow (a server each): Qwen-Image img2img / inpainting, klein references (a mask and a
32-px reference refused), Qwen-Image 2.1 refused naming model; Kontext at the requested
size (max_area), Qwen-Image-Edit and Edit-Plus, their generations refused naming model.
"""

from __future__ import annotations

import io
import json
import os
import threading

import diffusers
import httpx
import numpy as np
import pytest
from PIL import Image
from test_serve import MSL, Server, _close, _pixels

import functional_dit as fd
import functional_dit.lora as lora
from functional_dit import tiny


def _picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _mask(w: int, h: int) -> Image.Image:
    m = np.zeros((h, w), "uint8")
    m[h // 4 : 3 * h // 4, w // 4 : 3 * w // 4] = 255
    return Image.fromarray(m)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("edits"))
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    path = os.path.join(tmp, "a.safetensors")
    lora.save(lora.init(params.config, rank=4, alpha=8.0, seed=1, zero_b=False), path)
    flags = ("--max-upload-bytes", "200000", "--max-upload-pixels", "9000")
    server = Server(tmp, f"--lora=a={path}", "--max-batch", "4", *flags)
    try:
        server.wait_up()
        yield dict(server=server, params=params, pipe=pipe, adapter=lora.load(path, params))
    finally:
        server.stop()


def _want(env, prompt, seed, image, mask=None, size=(32, 32), **kw) -> np.ndarray:
    """The stock job's pipeline over the same components, run by fd.sample alone (uint8)."""
    cls = diffusers.FluxImg2ImgPipeline if mask is None else diffusers.FluxInpaintPipeline
    pipe = cls.from_pipe(env["pipe"])
    extra = {} if mask is None else {"mask_image": mask}
    out = fd.sample(env["params"], pipe, prompt, height=size[1], width=size[0], steps=2, seed=seed, image=image,
                    max_sequence_length=MSL, output_type="np", **extra, **kw)  # fmt: skip
    return (out[0] * 255).round().astype(int)


def _edit(server, data: dict, files: list, timeout=300.0):
    return httpx.post(server.url + "/v1/images/edits", data=data, files=files, timeout=timeout)


def test_edits_through_httpx_equal_fd_sample_alone_and_join_running_batches(env):
    server, pic, mask = env["server"], _picture(32, 32), _mask(32, 32)
    odd = _picture(40, 48, 2)  # no size: answered at 32x48
    calls = {
        "img2img": lambda: _edit(server, dict(prompt="a fox", seed="3", strength="0.7", size="32x32", priority="2"),
                                 [("image", ("a.png", _png(pic), "image/png"))]),
        "default": lambda: _edit(server, dict(prompt="a cat", seed="4"), [("image[]", ("a.png", _png(pic)))]),
        "inpaint": lambda: _edit(server, dict(prompt="a dog", seed="5", n="2", strength="1"),
                                 [("image", ("a.png", _png(pic))), ("mask", ("m.png", _png(mask)))]),
        "odd": lambda: _edit(server, dict(prompt="a bird", seed="6", steps="2"), [("image", ("o.png", _png(odd)))]),
        "t2i": lambda: server.post(dict(prompt="a tree", seed=7, size="32x32"), timeout=300),
    }  # fmt: skip
    got = {}
    threads = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f())) for k, f in calls.items()]
    [t.start() for t in threads]
    [t.join(320) for t in threads]
    assert {k: r.status_code for k, r in got.items()} == dict.fromkeys(calls, 200), {
        k: r.text[:300] for k, r in got.items()
    }
    _close(_pixels(got["img2img"].json()["data"][0]["b64_json"]), _want(env, "a fox", 3, pic, strength=0.7))
    _close(_pixels(got["default"].json()["data"][0]["b64_json"]), _want(env, "a cat", 4, pic, strength=0.6))
    for j, d in enumerate(got["inpaint"].json()["data"]):
        _close(_pixels(d["b64_json"]), _want(env, "a dog", 5 + j, pic, mask, strength=1.0))
    odd_png = _pixels(got["odd"].json()["data"][0]["b64_json"])
    assert odd_png.shape == (48, 32, 3)
    _close(odd_png, _want(env, "a bird", 6, odd, size=(32, 48)))
    want = fd.sample(env["params"], env["pipe"], "a tree", height=32, width=32, steps=2, seed=7,
                     max_sequence_length=MSL, output_type="np")[0]  # fmt: skip
    _close(_pixels(got["t2i"].json()["data"][0]["b64_json"]), (want * 255).round().astype(int))


def test_openai_client_images_edit_equal_fd_sample(env):
    import openai

    client = openai.OpenAI(base_url=env["server"].url + "/v1", api_key="unused", max_retries=0, timeout=300)
    pic, mask = _picture(32, 32, 1), _mask(32, 32)
    extra = {"seed": 9, "steps": 2, "strength": 0.8, "lora": json.dumps([{"name": "a", "scale": 0.8}])}
    files = dict(image=("a.png", _png(pic), "image/png"), mask=("m.png", _png(mask)))
    res = client.images.edit(model="flux", **files, prompt="a red door", n=2, size="32x32",
                             response_format="b64_json", extra_body=extra)  # fmt: skip
    assert len(res.data) == 2
    for j, d in enumerate(res.data):
        want = _want(env, "a red door", 9 + j, pic, mask, strength=0.8, lora=[(env["adapter"], 0.8)])
        _close(_pixels(d.b64_json), want)
    # OpenAI's mask convention: transparent = repaint (the same region as the white one above)
    alpha = Image.fromarray(255 - np.asarray(mask))
    openai_mask = Image.merge("RGBA", (*Image.new("RGB", (32, 32)).split(), alpha))
    res = client.images.edit(model="flux", image=("a.png", _png(pic)), mask=("m.png", _png(openai_mask)),
                             prompt="a red door", size="32x32", extra_body={**extra, "lora": ""})  # fmt: skip
    _close(_pixels(res.data[0].b64_json), _want(env, "a red door", 9, pic, mask, strength=0.8))


BAD = [  # (form fields, files, the field the 400 names, a phrase of its message)
    ({"prompt": "x"}, [("image", ("a.txt", b"not an image at all"))], "image", "a PNG, JPEG or WebP image"),
    ({"prompt": "x"}, [("image", ("a.png", "P1")), ("mask", ("m.png", "P2"))], "mask", "the image's size 32x32"),
    ({"prompt": "x"}, [("image", ("a.png", "P1")), ("image", ("b.png", "P1"))], "image", "at most 1 image(s)"),
    ({"prompt": "x"}, [("image", ("a.png", "BIG"))], "image", "--max-upload-bytes"),
    ({"prompt": "x"}, [("image", ("a.png", "WIDE"))], "image", "--max-upload-pixels"),
    ({"prompt": "x", "strength": "0"}, [("image", ("a.png", "P1"))], "strength", "(0, 1]"),
    ({"prompt": "x", "strength": "1.5"}, [("image", ("a.png", "P1"))], "strength", "(0, 1]"),
    ({"prompt": "x", "strength": "nan"}, [("image", ("a.png", "P1"))], "strength", "a finite number"),
    ({"prompt": "x", "seed": "one"}, [("image", ("a.png", "P1"))], "seed", "an int"),
    ({"prompt": "x", "priority": "high"}, [("image", ("a.png", "P1"))], "priority", "an int"),
    ({"prompt": "x", "deadline_ms": "-5"}, [("image", ("a.png", "P1"))], "deadline_ms", "positive number"),
    ({"prompt": "x", "lora": "[{"}, [("image", ("a.png", "P1"))], "lora", "a JSON list"),
    ({"prompt": "x", "lora": '[{"name": "zz"}]'}, [("image", ("a.png", "P1"))], "lora[0].name", "loaded adapters"),
    ({"prompt": "x"}, [], "image", "an image file"),
    ({"prompt": "x", "image": "text"}, [], "image", "a file"),
    ({"prompt": "x", "output_format": "jpeg"}, [("image", ("a.png", "P1"))], "output_format", "'png'"),
    ({"prompt": ""}, [("image", ("a.png", "P1"))], "prompt", "a non-empty string"),
    ({"prompt": "x", "model": "dall-e-2"}, [("image", ("a.png", "P1"))], "model", "'flux'"),
]
FILES = {
    "P1": _png(_picture(32, 32)),
    "P2": _png(_mask(48, 32)),
    "BIG": os.urandom(250_000),  # over --max-upload-bytes 200000
    "WIDE": _png(_picture(100, 100)),  # 10000 pixels, over --max-upload-pixels 9000
}


def _files(files):
    return [(k, (name, FILES.get(v, v) if isinstance(v, str) else v)) for k, (name, v) in files]


@pytest.mark.parametrize("fields, files, field, phrase", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_edits_are_400s_naming_the_field(env, fields, files, field, phrase):
    server = env["server"]
    before = server.metrics().get('fd_serve_requests_total{status="200"}', 0)
    r = _edit(server, fields, _files(files), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and phrase in err["message"], err
    assert server.metrics()["fd_serve_queue_depth"] == 0
    assert server.metrics().get('fd_serve_requests_total{status="200"}', 0) == before


def test_bad_edits_through_the_openai_client(env):
    import openai

    client = openai.OpenAI(base_url=env["server"].url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(model="flux", image=("a.txt", b"hello"), prompt="x")
    assert e.value.body["param"] == "image" and "PNG" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(model="flux", image=[("a.png", FILES["P1"]), ("b.png", FILES["P1"])], prompt="x")
    assert e.value.body["param"] == "image" and "at most 1 image(s)" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(model="flux", image=("a.png", FILES["P1"]), prompt="x", extra_body={"strength": 2})
    assert e.value.body["param"] == "strength"


def _ask(url: str, model: str, files, **extra):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.images.edit(model="tiny:" + model, prompt="a red cube", size="32x32", extra_body=extra, **files)


@pytest.mark.slow  # a server per family
@pytest.mark.parametrize("model", ["qwen-image", "flux2-klein", "qwen-image-2.1"])
def test_other_families_edit_jobs(tmp_path, model):
    """A server of each other family, through the openai client (a server each: slow).
    Qwen-Image: img2img and inpainting; klein: two reference images (``image[]``), a mask
    refused naming mask; Qwen-Image 2.1 (no edit job served yet): a 400 naming model."""
    pics, mask = [_picture(64, 64, 3), _picture(96, 64, 4)], _mask(64, 64)  # FLUX.2 takes sides ≥ 64
    server = Server(str(tmp_path), model="tiny:" + model, msl=None)
    got, refused = [], None
    try:
        server.wait_up()
        if model == "qwen-image":
            got.append(_ask(server.url, model, dict(image=("a.png", _png(pics[0]))), seed=1, strength=0.7))
            got.append(
                _ask(server.url, model, dict(image=("a.png", _png(pics[0])), mask=("m.png", _png(mask))), seed=2)
            )
        if model == "flux2-klein":
            got.append(_ask(server.url, model, dict(image=[("a.png", _png(p)) for p in pics]), seed=3))
            small = _edit(server, {"prompt": "x"}, [("image", ("a.png", _png(_picture(32, 32))))]).json()["error"]
        r = _edit(server, {"prompt": "x"}, [("image", ("a.png", _png(pics[0]))), ("mask", ("m.png", _png(mask)))])
        refused = r.json()["error"] if model != "qwen-image" else None
    finally:
        server.stop()
    if model == "qwen-image-2.1":
        assert refused["param"] == "model" and "an edit job served" in refused["message"], refused
        return
    pipe = tiny.pipeline(model)
    params = fd.from_diffusers(pipe.transformer)
    wants = {
        "qwen-image": [dict(seed=1, image=pics[0], strength=0.7),
                       dict(seed=2, image=pics[0], mask_image=mask, strength=0.6)],
        "flux2-klein": [dict(seed=3, image=pics)],
    }[model]  # fmt: skip
    for res, kw in zip(got, wants, strict=True):
        want = fd.sample(params, pipe, "a red cube", height=32, width=32, steps=2, output_type="np", **kw)[0]
        _close(_pixels(res.data[0].b64_json), (want * 255).round().astype(int))
    if model == "flux2-klein":
        assert refused["param"] == "mask" and "FLUX.2 reference images takes none" in refused["message"], refused
        assert small["param"] == "image" and "at least 64px" in small["message"], small


@pytest.mark.slow  # a server per pipeline; the edit pipelines encode their references near 1024²
@pytest.mark.parametrize("model", ["flux-kontext", "qwen-image-edit", "qwen-image-edit-plus"])
def test_image_job_pipelines_served(tmp_path, model):
    """Kontext (the requested size's area is its max_area: the answer at the requested size),
    Qwen-Image-Edit and Edit-Plus (two images): each through the openai client, equal to
    ``fd.sample`` alone; a generations request to such a server is a 400 naming model."""
    pics = [_picture(64, 64, 5), _picture(96, 64, 6)]
    files = [("a.png", _png(p)) for p in (pics if model.endswith("plus") else pics[:1])]
    server = Server(str(tmp_path), model="tiny:" + model, msl=None)
    try:
        server.wait_up()
        res = _ask(server.url, model, dict(image=files if len(files) > 1 else files[0]), seed=4)
        refused = server.post(dict(model="tiny:" + model, prompt="x"), timeout=60).json()["error"]
    finally:
        server.stop()
    pipe = tiny.pipeline(model)
    params = fd.from_diffusers(pipe.transformer)
    image = pics if model.endswith("plus") else pics[0]
    area = {"max_area": 32 * 32} if model == "flux-kontext" else {}
    want = fd.sample(params, pipe, "a red cube", height=32, width=32, steps=2, seed=4, image=image, output_type="np",
                     **area)[0]  # fmt: skip
    got = _pixels(res.data[0].b64_json)
    assert got.shape == (32, 32, 3)
    _close(got, (want * 255).round().astype(int))
    assert refused["param"] == "model" and "POST /v1/images/edits" in refused["message"], refused


def test_what_a_served_pipeline_does_with_images_is_its_familys_table():
    """The edits' checks read the served pipeline's `ImageInputs` from its family: an
    inpainting pipeline served needs the mask (a 400 naming mask without one), img2img takes
    none, a reference pipeline takes no strength; a family without one names model."""
    from functional_dit.pipelines import families
    from functional_dit.serve import _edits

    png = _png(Image.new("RGB", (32, 32), (200, 10, 10)))
    cases = [
        ("FluxInpaintPipeline", dict(mask=None), "mask", "a mask (FLUX.1 inpainting repaints where it is white)"),
        ("QwenImageImg2ImgPipeline", dict(mask=png), "mask", "no mask (Qwen-Image img2img takes none)"),
        ("Flux2KleinPipeline", dict(images=[png] * 11), "image", "at most 10 image(s) for FLUX.2 reference images"),
    ]
    for name, kw, field, expected in cases:
        with pytest.raises(_edits.BadField) as e:
            _edits.pictures(families.image_inputs(name), kw.get("images", [png]), kw.get("mask"), 10**8)
        assert e.value.field == field and expected in str(e.value), (name, e.value)
    with pytest.raises(_edits.BadField, match="strength: expected no strength"):
        _edits.strength(families.image_inputs("Flux2Pipeline"), 0.5)
    assert _edits.strength(families.image_inputs("FluxPipeline"), None) == 0.6  # the stock img2img default
    assert [_edits.image_jobs(type(name, (), {})()) for name in ("FluxKontextPipeline", "FluxPipeline")] == [
        True,
        False,
    ]
    with pytest.raises(_edits.BadField, match="model: expected a model with an edit job served"):
        _edits.job(type("QwenImage21Pipeline", (), {})())
