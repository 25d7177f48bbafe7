"""``python -m functional_dit serve``: an OpenAI-compatible image server with step-level
continuous batching and a LoRA per request (docs/serving.md).

- `_engine`: the worker thread that batches `functional_dit.sampling` items step by step;
- `_app`: the HTTP routes (Starlette on uvicorn), checks, errors and metrics;
- `_journal`: the journal of accepted requests and ``--resume-journal``;
- here: running the server with its drain on SIGTERM / SIGINT (`serve`); the command
  (`functional_dit.cli.serve`) hands it the model loader, so the server imports nothing
  of the CLI (bad flags are ``ValueError``s, printed by the CLI as its own errors).
"""

from __future__ import annotations

import os
import threading
import time

import torch

# what ``serve --device xla`` says, before anything loads, where torch_xla is not installed
XLA_MISSING = (
    'serve --device xla needs torch_xla: pip install "torch_xla" (TPU: torch_xla[tpu]; Trainium: torch-neuronx), '
    "matching your torch"
)


# what ``serve --device xla --tp/--sp`` says (tp and sp on XLA devices are not run: the
# reasons measured with torch_xla 2.9: docs/xla.md "Under torchrun"),
# before anything loads, torch_xla installed or not
XLA_SHARDED = (
    "--tp/--sp: expected 1 with --device xla, got --tp {tp} --sp {sp} (tp and sp on XLA devices are not run yet: "
    "torch_xla 2.9 registers no default process-group backend for the 'xla' device, and its CPU runtime's "
    "collectives do not cross processes); --dp N runs a whole model per rank, and --xla-buckets without "
    "--device xla checks tp/sp batching on the CPU"
)


def __getattr__(name):
    """``Engine`` and ``Job`` (`functional_dit.serve._engine`) for callers that run the engine
    in-process (``bench --suite gpu``), resolved on first use."""
    if name in ("Engine", "Job"):
        # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_adapters(specs, params) -> dict:
    """``--lora NAME=PATH`` (repeatable) -> {name: adapter}."""
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    import functional_dit.lora as lora

    out = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora: expected NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        if not os.path.isfile(path):
            raise ValueError(f"--lora: {path} is not a file")
        out[name] = lora.load(path, params)
    return out


def serve(service, host: str, port: int, request_timeout: float, drain_timeout: float = 600.0) -> int:
    """Run the server until SIGTERM / SIGINT, then drain: new requests get 503, queued and
    running ones finish (up to ``drain_timeout`` s), and the process returns 0."""
    # optional: the [serve] extra
    import uvicorn

    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    from ._app import app

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # drain first, then let uvicorn close
            if service.draining:
                self.should_exit = True  # a second signal: stop now
                return
            service.draining = True
            print(DRAINING.format(timeout=drain_timeout), flush=True)
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self):
            start = time.monotonic()
            end = start + drain_timeout
            while not service.engine.idle() and time.monotonic() < end and service.engine.error is None:
                time.sleep(0.05)
            time.sleep(0.3)  # the last answers leave the event loop
            print(drained_line(service.engine, time.monotonic() - start), flush=True)
            self.should_exit = True

    def watch():  # a failed engine (a dead rank) ends the server: clients already got 503
        while not server.should_exit:
            if service.engine.error is not None:
                time.sleep(0.5)  # the waiting clients' 503s leave first
                server.should_exit = True
            time.sleep(0.1)

    config = uvicorn.Config(app(service, request_timeout), host=host, port=port, log_level="warning", lifespan="off")
    server = Server(config)
    threading.Thread(target=watch, daemon=True).start()
    server.run()
    service.engine.stop()
    if service.journal is not None:
        service.journal.close()
    return 0 if service.engine.error is None else 1


# what the server prints when a SIGTERM / SIGINT starts its drain (`drained_line`: its end)
DRAINING = "draining: finishing the accepted requests (up to {timeout:g} s); new ones get 503; a 2nd signal stops now"


def drained_line(engine, seconds: float) -> str:
    """What it says when the drain ends: finished, timed out or failed."""
    if engine.error is not None:
        how = f"stopped by a failed engine ({type(engine.error).__name__})"
    elif not engine.idle():
        how = "timed out with requests unfinished"
    else:
        how = "every accepted request answered"
    return f"drained in {seconds:.1f} s: {how}; stopping"


def run(args, load_model) -> int:
    """``python -m functional_dit serve`` (`functional_dit.cli.serve` parses the flags;
    ``load_model(spec, base) -> (params, pipe)`` resolves ``--model``)."""
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    from . import _journal, _ranks, _xla

    if args.resume_journal and not args.journal:
        raise ValueError("--resume-journal: expected with --journal PATH")
    if args.request_timeout <= 0:
        raise ValueError(f"--request-timeout: expected a positive number of seconds, got {args.request_timeout}")
    run_time = run_time_loras(args)
    fixed = _xla.options(args, run_time)  # before anything loads: --device xla's flags checked, the device found
    mesh = _mesh(args)
    params, pipe, group, leader = _load(args, mesh, load_model)
    if fixed is not None:
        params = _xla.to_device(params, fixed["device"])
    service = _service(args, params, pipe, run_time, fixed)
    if fixed is not None:
        _xla.warm(service.engine, fixed, args)
    engine = service.engine
    rank = 0 if mesh is None else torch.distributed.get_rank()
    if mesh is not None:  # every rank runs its group's share of rank 0's turns (`functional_dit.serve._ranks`)
        ranks = _ranks.Ranks(service, rank, group, args.dp, leader)
        engine.sync, engine.heartbeat, engine.group = ranks.sync, 1.0, group
        engine.others = ranks if rank == 0 and args.dp > 1 else None
        if engine.others is not None and fixed is not None:  # /metrics: every group's compiles and buckets
            engine.backend.others = ranks.backend_stats
    if rank != 0:
        return _ranks.finish(_ranks.follow(engine))
    service.journal = _journal.Journal(args.journal) if args.journal else None
    engine.start()
    if args.resume_journal:
        _journal.resume(args.journal, service, lambda job: engine.submit(job, force=True))
    print(f"serving {args.model} on http://{args.host}:{args.port}", flush=True)
    code = serve(service, args.host, args.port, args.request_timeout)
    return code if mesh is None else _ranks.finish(code)


def _load(args, mesh, load_model):
    """(params, pipe, dp group, leader): the model, under torchrun sharded over this dp
    group's sp x tp ranks (its batches never meet another group's)."""
    params, pipe = load_model(args.model, args.base)
    if mesh is None:
        return params, pipe, 0, True
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    import sharding

    group, leader = mesh.get_local_rank("dp"), mesh.get_local_rank("sp") == mesh.get_local_rank("tp") == 0
    inner = mesh[("sp", "tp")]
    if inner.size() > 1:
        params = sharding.shard_params(params, inner)
    return params, pipe, group, leader


def _service(args, params, pipe, run_time: dict, fixed: dict | None = None):
    """The engine and the HTTP service over it, its adapters, and its defaults checked
    against its own limits; ``fixed`` (`_xla.options`): its backend the fixed-shape one."""
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    from . import _app, _edits, _engine, _loras, _xla

    adapters = load_adapters(args.lora, params)
    if getattr(args, "device", "cpu") != "cpu":  # the adapters where the params are
        adapters = {k: _xla.to_device(v, _xla.param_device(params)) for k, v in adapters.items()}
    try:
        engine = _engine.Engine(
            params,
            pipe,
            adapters,
            max_batch=args.max_batch if fixed is None else _xla.max_batch(fixed, args),
            max_queue=args.max_queue,
            aging=args.aging,
            image_jobs=_edits.image_jobs(pipe),
            # a fixed-shape XLA batch holds one size (its graphs are per size and bucket)
            mixed=args.mixed_resolution == "on" and fixed is None,  # (--xla-buckets on the CPU too)
            max_padding=_engine.MAX_PADDING if args.max_padding is None else args.max_padding,
            backend=None if fixed is None else _xla.backend(fixed, args),
        )
    except ValueError as e:  # a model the per-item sampler does not run (image inputs: Kontext, edit, ...)
        raise ValueError(f"--model {args.model}: {e}") from None
    limits = dict(n=args.max_images, multiple=pipe.vae_scale_factor * 2, max_size=args.max_size,
                  max_sequence_length=args.max_sequence_length, max_steps=args.max_steps)  # fmt: skip
    limits.update(upload_bytes=args.max_upload_bytes, upload_pixels=args.max_upload_pixels)  # edits' uploads
    service = _app.Service(engine, args.model, defaults=dict(steps=args.steps, size=args.size), limits=limits)
    service.loras = _loras.Loras(adapters, **run_time)
    try:
        service.requests({"prompt": "x"})  # the defaults themselves must pass
    except _app.BadRequest as e:
        raise ValueError(f"--size/--steps/--max-steps: {e}") from None
    return service


def run_time_loras(args) -> dict:
    """`functional_dit.serve._loras.Loras`' ``sources`` (``--lora``'s paths), ``root``
    (``--lora-dir``) and ``token`` (``--admin-token`` or $FD_SERVE_ADMIN_TOKEN), each or
    None; refused under torchrun, where rank 0 alone would change its adapters."""
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    from ._loras import TOKEN_ENV

    root, token = args.lora_dir, args.admin_token or os.environ.get(TOKEN_ENV) or None
    if (root or token) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            f"--lora-dir/--admin-token/{TOKEN_ENV}: adapters cannot change at run time under torchrun yet "
            "(every rank would have to load them in the same turn); load them at start-up with --lora NAME=PATH"
        )
    if root is not None and not os.path.isdir(root):
        raise ValueError(f"--lora-dir: expected a folder, got {root!r}")
    return dict(sources={s.partition("=")[0]: s.partition("=")[2] for s in args.lora}, root=root, token=token)


def _mesh(args):
    """The dp x sp x tp mesh under torchrun (``--dp * --sp * --tp`` = WORLD_SIZE), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp * args.sp * args.tp != world:
        raise ValueError(
            f"--dp/--sp/--tp: expected dp*sp*tp = torchrun's WORLD_SIZE ({world}), "
            f"got {args.dp}*{args.sp}*{args.tp} = {args.dp * args.sp * args.tp}"
        )
    if world == 1:
        return None
    # imported on use: the server's modules load starlette (the [serve] extra) and the model stack
    import sharding

    # ``--device xla`` (dp only): the turns' objects over gloo, each rank's model on its own XLA device
    cpu = "cpu" if getattr(args, "device", "cpu") == "xla" else None
    return sharding.make_mesh(tp=args.tp, sp=args.sp, dp=args.dp, device_type=cpu, timeout=args.rank_timeout)
