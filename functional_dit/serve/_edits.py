"""``POST /v1/images/edits``: OpenAI's multipart image-edit body as `functional_dit.sampling` requests.

The form's text fields are the generations body's (``model``, ``prompt``, ``n``, ``size``,
``response_format`` and the extension fields ``seed``, ``steps``, ``guidance``, ``true_cfg``,
``negative_prompt``, ``lora`` as a JSON string, ``cache``) plus ``strength``; its files are
``image`` (one, or several as repeated ``image`` / ``image[]`` fields) and ``mask``. What
the images mean is what ``fd.sample`` makes of them for the served pipeline (its family's
``IMAGE_INPUTS``, `functional_dit.pipelines.families.ImageInputs`): FLUX.1
and Qwen-Image img2img (image alone) and inpainting (with a mask, white = repaint; a mask
with transparent pixels is read as OpenAI's, transparent = repaint), FLUX.2 / klein reference
images, FLUX.1 Kontext (``max_area`` = the requested width x height), Qwen-Image-Edit and
Edit-Plus (those three pipelines serve edits only: `image_jobs`). Every check runs here,
before the request is queued: a body over ``--max-upload-bytes``, a file that is not a
PNG / JPEG / WebP image, an image over ``--max-upload-pixels``, more images than the job
takes, a mask of another size than the image (refused, as OpenAI refuses it; the stock
pipelines would resize it), a ``strength`` outside (0, 1] — each a `BadField` naming the
field. ``size`` left out (or "auto") is the image's size floored to the model's multiple.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re

from PIL import Image

from .. import families as _families
from ..pipelines import families, schedule
from ._errors import BadRequest

MAX_UPLOAD_BYTES = 16 * 2**20  # the whole multipart body (--max-upload-bytes)
MAX_UPLOAD_PIXELS = 4096 * 4096  # each uploaded image, read from its header before decoding (--max-upload-pixels)
FORMATS = ("PNG", "JPEG", "WEBP")
FILES = ("image", "image[]", "mask")
INTS, FLOATS = ("n", "seed", "steps", "priority"), ("guidance", "true_cfg", "strength", "deadline_ms")
IGNORED = {"output_format": "png", "stream": "false"}  # OpenAI fields with the one value served


BadField = BadRequest  # a 400 naming its field


def image_jobs(pipe) -> bool:
    """Whether the served pipeline is an image job of its own (Kontext, the edit pipelines:
    its family's `ImageInputs` role "edit"): the engine runs every item by ``fd.sample``'s
    preparation, and text to image is refused."""
    inputs = families.image_inputs(type(pipe).__name__)
    return inputs is not None and inputs.role == "edit"


def text_only(pipe) -> None:
    """A `BadField` naming ``model`` for a generations request to an image job's pipeline."""
    if image_jobs(pipe):
        raise BadField(
            "model", "a text-to-image model (this one edits images: POST /v1/images/edits)", type(pipe).__name__
        )


def job(pipe) -> families.ImageInputs:
    """The edit job of the served pipeline (its family's `ImageInputs`), or a `BadField`
    naming ``model``."""
    name = type(pipe).__name__
    inputs = families.image_inputs(name)
    if inputs is None:
        takes = [n for n in _families.PIPELINES if families.image_inputs(n) is not None]
        raise BadField("model", f"a model with an edit job served ({', '.join(takes)})", name)
    return inputs


async def form(request, limits: dict) -> tuple[dict, list, bytes | None]:
    """(text fields, image files' bytes, the mask's bytes or None) of the multipart body,
    its size checked against ``limits["upload_bytes"]`` as it arrives."""
    # optional: the [serve] extra
    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    data = await _body(request, limits.get("upload_bytes", MAX_UPLOAD_BYTES))
    kind = request.headers.get("content-type", "")
    if not kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise BadField("body", "multipart/form-data (the OpenAI edits body)", kind)
    try:  # parsed from the bytes read, over a request of its own
        parsed = await Request(request.scope, _replay(data)).form(max_files=16, max_fields=64)
    except HTTPException as e:
        raise BadField("body", "a well-formed multipart/form-data body", e.detail) from None
    return await _fields(parsed.multi_items())


async def _body(request, top: int) -> bytes:
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > top:
        raise BadField("image", f"an upload of at most {top} bytes in all (--max-upload-bytes)", f"{size} bytes")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > top:
            raise BadField("image", f"an upload of at most {top} bytes in all (--max-upload-bytes)", f"over {top}")
        chunks.append(chunk)
    return b"".join(chunks)


def _replay(data: bytes):
    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    return receive


async def _fields(items) -> tuple[dict, list, bytes | None]:
    text, images, masks = {}, [], []
    for key, value in items:
        is_file = not isinstance(value, str)
        if is_file != (key in FILES):
            want = "a file (an image upload)" if key in FILES else "a text field"
            raise BadField(key, want, "a file" if is_file else value)
        if is_file:
            (masks if key == "mask" else images).append(await value.read())
        elif key in text:
            raise BadField(key, "one value", [text[key], value])
        elif value != "":  # the openai client sends None as ""
            text[key] = value
    if len(masks) > 1:
        raise BadField("mask", "one mask image", f"{len(masks)} files")
    return text, images, masks[0] if masks else None


def body(text: dict) -> dict:
    """The text fields as the generations body's JSON values (`functional_dit.serve._app`
    checks them), ``strength`` kept: ints, numbers and ``lora``'s JSON parsed."""
    out = {}
    for key, value in text.items():
        if key in IGNORED:
            if value.lower() != IGNORED[key]:
                raise BadField(key, f"{IGNORED[key]!r} (the one served)", value)
            continue
        out[key] = _typed(key, value)
    return out


def _typed(key: str, value: str):
    if key in INTS:
        if not re.fullmatch(r"\s*[+-]?\d{1,40}\s*", value):
            raise BadField(key, "an int", value)
        return int(value)
    if key in FLOATS:
        try:
            v = float(value)
        except ValueError:
            raise BadField(key, "a number", value) from None
        if not math.isfinite(v):
            raise BadField(key, "a finite number", value)
        return v
    if key == "lora":
        try:
            return json.loads(value)
        except ValueError:
            raise BadField("lora", 'a JSON list of {"name", "scale"}', value) from None
    return value


def pictures(job: families.ImageInputs, images: list, mask: bytes | None, top: int):
    """(the images as RGB PIL images, the mask as an "L" image or None): decoded and checked."""
    if not images:
        raise BadField("image", "an image file (PNG, JPEG or WebP)", "no image")
    if len(images) > job.images:
        raise BadField("image", f"at most {job.images} image(s) for {job.what}", f"{len(images)} images")
    if mask is not None and job.mask == "none":
        raise BadField("mask", f"no mask ({job.what} takes none)", "a mask")
    if mask is None and job.mask == "required":
        raise BadField("mask", f"a mask ({job.what} repaints where it is white)", "no mask")
    out = [_picture("image", data, top).convert("RGB") for data in images]
    if mask is None:
        return out, None
    m = _picture("mask", mask, top)
    if m.size != out[0].size:
        raise BadField("mask", f"the image's size {out[0].size[0]}x{out[0].size[1]}", f"{m.size[0]}x{m.size[1]}")
    return out, _repaint(m)


def _picture(field: str, data: bytes, top: int) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Exception:  # noqa: BLE001 - any undecodable upload is the client's
        raise BadField(field, "a PNG, JPEG or WebP image", f"{len(data)} bytes that are not an image") from None
    if img.format not in FORMATS:
        raise BadField(field, "a PNG, JPEG or WebP image", f"a {img.format} image")
    w, h = img.size
    if w * h > top:
        raise BadField(field, f"an image of at most {top} pixels (--max-upload-pixels)", f"{w}x{h}")
    try:
        img.load()
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise BadField(field, "a complete image", f"{type(e).__name__}: {e}") from None
    return img


def _stock_check(pipe, pics) -> None:
    """The stock pipeline's own checks of its input images (FLUX.2's: each side ≥ 64 px,
    aspect ratio ≤ 8), run here so that they are 400s naming ``image``, not failed jobs."""
    check = getattr(getattr(pipe, "image_processor", None), "check_image_input", None)
    for img in pics if check is not None else ():
        try:
            check(img)
        except ValueError as e:
            raise BadField("image", f"an image {type(pipe).__name__} takes", str(e)) from None


def _repaint(mask: Image.Image) -> Image.Image:
    """White = repaint; a mask with transparent pixels is OpenAI's: transparent = repaint."""
    if "A" in mask.getbands():
        alpha = mask.getchannel("A")
        if alpha.getextrema()[0] < 255:
            return alpha.point(lambda a: 255 if a == 0 else 0)
    return mask.convert("L")


def size(body: dict, image: Image.Image, multiple: int) -> str:
    """The requested size, or the image's floored to ``multiple`` when left out or "auto"."""
    if body.get("size", "auto") != "auto":
        return body["size"]
    w, h = (max(multiple, v // multiple * multiple) for v in image.size)
    return f"{w}x{h}"


def strength(job: families.ImageInputs, value):
    """``strength`` checked: in (0, 1]; left out, the stock
    default (0.6) for img2img and inpainting (a FluxPipeline reads an image without a
    strength as a reference), None for jobs without one."""
    if value is None:
        return schedule.STRENGTH if job.role == "init" else None
    if job.role != "init":
        raise BadField("strength", f"no strength ({job.what} takes none)", value)
    if not 0 < value <= 1:
        raise BadField("strength", "a number in (0, 1]", value)
    return value  # any strength > 0 runs at least one step: steps - int(steps - steps · strength) ≥ 1


async def requests(request, service) -> tuple[dict, list]:
    """(the body to journal, one `sampling.Request` per image) of an edits request to
    ``service`` (`functional_dit.serve._app.Service`, whose checks the text fields pass)."""
    engine, limits = service.engine, service.limits
    if engine.heartbeat is not None:  # ranks rebuild a job from its JSON body: no uploads there yet
        raise BadField("image", "no image: edits are served on one process (not under --tp/--sp/--dp) yet", "image")
    kind = job(engine.ctx.pipe)
    text, images, mask = await form(request, limits)
    fields = body(text)
    pics, mask = pictures(kind, images, mask, limits.get("upload_pixels", MAX_UPLOAD_PIXELS))
    _stock_check(engine.ctx.pipe, pics)
    value = fields.pop("strength", None)
    fields["size"] = size(fields, pics[0], limits["multiple"])
    reqs = service.requests(fields)
    value = strength(kind, value)
    image = pics[0] if kind.images == 1 else pics
    area = {"max_area": reqs[0].height * reqs[0].width} if kind.area else {}
    reqs = [dataclasses.replace(r, image=image, mask_image=mask, strength=value, **area) for r in reqs]
    shown = [f"{w}x{h}" for w, h in (p.size for p in pics)]  # the journal keeps the fields, not the pixels
    return {**fields, "strength": value, "image": shown, "mask": mask is not None}, reqs
