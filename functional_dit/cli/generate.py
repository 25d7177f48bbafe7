"""``python -m functional_dit generate``: an image from a real checkpoint with `fd.sample`.

``--model`` is a diffusers pipeline folder, a transformer folder or ``.safetensors`` file
with ``--base`` for the rest of the pipeline, a preset whose weights are in the local
Hugging Face cache (nothing is downloaded), or the name of an offline tiny pipeline
(``flux``, ``qwen-image-edit``, ...: `functional_dit.cli._models`). Everything checkable is checked before the
heavy loading, each failure one line; the image is written through a temporary file.
``--prompts FILE --out-dir DIR`` makes many images (`functional_dit.cli._many`). docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import functional_dit as fd
import sharding
import weights

from .. import families
from ..pipelines import placement as _placement
from ..pipelines.schedule import STRENGTH, t_start
from . import _cache_report, _lora, _many, _models, _quiet
from . import _checks as C
from ._args import CLIError, cache_spec, finite, positive, scale, seed
from ._files import write_image
from ._models import PRESET_REPOS  # noqa: F401  (re-exported: the presets' released weights)
from ._progress import advance

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
# --height/--width/--steps when left out: the released models' usual size and FLUX.1-dev's
# steps, and for an offline tiny pipeline (random weights, for trying things out) the demo's
# small default, so a bare `--model flux` takes a second, not a minute at 1024x1024.
DEFAULTS = dict(height=1024, width=1024, steps=28)
TINY_DEFAULTS = dict(height=64, width=64, steps=4)


# ----------------------------------------------------------------------------- paths


DESCRIPTION = (
    "Generate an image with fd.sample. Under torchrun, --tp/--sp/--dp/--ring/--fsdp shard the model "
    "over the ranks (tp*sp*dp*ring*fsdp = the number of ranks); rank 0 shows progress and writes the image."
)


def add_arguments(p) -> None:
    _job_arguments(p)
    _sampling_arguments(p)
    _run_arguments(p)


def _job_arguments(p) -> None:
    """What to make: the model, the prompts and the input images."""
    p.add_argument(
        "--model",
        required=True,
        help="a diffusers pipeline folder, a transformer folder or .safetensors file (with --base), "
        "a preset name with weights in the Hugging Face cache, or an offline tiny pipeline: "
        + ", ".join(_models.tiny_names()),
    )
    p.add_argument(
        "--base",
        default=None,
        help="pipeline folder for the text encoders, VAE and scheduler (default: --model's own, a pipeline folder)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="preset for a single transformer file without a config (default: --base's transformer/config.json)",
    )
    p.add_argument("--prompt", default=None, help="one prompt (with --out)")
    p.add_argument(
        "--prompts",
        default=None,
        help="a file of prompts, one a line, or JSON lines with prompt, seed, size, steps, guidance, "
        "true_cfg, negative_prompt (with --out-dir; resumable)",
    )
    p.add_argument("--negative-prompt", default=None, help='with --true-cfg (default: "")')
    p.add_argument(
        "--image",
        nargs="+",
        default=None,
        help="reference image(s) (FLUX.2, Qwen-Image-Edit); FLUX.1, Qwen-Image: the init image",
    )
    p.add_argument("--mask", default=None, help="inpainting: the mask image (white = repaint), with --image")
    p.add_argument(
        "--strength", type=finite, default=None, help="img2img/inpainting: share of the steps run (default: 0.6)"
    )


def _sampling_arguments(p) -> None:
    """The image size, the steps, the seed, the guidance scales and the LoRA files."""
    for flag, what in (("--height", "image height"), ("--width", "image width"), ("--steps", "denoising steps")):
        real, small = DEFAULTS[flag.removeprefix("--")], TINY_DEFAULTS[flag.removeprefix("--")]
        p.add_argument(flag, type=positive, default=None, help=f"{what} (default: {real}; {small} for a tiny pipeline)")
    p.add_argument(
        "--seed", type=seed, default=0, help="the noise seed, 0 to 2**64 - 1 (--prompts: line i takes seed + i)"
    )
    p.add_argument(
        "--guidance",
        type=scale,
        default=None,
        help="embedded guidance of FLUX.1-dev, FLUX.2-dev (default: the model's, 3.5 and 4.0)",
    )
    p.add_argument(
        "--true-cfg", type=scale, default=None, help="classifier-free guidance scale, > 1 enables (default: off)"
    )
    p.add_argument(
        "--lora",
        action="append",
        type=_lora.spec,
        default=None,
        metavar="PATH[:SCALE]",
        help="a LoRA file applied on the fly at SCALE (default 1) to every prompt; repeatable (default: none)",
    )


def _run_arguments(p) -> None:
    """How to run it: step caching, the mesh, the device and dtype, and where to write."""
    p.add_argument(
        "--cache",
        type=cache_spec,
        default=None,
        help="step caching: fbcache:THRESHOLD, taylorseer:interval=N,warmup=N,order=N[,attention=1], "
        "magcache:THRESHOLD, fastercache:skip=N,weight=W,low=T,high=T",
    )
    p.add_argument(
        "--encoders",
        default="replicate",
        choices=list(_placement.PLACEMENTS),
        help="text encoders: whole on every rank, sharded over --tp, sharded over --tp and fully sharded (the layers "
        "tp cannot split; gathered per layer), on the CPU, or offloaded to it between uses",
    )
    p.add_argument("--vae-tiling", action="store_true", help="decode in tiles (less memory for large images)")
    p.add_argument(
        "--quantize",
        default=None,
        choices=["fp8-row", "fp8-tensor"],
        help="fp8 compute (fd.quantize, its default skip list): the transformer's linears as scaled fp8 GEMMs",
    )
    _mesh_arguments(p)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: the accelerator, else cpu)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on an accelerator, float32 on the CPU",
    )
    p.add_argument("--out", default=None, help="the image file to write (.png, .jpg, .webp)")
    p.add_argument("--out-dir", default=None, help="with --prompts: the folder for NNNNN.png and manifest.jsonl")
    p.add_argument("--batch-size", type=positive, default=1, help="with --prompts: images per model call")


def _mesh_arguments(p) -> None:
    """The mesh: tensor, sequence, data, ring and fully sharded degrees (under torchrun)."""
    p.add_argument("--tp", type=positive, default=1, help="tensor parallel degree (under torchrun)")
    p.add_argument("--sp", type=positive, default=1, help="sequence parallel degree, Ulysses (under torchrun)")
    p.add_argument("--dp", type=positive, default=1, help="data parallel degree: the images split over ranks")
    p.add_argument(
        "--ring", type=positive, default=1, help="ring attention degree: splits the sequence further, any head count"
    )
    p.add_argument(
        "--fsdp",
        type=positive,
        default=1,
        help="fully sharded weights: each rank holds 1/N of every weight (after --tp's split), gathered per block; "
        "the batch is split like --dp",
    )


def _preset_folder(name: str) -> str:
    if name not in fd.PRESETS:
        raise CLIError(
            f"--model: {name!r} is no file or folder, nor a model name; expected a checkpoint or one of "
            f"{', '.join(_models.generatable())}"
        )
    repo = PRESET_REPOS.get(name)
    if repo is None:
        tiny = _models.tiny_names(families.key(fd.PRESETS[name]))
        raise CLIError(
            f"--model: preset {name!r} is a transformer shape without released weights or a pipeline; "
            f"offline, generate with a tiny pipeline ({', '.join(tiny)}) or pass a checkpoint"
        )
    # the hub client, only for a repo id
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - any miss of the local cache means the same to the user
        raise CLIError(
            f"--model: preset {name!r} has no weights on this machine ({repo} is not in the Hugging Face cache); "
            f"download it first (hf download {repo}) or pass a local folder"
        ) from None


def _pipeline_class(folder: str, flag: str) -> str:
    path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(path):
        raise CLIError(f"{flag}: {folder} is not a checkpoint: no model_index.json (a diffusers pipeline folder)")
    with open(path) as f:
        name = json.load(f).get("_class_name")
    if name not in families.SAMPLED:
        raise CLIError(f"{flag}: {folder} holds a {name}; expected one of {sorted(families.SAMPLED)}")
    return name


def resolve(args) -> tuple[str, str, str | None]:
    """(transformer checkpoint, pipeline folder for the encoders/VAE/scheduler, config)."""
    model = args.model
    if not os.path.exists(model):
        if os.sep in model or model.endswith(".safetensors"):
            raise CLIError(f"--model: {model} does not exist")
        model = _preset_folder(model)
    if args.base is not None and not os.path.isdir(args.base):
        raise CLIError(f"--base: {args.base} is not a folder")
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "model_index.json")):
        base = args.base or model
    elif os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        if args.base is None:
            raise CLIError(f"--model: {model} is a transformer folder; add --base PIPELINE_FOLDER for the encoders")
        base = args.base
    elif os.path.isdir(model):
        raise CLIError(
            f"--model: {model} is not a checkpoint: no model_index.json (pipeline folder) or config.json "
            "(transformer folder)"
        )
    elif not model.endswith(".safetensors"):
        raise CLIError(f"--model: {model} is not a checkpoint: expected a .safetensors file or a folder")
    elif args.base is None:
        raise CLIError(f"--model: {model} is a transformer file; add --base PIPELINE_FOLDER for the encoders and VAE")
    else:
        base = args.base
    _pipeline_class(base, "--base" if args.base else "--model")
    config = args.config
    if config is None and os.path.isfile(model):
        found = os.path.join(base, "transformer", "config.json")
        if not os.path.isfile(found):
            raise CLIError(
                f"--config: {model} is a single file and {base} has no transformer/config.json; name a preset"
            )
        config = found
    return model, base, _config(config)


def _config(config):
    """A preset name stays a name (weights.load takes it); a config.json path becomes a config."""
    if config is None or config in fd.PRESETS:
        return config
    if not os.path.isfile(config):
        raise CLIError(f"--config: expected a preset ({', '.join(sorted(fd.PRESETS))}) or a config.json, got {config}")
    try:
        return fd.config_from_diffusers(config)
    except ValueError as e:
        raise CLIError(f"--config: {config}: {str(e).splitlines()[0]}") from None


def _check_out(out: str) -> None:
    if not out.lower().endswith(IMAGE_SUFFIXES):
        raise CLIError(f"--out: expected an image file name ending in {', '.join(IMAGE_SUFFIXES)}, got {out}")
    if os.path.isdir(out):
        raise CLIError(f"--out: {out} is a folder; expected an image file name")


def vae_scale(base: str) -> int:
    """The VAE's downscaling factor, read from ``vae/config.json`` as the pipelines compute
    it (Qwen-Image: 2 ** len(temperal_downsample); the others: 2 ** (levels - 1))."""
    path = os.path.join(base, "vae", "config.json")
    if not os.path.isfile(path):
        raise CLIError(f"--base: {base} is not a checkpoint: no vae/config.json")
    with open(path) as f:
        cfg = json.load(f)
    if "temperal_downsample" in cfg:
        return 2 ** len(cfg["temperal_downsample"])
    return 2 ** (len(cfg.get("block_out_channels", [0] * 4)) - 1)


def _check_size(scale: int, height: int, width: int) -> None:
    for flag, v in (("--height", height), ("--width", width)):
        if v % (2 * scale):
            raise CLIError(f"{flag}: expected a multiple of {2 * scale} (VAE scale {scale} x 2x2 packing), got {v}")


# ----------------------------------------------------------------------------- set-up


def _mesh(args):
    if getattr(args, "fsdp", 1) > 1 and getattr(args, "quantize", None):
        raise CLIError(
            f"--quantize: fp8 compute ({args.quantize}) is not supported with fully sharded weights (--fsdp "
            f"{args.fsdp}) yet; drop one of them"
        )
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = {"tp": args.tp, "sp": args.sp, "dp": args.dp}
    sizes |= {k: getattr(args, k) for k in ("ring", "fsdp") if getattr(args, k, 1) > 1}
    want = math.prod(sizes.values())
    if want != world_env:
        where = "torchrun's WORLD_SIZE" if "WORLD_SIZE" in os.environ else "a single process (no torchrun)"
        flags, values = "*".join(f"--{k}" for k in sizes), "*".join(str(v) for v in sizes.values())
        raise CLIError(f"{flags}: expected {world_env} for {where}, got {values} = {want}")
    if want == 1:
        return None
    return sharding.make_mesh(**sizes, device_type=args.device)


def _device_dtype(args, mesh):
    device = (
        sharding.mesh_device(mesh) if mesh is not None else torch.device(args.device or sharding.default_device_type())
    )
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    return device, dtype


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# ----------------------------------------------------------------------------- run


def _check_outputs(args) -> None:
    """One of --prompt (with --out) or --prompts (with --out-dir)."""
    if (args.prompt is None) == (args.prompts is None):
        raise CLIError("--prompt, --prompts: expected exactly one (a prompt, or a file of prompts)")
    if args.prompt is not None and (args.out is None or args.out_dir is not None):
        raise CLIError("--out: expected with --prompt (and no --out-dir; that is for --prompts)")
    if args.prompts is not None and (args.out_dir is None or args.out is not None):
        raise CLIError("--out-dir: expected with --prompts (and no --out; that is for --prompt)")
    if args.out is not None:
        _check_out(args.out)
    if args.out_dir is not None and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise CLIError(f"--out-dir: {args.out_dir} exists and is not a folder")


def _setup(args):
    """Checks, the mesh and the loads: (pipe, params, images, device, rank0, start, loaded)."""
    _check_outputs(args)
    _lora.check(args)
    tiny = _tiny_name(args)
    if tiny is None:
        model, base, config = resolve(args)
        scale, pipeline = vae_scale(base), _pipeline_class(base, "--base" if args.base else "--model")
    else:
        model, base, config = None, None, _models.tiny_config(tiny)
        scale, pipeline = _models.TINY_VAE_SCALE, _models.tiny_pipeline_class(tiny)
    _check_size(scale, args.height, args.width)
    images = C.open_images(args.image)
    args.mask_image, edit = C.check_edit(pipeline, images, args)
    if edit and args.strength is None:  # the stock img2img/inpainting default, for the progress bar too
        args.strength = STRENGTH
    C.check_images(pipeline, images, edit)
    if tiny is None:
        config = C.check_checkpoint(model, config, pipeline, "--base" if args.base else "--model")
    C.check_guidance(config, args)
    C.check_device(args.device)
    if args.prompts is not None:
        for r in _many.read_requests(args.prompts, args):
            _check_size(scale, r["height"], r["width"])
    mesh = _mesh(args)
    device, dtype = _device_dtype(args, mesh)
    rank0 = _rank() == 0
    start = time.perf_counter()
    with _quiet.loading(progress=False):
        if tiny is None:
            pipe, params = _load(args, model, base, config, mesh, device, dtype)
        else:
            pipe, params = _load_tiny(tiny, mesh, device, dtype, getattr(args, "quantize", None))
        _placement.load_to(pipe, device, args.encoders)
    return pipe, params, images, device, rank0, start, time.perf_counter()


def _tiny_name(args) -> str | None:
    """``--model``'s tiny pipeline name, or None for a path or a preset (`_models.tiny_kind`)."""
    if os.path.exists(args.model):
        return None
    try:
        kind = _models.tiny_kind(args.model)
    except ValueError as e:
        raise CLIError(str(e)) from None
    for flag, value in (("--base", args.base), ("--config", args.config)):
        if kind is not None and value is not None:
            raise CLIError(f"{flag}: not with --model {args.model}, an offline tiny pipeline with its own parts")
    return None if kind is None else args.model


def _load(args, model, base, config, mesh, device, dtype):
    """A checkpoint: the pipeline's encoders, VAE and scheduler from ``base``, our transformer from ``model``."""
    # diffusers: seconds to import, loaded when first used
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(base, transformer=None, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    fp8 = getattr(args, "quantize", None)
    try:  # fp8: quantized whole on the host (scales over whole rows), then sharded or moved
        params = weights.load(
            model, config=config, mesh=None if fp8 else mesh, dtype=dtype, device=None if mesh or fp8 else device
        )
    except ValueError as e:
        raise CLIError(f"--model: {str(e).splitlines()[0]}") from None
    if fp8:
        params = _quantized(params, fp8, mesh, device)
    return pipe, params


def _load_tiny(name: str, mesh, device, dtype, quantize: str | None = None):
    """A tiny pipeline built offline (`_models.tiny_pipeline`), its transformer as our params
    (fp8 compute with ``quantize``: `_quantized`)."""
    pipe = _models.tiny_pipeline(name, dtype=dtype)
    params = fd.from_diffusers(pipe.transformer.to(device if mesh is None and not quantize else "cpu"))
    pipe.transformer = None  # fd.sample never calls it; the params hold its weights
    if quantize:
        return pipe, _quantized(params, quantize, mesh, device)
    return pipe, params if mesh is None else sharding.shard_params(params, mesh)


def _quantized(params, scheme: str, mesh, device):
    """``params`` in fp8 compute (`fd.quantize`), sharded over ``mesh`` or moved to ``device``."""
    params = fd.quantize(params, scheme)
    if mesh is not None:
        return sharding.shard_params(params, mesh)
    return params.replace(torch.utils._pytree.tree_map(lambda t: t.to(device), params.tree))


def _sized(args):
    """``args`` as a new namespace with --height/--width/--steps filled where left out:
    `TINY_DEFAULTS` for an offline tiny pipeline, else `DEFAULTS`."""
    table = TINY_DEFAULTS if _tiny_name(args) is not None else DEFAULTS
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in table.items() if getattr(args, k, None) is None}})


def run(args) -> int:
    args = _sized(args)
    pipe, params, images, device, rank0, start, loaded = _setup(args)
    if args.prompts is not None:
        return _many.run_many(args, params, pipe, images, args.model, rank0, args.dp)
    return _run_one(args, pipe, params, images, device, rank0, start, loaded)


def _sample_kwargs(args, images) -> dict:
    """``--prompt``'s `fd.sample` arguments beyond params, pipeline and the step callback."""
    return dict(
        height=args.height,
        width=args.width,
        steps=args.steps,
        seed=args.seed,
        guidance=args.guidance,
        true_cfg=args.true_cfg,
        negative_prompt=args.negative_prompt,
        image=images,
        strength=getattr(args, "strength", None),
        mask_image=getattr(args, "mask_image", None),
        cache=getattr(args, "cache", None),
        **_placement.cli_kwargs(args),
    )


def fp8_note(scheme: str | None, device) -> str:
    """The output line's words for ``--quantize`` (empty without): the scheme, and on a CPU
    that its scaled GEMM has no fp8 hardware (dequantized to a float GEMM: slower)."""
    if not scheme:
        return ""
    cpu = ", emulated on the CPU: slower than without --quantize"
    return f", fp8 compute {scheme}" + (cpu if device.type == "cpu" else "")


def _run_one(args, pipe, params, images, device, rank0: bool, start: float, loaded: float) -> int:
    """``--prompt``: one image with a progress bar over steps, written by rank 0."""
    adapters = _lora.argument([args.lora], _lora.load(params, [args.lora]))
    strength = getattr(args, "strength", None)
    runs = args.steps if strength is None else args.steps - t_start(args.steps, strength)
    bar = tqdm(total=runs, desc="denoising", disable=not rank0)
    stamps = []

    def step(i, latents):
        stamps.append(time.perf_counter())
        advance(bar)

    kw = _sample_kwargs(args, images)
    run = kw["cache"] = None if kw["cache"] is None else fd.CacheRun(kw["cache"])  # kept: what it skipped
    try:
        image = fd.sample(params, pipe, args.prompt, callback=step, lora=adapters, **kw)[0]
    except ValueError as e:
        raise CLIError(str(e).splitlines()[0]) from None
    finally:
        bar.close()
    if rank0:
        write_image(image, args.out)
        per_step = [b - a for a, b in zip(stamps, stamps[1:])]
        mean = sum(per_step) / len(per_step) if per_step else stamps[0] - loaded
        print(
            f"wrote {args.out} ({args.width}x{args.height}, {args.steps} steps, seed {args.seed}"
            f"{fp8_note(getattr(args, 'quantize', None), device)}); "
            f"load {loaded - start:.1f} s, {mean:.3f} s/step, total {time.perf_counter() - start:.1f} s, "
            f"peak memory {_peak_memory_gib(device):.2f} GiB ({device.type})"
        )
        _cache_report.report([run], params.config)
    return 0
