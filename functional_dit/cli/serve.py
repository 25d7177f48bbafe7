"""``python -m functional_dit serve``: the OpenAI-compatible image server
(`functional_dit.serve`; docs/serving.md)."""

from __future__ import annotations

from ._args import CLIError, positive

DESCRIPTION = (
    "An OpenAI-compatible image server (POST /v1/images/generations) with step-level continuous batching "
    "and a LoRA per request. --model flux serves the tiny offline FLUX.1 pipeline."
)


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a tiny pipeline name (flux, ...), checkpoint or preset")
    p.add_argument("--base", default=None, help="the pipeline folder for a transformer-only --model (as generate)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="a LoRA file served as NAME")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=positive, default=8, help="images per running batch (1: batching off)")
    p.add_argument("--max-queue", type=positive, default=64, help="images waiting; more is a 429")
    p.add_argument("--max-images", type=positive, default=4, help="the largest n of one request")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request gets 504")
    p.add_argument("--steps", type=positive, default=28, help="the default steps of a request")
    p.add_argument("--size", default="1024x1024", help="the default size of a request, WxH")
    p.add_argument("--max-size", type=positive, default=2048, help="the largest width or height served")
    p.add_argument("--max-sequence-length", type=positive, default=None, help="text tokens (default: the model's)")
    p.add_argument("--tp", type=positive, default=1, help="tensor parallel degree (under torchrun)")
    p.add_argument("--rank-timeout", type=float, default=60.0, help="seconds before a silent rank fails the server")
    p.add_argument("--journal", default=None, help="a JSONL file: every accepted request is written before it runs")
    p.add_argument(
        "--resume-journal",
        action="store_true",
        help="re-run the journal's unfinished requests",
    )


def run(args) -> int:
    import torch

    from ..serve import _app, _engine, _journal, _ranks, load_adapters, load_model, serve

    if args.resume_journal and not args.journal:
        raise CLIError("--resume-journal: expected with --journal PATH")
    if args.request_timeout <= 0:
        raise CLIError(f"--request-timeout: expected a positive number of seconds, got {args.request_timeout}")
    mesh = _mesh(args)
    params, pipe = load_model(args.model, args.base)
    if mesh is not None:
        import sharding

        params = sharding.shard_params(params, mesh)
    engine = _engine.Engine(params, pipe, load_adapters(args.lora, params), max_batch=args.max_batch,
                            max_queue=args.max_queue)  # fmt: skip
    limits = dict(n=args.max_images, multiple=pipe.vae_scale_factor * 2, max_size=args.max_size,
                  max_sequence_length=args.max_sequence_length)  # fmt: skip
    service = _app.Service(engine, args.model, defaults=dict(steps=args.steps, size=args.size), limits=limits)
    try:
        service.requests({"prompt": "x"})  # the defaults themselves must pass
    except _app.BadRequest as e:
        raise CLIError(f"--size/--steps: {e}") from None
    rank = 0 if mesh is None else torch.distributed.get_rank()
    if mesh is not None:  # every rank runs rank 0's turns (`functional_dit.serve._ranks`)
        engine.sync, engine.heartbeat = _ranks.sync(service, rank), 1.0
    if rank != 0:
        return _ranks.follow(engine)
    service.journal = _journal.Journal(args.journal) if args.journal else None
    engine.start()
    if args.resume_journal:
        _journal.resume(args.journal, service, lambda job: engine.submit(job, force=True))
    print(f"serving {args.model} on http://{args.host}:{args.port}", flush=True)
    return serve(service, args.host, args.port, args.request_timeout)


def _mesh(args):
    """A tp mesh under torchrun (``--tp`` = WORLD_SIZE), else None."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != world:
        raise CLIError(f"--tp: expected torchrun's WORLD_SIZE ({world}), got {args.tp}")
    if world == 1:
        return None
    import sharding

    return sharding.make_mesh(tp=args.tp, timeout=args.rank_timeout)
