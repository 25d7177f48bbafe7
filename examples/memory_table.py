"""Per-rank parameter memory (bf16, GB = 1e9 bytes) of every released preset at tensor
parallelism 1, 2, 4 and 8, measured as live storage: the params are made on the meta device
(`fd.init(config, device="meta")`: shapes, no data), a rank's local shards are cut by the
code `sharding.shard_params` runs (`sharding.local_shards`, the default plan: attention
heads, MLPs and the AdaLN modulation split over tp), and `sharding.live_bytes` sums the
``untyped_storage().nbytes()`` of the unique storages they hold (a shard that were a view
into a larger buffer would count the whole buffer). Every rank holds the same shapes (the
plan splits evenly), so rank 0 is measured. The ideal (all parameters / tp) beside each
figure. No weights, no processes.

``--pipelines``: the whole pipeline per rank (transformer + text encoders + VAE) for each
``fd.sample(..., encoder_placement=...)`` choice at tp = 1, 2, 4, 8, then on 2, 4 and 8
ranks spent as tp, fsdp and tp x fsdp (the transformer's live storage as above, fully
sharded by its plan; the encoders placed ``"fsdp"``); the encoders and VAEs are built on the
meta device from their published configs (docs/pipelines-across-ranks.md cites them) and
counted with the plans `functional_dit.pipelines.placement.shard` and ``fully_shard``
apply (``placement.bytes_per_rank``, which tests/test_placement.py checks against the live
shards' storage on the tiny pipelines).

``--fsdp``: the transformer's live storage per rank on 2, 4 and 8 ranks spent as tp, fsdp
(fully sharded parameters, gathered per block), tp x fsdp, tp x sp (Ulysses) and ring
(params whole: the sequence axes split activations only), with the ideal (all parameters /
ranks); last, whether every cell equals the plan's count (`sharding.bytes_per_rank`).

    python examples/memory_table.py [--pipelines | --fsdp]
"""

from __future__ import annotations

import functools
import sys

import torch

import functional_dit as fd
import sharding

DEGREES = (1, 2, 4, 8)


@functools.cache
def _meta(config) -> fd.Params:
    return fd.init(config, dtype=torch.bfloat16, device="meta")


def live_bytes(config, mesh: dict) -> int | None:
    """Bytes of storage rank 0 of ``mesh`` (``{axis: size}``) holds with the params of
    ``config`` sharded by the default plan (bf16, measured on the meta device); None when
    the plan refuses the mesh (e.g. heads not divisible by tp)."""
    try:
        plan = sharding.plan(config, mesh)
    except ValueError:
        return None
    coords = {axis: (0, n) for axis, n in mesh.items()}
    return sharding.live_bytes(sharding.local_shards(_meta(config), coords, plan))


def cells(config) -> list[tuple[float | None, float]]:
    """(GB per rank or None when tp does not divide the heads, ideal GB) per degree."""
    total = fd.num_params(config) * torch.bfloat16.itemsize / 1e9
    out = []
    for tp in DEGREES:
        got = live_bytes(config, {"tp": tp})
        out.append((None if got is None else got / 1e9, total / tp))
    return out


def row(name: str, config) -> str:
    text = [f"{'n/a':>15}" if got is None else f"{got:7.2f} ({ideal:5.2f})" for got, ideal in cells(config)]
    return f"{name:<22}{fd.num_params(config) / 1e9:>8.2f}B " + " ".join(text)


# ---------------------------------------------------------------- whole pipelines

# Published configs (config.json of each pipeline's text_encoder*/ and vae/ folders).
_T5_XXL = dict(
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    vocab_size=32128,
    feed_forward_proj="gated-gelu",
    relative_attention_num_buckets=32,
)  # google/t5-v1_1-xxl
_CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    vocab_size=49408,
    max_position_embeddings=77,
    projection_dim=768,
)  # openai/clip-vit-large-patch14
_MISTRAL_SMALL_3 = dict(  # mistralai/Mistral-Small-3.2-24B-Instruct-2506 (FLUX.2-dev's text_encoder)
    text=dict(
        hidden_size=5120,
        intermediate_size=32768,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
    ),
    vision=dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        patch_size=14,
        image_size=1540,
        head_dim=64,
    ),
)
_QWEN3 = {  # Qwen/Qwen3-4B (klein 4B, tied embeddings), Qwen/Qwen3-8B (klein 9B)
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}
_QWEN25_VL_7B = dict(  # Qwen/Qwen2.5-VL-7B-Instruct (Qwen-Image's text_encoder)
    text=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    vision=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
)


def _encoders(name: str) -> list:
    """The pipeline's text encoders on the meta device, bf16."""
    import transformers as tf

    if name == "flux1-dev":
        return [tf.CLIPTextModel(tf.CLIPTextConfig(**_CLIP_L)), tf.T5EncoderModel(tf.T5Config(**_T5_XXL))]
    if name == "flux2-dev":
        m = _MISTRAL_SMALL_3
        cfg = tf.Mistral3Config(text_config=tf.MistralConfig(**m["text"]), vision_config=m["vision"])
        cfg.tie_word_embeddings = False
        return [tf.Mistral3ForConditionalGeneration(cfg)]
    if name.startswith("flux2-klein"):
        return [tf.Qwen3ForCausalLM(tf.Qwen3Config(**_QWEN3["4b" if name.endswith("4b") else "8b"]))]
    cfg = tf.Qwen2_5_VLConfig(text_config=_QWEN25_VL_7B["text"], vision_config=_QWEN25_VL_7B["vision"])
    return [tf.Qwen2_5_VLForConditionalGeneration(cfg)]


def _vae(name: str):
    """The pipeline's VAE (diffusers' defaults are the released configs)."""
    import diffusers

    if name == "flux1-dev":
        blocks = dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
        return diffusers.AutoencoderKL(
            block_out_channels=(128, 256, 512, 512), latent_channels=16, layers_per_block=2, **blocks,
            use_quant_conv=False, use_post_quant_conv=False,
        )  # fmt: skip
    if name.startswith("flux2"):
        return diffusers.AutoencoderKLFlux2()
    return diffusers.AutoencoderKLQwenImage()


PIPELINES = ("flux1-dev", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "qwen-image")


FSDP_MESHES = {  # ranks -> the ways to spend them
    2: [{"tp": 2}, {"fsdp": 2}],
    4: [{"tp": 4}, {"fsdp": 4}, {"tp": 2, "fsdp": 2}],
    8: [{"tp": 8}, {"fsdp": 8}, {"tp": 2, "fsdp": 4}, {"tp": 4, "fsdp": 2}],
}
_MESHES = [tuple(m.items()) for meshes in FSDP_MESHES.values() for m in meshes]


def _label(mesh: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def pipeline_bytes(name: str) -> dict:
    """Bytes per rank, bf16: {"transformer": {mesh: bytes}, "shard": {tp: encoder bytes
    sharded}, "fsdp": {mesh: encoder bytes fully sharded}, "full": encoder bytes whole,
    "vae": bytes}; a mesh is a tuple of (axis, size) pairs (`_MESHES`, and tp alone)."""
    from functional_dit.pipelines import placement as _placement

    with torch.device("meta"):
        encoders, vae = [m.to(torch.bfloat16) for m in _encoders(name)], _vae(name)
    config = fd.PRESETS[name]
    meshes = [(("tp", tp),) for tp in DEGREES] + [m for m in _MESHES if dict(m).get("fsdp", 1) > 1]

    def fsdp(mesh):
        tp, n = dict(mesh).get("tp", 1), dict(mesh).get("fsdp", 1)
        return sum(_placement.bytes_per_rank(m, tp, n, "fsdp") for m in encoders)

    return {
        "transformer": {m: live_bytes(config, dict(m)) for m in meshes},
        "shard": {tp: sum(_placement.bytes_per_rank(m, tp) for m in encoders) for tp in DEGREES},
        "fsdp": {m: fsdp(m) for m in meshes},
        "full": sum(_placement.bytes_per_rank(m, 1) for m in encoders),
        "vae": sum(p.numel() for p in vae.parameters()) * torch.bfloat16.itemsize,
    }


def pipeline_rows(name: str, b: dict) -> tuple[list[str], dict]:
    """The tp table's rows of one pipeline (``b``: its `pipeline_bytes`) and its ratios at
    tp=8 (per rank / the ideal) with the encoders placed "shard" and "fsdp"."""
    T, E, V = {tp: b["transformer"][(("tp", tp),)] for tp in DEGREES}, b["full"], b["vae"]
    ideal = {tp: (T[1] + E) / tp + V for tp in DEGREES}
    per = {
        "shard": {tp: T[tp] + b["shard"][tp] + V for tp in DEGREES},
        "fsdp": {tp: T[tp] + b["fsdp"][(("tp", tp),)] + V for tp in DEGREES},
        "replicate": {tp: T[tp] + E + V for tp in DEGREES},
        "cpu / offload": {tp: T[tp] + V for tp in DEGREES},
    }
    rows = []
    for placement, got in per.items():
        cells = " ".join(f"{got[tp] / 1e9:7.2f} ({ideal[tp] / 1e9:5.2f})" for tp in DEGREES)
        rows.append(f"{name:<16}{placement:<15}{cells}")
    return rows, {p: per[p][8] / ideal[8] for p in ("shard", "fsdp")}


def pipeline_fsdp_rows(name: str, b: dict) -> tuple[list[str], dict]:
    """One line per world size of `FSDP_MESHES`: GB per rank of the whole pipeline with the
    transformer on each mesh and the encoders placed "fsdp", and the ideal; and the ratios
    to the ideal on 8 ranks, by mesh label."""
    lines, ratios = [], {}
    for n, meshes in FSDP_MESHES.items():
        ideal = (b["transformer"][(("tp", 1),)] + b["full"]) / n + b["vae"]
        cells = []
        for mesh in meshes:
            key = tuple(mesh.items())
            t = b["transformer"][key]
            got = None if t is None else t + b["fsdp"][key] + b["vae"]
            cells.append(f"{_label(mesh)}: " + (f"{'n/a':>6}" if got is None else f"{got / 1e9:6.2f}"))
            if n == 8 and got is not None:
                ratios[_label(mesh)] = got / ideal
        lines.append(f"{name:<16}{n} ranks, ideal {ideal / 1e9:6.2f} | " + " | ".join(cells))
    return lines, ratios


def pipelines_main() -> None:
    head = " ".join(f"{f'tp={tp} (ideal)':>15}" for tp in DEGREES)
    print(f"{'pipeline':<16}{'encoders':<15}{head}   (GB per rank, bf16: transformer + text encoders + VAE)")
    found = {name: pipeline_bytes(name) for name in PIPELINES}
    ratios, more, lines = {}, {}, []
    for name, b in found.items():
        rows, ratios[name] = pipeline_rows(name, b)
        print("\n".join(rows))
        rows, more[name] = pipeline_fsdp_rows(name, b)
        lines += rows
    for p in ("shard", "fsdp"):
        print(f"ratios at tp=8, encoders {p}: " + ", ".join(f"{k} {v[p]:.3f}" for k, v in ratios.items()))
    print("pipeline per rank (GB, bf16) on N ranks spent as tp, fsdp and tp x fsdp; encoders placed 'fsdp'")
    print("\n".join(lines))
    worst = {label: max(r[label] for r in more.values()) for label in more[PIPELINES[0]]}
    print("worst ratio on 8 ranks, encoders fsdp: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
    print(
        "worst pipeline ratio at tp=8: "
        + ", ".join(f"{p} {max(r[p] for r in ratios.values()):.3f}" for p in ratios[PIPELINES[0]])
    )


TRANSFORMER_MESHES = {  # ranks -> the ways to spend them, the sequence axes too
    2: [{"tp": 2}, {"fsdp": 2}, {"ring": 2}],
    4: [{"tp": 4}, {"fsdp": 4}, {"tp": 2, "fsdp": 2}, {"tp": 2, "sp": 2}, {"ring": 4}],
    8: [{"tp": 8}, {"fsdp": 8}, {"tp": 2, "fsdp": 4}, {"tp": 4, "fsdp": 2}, {"tp": 4, "sp": 2}, {"ring": 8}],
}


def fsdp_rows(name: str, config) -> tuple[list[str], list[str]]:
    """One line per world size: GB per rank (live storage) for each mesh of
    `TRANSFORMER_MESHES`, and the ideal; and the cells whose live storage is not the plan's
    count (`sharding.bytes_per_rank`)."""
    total = fd.num_params(config) * torch.bfloat16.itemsize / 1e9
    lines, off = [], []
    for n, meshes in TRANSFORMER_MESHES.items():
        cells = []
        for mesh in meshes:
            got = live_bytes(config, mesh)
            if got is not None and got != sharding.bytes_per_rank(config, None, mesh, torch.bfloat16):
                off.append(f"{name} {_label(mesh)}")
            cells.append(f"{_label(mesh)}: " + (f"{'n/a':>7}" if got is None else f"{got / 1e9:7.2f}"))
        lines.append(f"{name:<22}{n} ranks, ideal {total / n:6.2f} | " + " | ".join(cells))
    return lines, off


def fsdp_main() -> None:
    print("transformer parameter GB per rank (bf16, live storage), tp, fsdp, tp x fsdp, tp x sp, ring")
    off = []
    for name, config in fd.PRESETS.items():
        if not name.endswith("-tiny"):
            lines, bad = fsdp_rows(name, config)
            print("\n".join(lines))
            off += bad
    print("live storage = the plan's count in every cell" if not off else f"live storage above the plan's: {off}")


def main() -> None:
    if "--pipelines" in sys.argv[1:]:
        return pipelines_main()
    if "--fsdp" in sys.argv[1:]:
        return fsdp_main()
    released = {k: v for k, v in fd.PRESETS.items() if not k.endswith("-tiny")}
    head = " ".join(f"{f'tp={tp} (ideal)':>15}" for tp in DEGREES)
    print(f"{'preset':<22}{'params':>9} {head}   (GB per rank, bf16, live storage)")
    for name, config in released.items():
        print(row(name, config))


if __name__ == "__main__":
    main()
