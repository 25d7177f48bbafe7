"""The Markdown report of ``bench --suite gpu`` (`functional_dit.cli.bench_suite`): a
header saying what ran and what is real or tiny, one table per section (a ``ratio A/B``
column is A over B: of seconds or GiB, below 1 is faster or less; of images/s, above 1 is
faster), peak memory per section, and every figure."""

from __future__ import annotations

from .. import api as _api
from ..pipelines.families import product as _product
from ._bench_models import machine

S, X, G, E = "{:.4f}", "{:.2f}", "{:.2f}", "{:.1e}"  # seconds, ratios, GiB, relative differences
COLUMNS = {  # section -> [(header, row key, format)]
    "forward": [("family", "family", "{}"), ("shape", "shape", "{}"), ("params (B)", "params_b", "{:.3f}"),
                ("ours s", "ours_s", S), ("diffusers s", "diffusers_s", S), ("ratio ours/diffusers", "ratio", X),
                ("peak GiB ours", "peak_ours_gib", G), ("peak GiB diffusers", "peak_diffusers_gib", G),
                ("max rel diff", "rel_err", E)],
    "compiled": [("family", "family", "{}"), ("shape", "shape", "{}"), ("first call ours s", "first_ours_s", X),
                 ("first call diffusers s", "first_diffusers_s", X), ("ratio first call", "ratio_first", X),
                 ("ours s", "ours_s", S), ("diffusers s", "diffusers_s", S), ("ratio ours/diffusers", "ratio", X),
                 ("peak GiB ours", "peak_ours_gib", G), ("peak GiB diffusers", "peak_diffusers_gib", G),
                 ("max rel diff", "rel_err", E), ("note", "note", "{}")],
    "fp8": [("family", "family", "{}"), ("shape", "shape", "{}"), ("first call fp8 s", "first_fp8_s", X),
            ("bf16 s", "bf16_s", S), ("fp8-row s", "fp8_s", S), ("ratio fp8/bf16", "ratio", X),
            ("peak GiB bf16", "peak_bf16_gib", G), ("peak GiB fp8", "peak_fp8_gib", G),
            ("max rel diff fp8 vs bf16", "rel_err", E), ("note", "note", "{}")],
    "sample": [("family (tiny pipeline)", "family", "{}"), ("shape", "shape", "{}"), ("cache", "cache", "`{}`"),
               ("steps computed", "computed", "{}"), ("ours s", "ours_s", X), ("stock s", "stock_s", X),
               ("ratio ours/stock", "ratio", X), ("ours cached s", "ours_cached_s", X),
               ("stock cached s", "stock_cached_s", X), ("ratio ours/stock cached", "ratio_cached", X),
               ("ratio ours cached/uncached", "ratio_cache_speedup", X), ("max rel diff vs stock", "rel_err", E),
               ("cached vs stock cached", "rel_err_cached", E)],
    "serve": [("concurrency", "concurrency", "{}"), ("requests", "requests", "{}"),
              ("batching images/s", "batching_images_s", X), ("p50 s", "p50_s", X), ("p95 s", "p95_s", X),
              ("batching off images/s", "off_images_s", X), ("diffusers images/s", "diffusers_images_s", X),
              ("ratio batching/diffusers", "ratio_diffusers", X), ("ratio batching/off", "ratio_off", X)],
}  # fmt: skip


def progress(row: dict) -> str:
    """One printed line for a row: its name and ratio, or why it has none."""
    name = row.get("family", row.get("concurrency"))
    if "skipped" in row or "error" in row:
        return f"{name}: {'skipped: ' + row['skipped'] if 'skipped' in row else row['error']}"
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.startswith("ratio") and v is not None)
    return f"{name}: {ratios}"


def _cell(row: dict, key: str, spec: str) -> str:
    value = row.get(key)
    return "n/a" if value is None or value == "" else spec.format(value)


def table(name: str, rows: list[dict]) -> list[str]:
    """A section's Markdown table; a row that was skipped or failed says why in its second cell."""
    cols = COLUMNS[name]
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        if "skipped" in row or "error" in row:
            why = f"skipped: {row['skipped']}" if "skipped" in row else f"failed: {row['error']}"
            cells = [str(row.get(cols[0][1])), why] + [""] * (len(cols) - 2)
        else:
            cells = [_cell(row, key, spec) for _, key, spec in cols]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def _section(r: dict) -> list[str]:
    lines = ["", f"## {r['title']}", ""]
    if r["skipped"]:
        return lines + [f"Skipped: {r['skipped']}."]
    model = [f"- model: {r['rows'][0]['model']}"] if r["rows"] and "model" in r["rows"][0] else []
    lines += _NOTES[r["name"]] + model + [""] + table(r["name"], r["rows"])
    if r["stopped"]:
        lines += ["", f"Stopped: {r['stopped']}."]
    return lines


_NOTES = {
    "forward": ["- ours: `fd.apply` on `fd.prepare`d params (fused q/k/v, `kernels=\"auto\"`); diffusers: the module "
                "whose storage our params share (`fd.from_diffusers`); median of alternating rounds; peak = "
                "`torch.cuda.max_memory_allocated` over one call (weights included)"],
    "compiled": ["- `torch.compile(fd.apply, fullgraph=True, dynamic=False)` on the plain params vs "
                 "`torch.compile(module, fullgraph=True, dynamic=False)`; first call = compile + run, in this "
                 "process (inductor's caches as this run left them); a note says where dynamo refused one graph "
                 "and `fullgraph=False` ran instead"],
    "fp8": ["- ours compiled on `fd.quantize(params, \"fp8-row\")` (the default skip list, docs/quantization.md) "
            "vs ours compiled on the same params in the compute dtype; diffusers has no fp8 compute of its own "
            "(its compiled bf16 time is in the table above)"],
    "sample": ["- one `fd.sample(..., output_type=\"latent\")` call and one stock pipeline call each (after a "
               "2-step warm-up), one image, the same seed and weights; cached: ours with `cache=`, the stock "
               "pipeline after `transformer.enable_cache(...)` with diffusers' same cache; steps computed = "
               "steps on which the whole network ran"],
    "serve": ["- the server's engine (`functional_dit.serve`, continuous batching: up to the largest "
              "concurrency per batch; batching off: one image at a time), in-process, no HTTP; N client threads "
              "each send one request after another; diffusers: the stock pipeline making one PIL image a call "
              "(a plain pipeline serves one request at a time), 1 / its median seconds per image"],
}  # fmt: skip


_CPU_NO_COMPILE = (
    "no `torch.compile` (`--compile-backend none`, a CPU run's default: the compiled and fp8 sections run eager in "
    "its place, each row says so; `--compile-backend eager` traces with dynamo, inductor compiles for minutes)"
)


def _what_is_real(p) -> list[str]:
    if not p.gpu:
        return [
            "- **CPU run**: the same sections on the tiny presets (`fd.PRESETS[...-tiny]`), fp32, "
            f"{p.hw[0] * p.hw[1]} image + {p.txt_len} text tokens, {p.size}² images, {p.steps} steps; "
            + (
                _CPU_NO_COMPILE
                if p.backend is None
                else f"`torch.compile` with the `{p.backend}` backend on {', '.join(p.compiled)} only"
            )
            + "; the figures show that the command works, not a GPU's speed",
        ]
    return [
        "- **real**: the transformers' released shapes (width, heads x head dim, MLP, RoPE, in/out channels) "
        "from `fd.PRESETS`, bf16, 4096 image + 512 text tokens (a 1024² image); random weights (diffusers' "
        "default init, seeded; nothing downloaded), the same storage on both sides (`fd.from_diffusers`), every "
        "weight in bf16 (the modules diffusers would keep in fp32 on loading, FLUX.3's q/k norms, too)",
        "- **reduced**: the depth (blocks below, against the released model's); a released FLUX.2-dev (32 B) "
        "or Qwen-Image (20 B) forward does not fit an 80 GB card with diffusers alongside, and depth multiplies "
        "every time alike (docs/benchmarks-released-depth.md)",
        "- **tiny**: in the sample and serve sections, the tokenizers, text encoders, VAE and scheduler are the "
        "offline tiny ones (`functional_dit.tiny`) and the transformer's text and latent widths are theirs (so "
        "its embedders and final layer are small): what is timed is the transformer loop at the released width "
        "and heads; the images are noise",
    ]


def _depths(p) -> list[str]:
    out = []
    for key, config in p.configs.items():
        name = _product(key).RELEASED
        out.append(f"{key}: `{name}` at {_blocks(config)} blocks (released {_blocks(_api.PRESETS[name])})")
    return out


def _blocks(config) -> str:
    return "+".join(str(getattr(config, k)) for k in ("num_layers", "num_single_layers") if hasattr(config, k))


def header(p, command: str, started, elapsed: float) -> list[str]:
    lines = [
        "# GPU suite: `bench --suite gpu`",
        "",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; wall time {elapsed:.0f} s (start-up included), budget {p.budget:.0f} s",
        f"- machine: {machine()}",
        f"- command: `{command}`",
        f"- device {p.device}, dtype {str(p.dtype).removeprefix('torch.')}, batch 1, median of {p.runs} "
        f"alternating rounds per forward figure",
    ]
    lines += _what_is_real(p)
    if p.gpu:
        lines.append("- depth: " + "; ".join(_depths(p)))
    return lines


def _memory(results: list[dict]) -> list[str]:
    lines = ["", "## Peak memory and time per section", ""]
    lines += ["| section | seconds | peak GiB (`torch.cuda.max_memory_allocated`) | status |", "|---|---|---|---|"]
    for r in results:
        status = f"skipped: {r['skipped']}" if r["skipped"] else (r["stopped"] or "ran")
        peak = "n/a (no CUDA)" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['name']} | {r['seconds']:.1f} | {peak} | {status} |")
    return lines


def _figures(results: list[dict]) -> list[str]:
    def short(v):
        return float(f"{v:.4g}") if isinstance(v, float) else v

    lines = ["", "Every figure:", "", "```"]
    for r in results:
        lines += [f"{r['name']}: { ({k: short(v) for k, v in row.items()}) }" for row in r["rows"]]
    return lines + ["```"]


def markdown(p, results: list[dict], command: str, started, elapsed: float) -> str:
    lines = header(p, command, started, elapsed)
    for r in results:
        lines += _section(r)
    lines += _memory(results) + _figures(results)
    return "\n".join(lines) + "\n"
