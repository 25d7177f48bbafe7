"""Adapters changed while serving (``serve --lora-dir DIR --admin-token T``).

``GET /v1/loras`` lists the adapters new requests may name (name, path, ranks, scales,
bytes); ``POST /v1/loras {"name", "path"}`` loads ``DIR/path`` under ``name``;
``DELETE /v1/loras/{name}`` removes the name. Changes need ``Authorization: Bearer T``
(401 without it, 403 with another token, compared in constant time; 403 when the server
has no token: adapters are then fixed at start-up). ``path`` is relative to ``DIR`` and
must stay inside it: an absolute path, a ``..`` part or a symlink resolving out of it is
a 400 naming ``path``. A request holds its adapters from its checks on (its items keep
the `Adapter` itself, not the name), so a delete only stops new requests from naming it;
its memory goes when the last request using it is answered.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import pathlib
import re

import torch
from starlette.responses import JSONResponse
from starlette.routing import Route

import functional_dit.lora as lora

from ._errors import BadRequest, error

TOKEN_ENV = "FD_SERVE_ADMIN_TOKEN"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INNER = "pytorch_lora_weights.safetensors"  # the file `lora.load` reads in a folder


class Loras:
    """The adapters new requests may name: ``adapters`` {name: Adapter}, ``sources``
    {name: path}; ``root`` (``--lora-dir``) and ``token`` (the admin token) or None. A
    change replaces the dicts, never edits them: a reader keeps a consistent view."""

    def __init__(self, adapters=None, sources=None, root=None, token=None):
        self.adapters, self.sources = dict(adapters or {}), dict(sources or {})
        self.root, self.token = root, token

    def add(self, name: str, adapter, source: str) -> None:
        self.adapters, self.sources = {**self.adapters, name: adapter}, {**self.sources, name: source}

    def remove(self, name: str) -> None:
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}
        self.sources = {k: v for k, v in self.sources.items() if k != name}

    def listing(self) -> list[dict]:
        return [describe(n, a, self.sources.get(n)) for n, a in sorted(self.adapters.items())]


def nbytes(adapter) -> int:
    """The bytes of the adapter's tensors."""
    return sum(t.numel() * t.element_size() for t in adapter.leaves() if isinstance(t, torch.Tensor))


def describe(name: str, adapter, source) -> dict:
    """``GET /v1/loras``' entry: its ranks and ``alpha / rank`` scales (each distinct value)."""
    mods = adapter.config.modules
    scales = sorted({adapter.config.scale(m) for m, _, _ in mods})
    return dict(name=name, path=source, ranks=sorted({r for _, r, _ in mods}), scales=scales, modules=len(mods),
                bytes=nbytes(adapter))  # fmt: skip


def resolve(root, path) -> str:
    """The file ``path`` names under ``root`` (BadRequest naming ``path`` if it escapes
    ``root`` or is no LoRA file): every symlink resolved, a folder's inner file too."""
    want = "a path relative to --lora-dir, inside it"
    if root is None:
        raise BadRequest("path", f"{want} (this server has no --lora-dir: adapters are fixed at start-up)", path)
    if not isinstance(path, str) or not path or "\x00" in path:
        raise BadRequest("path", want, path)
    if os.path.isabs(path) or ".." in pathlib.PurePath(path).parts:
        raise BadRequest("path", f"{want} (no absolute path, no '..')", path)
    base, full = os.path.realpath(root), os.path.realpath(os.path.join(root, path))
    file = os.path.realpath(os.path.join(full, INNER)) if os.path.isdir(full) else full
    if any(os.path.commonpath([base, p]) != base for p in (full, file)):
        raise BadRequest("path", f"{want} (a symlink may not point out of it)", path)
    if not os.path.isfile(file):
        raise BadRequest("path", f"a LoRA .safetensors file (or a folder with {INNER}) under --lora-dir", path)
    return file


def refusal(header, token):
    """None if ``header`` (``Authorization``) carries ``token``; else (status, message)."""
    if token is None:
        return 403, f"adapters are fixed: start serve with --admin-token or {TOKEN_ENV} to change them"
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401, "Authorization: expected 'Bearer <admin token>'"
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return 403, "Authorization: the admin token is wrong"
    return None


def _checked(loras: Loras, body) -> tuple[str, str, str]:
    """(name, file, path) of a POST body (BadRequest on the first bad field)."""
    if not isinstance(body, dict) or set(body) - {"name", "path"}:
        raise BadRequest("body", 'a JSON object {"name", "path"}', body)
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest("name", "1 to 64 letters, digits, '.', '_' or '-' (a letter or digit first)", name)
    return name, resolve(loras.root, body.get("path")), body["path"]


def _taken(name: str) -> JSONResponse:
    return error(409, f"name: {name!r} is already loaded (DELETE /v1/loras/{name} first)", "name")


def routes(service, answer) -> list[Route]:
    """The three routes over ``service.loras``; ``answer(status, response)`` counts them."""
    loras = service.loras

    def denied(request):
        no = refusal(request.headers.get("authorization"), loras.token)
        headers = {"WWW-Authenticate": "Bearer"} if no and no[0] == 401 else None
        return None if no is None else answer(no[0], error(no[0], no[1], "Authorization", headers))

    async def listing(_):
        return JSONResponse({"object": "list", "data": loras.listing()})

    async def add(request):
        if (no := denied(request)) is not None:
            return no
        try:
            name, file, path = _checked(loras, await _body(request))
            if name in loras.adapters:
                return answer(409, _taken(name))
            adapter = await asyncio.to_thread(_load, file, service.engine.params, path)
        except BadRequest as e:
            return answer(400, error(400, str(e), e.field))
        if name in loras.adapters:  # another POST took the name while this one loaded
            return answer(409, _taken(name))
        loras.add(name, adapter, path)
        return answer(200, JSONResponse(describe(name, adapter, path)))

    async def remove(request):
        if (no := denied(request)) is not None:
            return no
        name = request.path_params["name"]
        if name not in loras.adapters:
            return answer(404, error(404, f"name: expected one of the loaded adapters {sorted(loras.adapters)}, "
                                          f"got {name!r}", "name"))  # fmt: skip
        loras.remove(name)
        return answer(200, JSONResponse({"name": name, "deleted": True}))

    return [Route("/v1/loras", listing, methods=["GET"]), Route("/v1/loras", add, methods=["POST"]),
            Route("/v1/loras/{name}", remove, methods=["DELETE"])]  # fmt: skip


async def _body(request):
    try:
        return await request.json()
    except ValueError:
        raise BadRequest(
            "body", 'a JSON object {"name", "path"}', (await request.body())[:80].decode(errors="replace")
        ) from None


def _load(file: str, params, path: str):
    """`functional_dit.lora.load`, its failure a 400 naming ``path``."""
    try:
        return lora.load(file, params)
    except Exception as e:  # noqa: BLE001 - a file that is no adapter of this model: the client's error
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadRequest("path", f"a LoRA file for this model ({first})", path) from None


def metrics(loras: Loras) -> list[str]:
    """``fd_serve_loras`` (adapters loaded) and ``fd_serve_lora_bytes`` (their tensors)."""
    total = sum(nbytes(a) for a in loras.adapters.values())
    return ["# TYPE fd_serve_loras gauge", f"fd_serve_loras {len(loras.adapters)}",
            "# TYPE fd_serve_lora_bytes gauge", f"fd_serve_lora_bytes {total}"]  # fmt: skip
