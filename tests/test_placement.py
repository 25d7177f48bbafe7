"""Text encoder placements and tiled VAE decoding in `fd.sample` (`functional_dit.pipelines.placement`).

One spawn of 2 gloo ranks (tp=2) runs the tiny FLUX.1 (CLIP + T5), FLUX.2-dev (Mistral3),
FLUX.2-klein (Qwen3) and Qwen-Image (Qwen2.5-VL) pipelines with every placement and
checks them against one process with whole encoders; the fully sharded tests add
FLUX.3's and Qwen-Image 2.1's Qwen3-VL encoders ("shard", then "fsdp", on tp=2, fsdp=2 and
tp=2 x fsdp=2); the tiled VAE is checked against the stock pipeline with
``vae.enable_tiling()``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from _dist import spawn
from PIL import Image
from test_sample import FP32

import functional_dit as fd
import sharding
from functional_dit import tiny
from functional_dit.pipelines import placement as _placement
from functional_dit.pipelines import tiny_parts

# FLUX.2's Mistral system prompt and Qwen-Image's template need >= 256 tokens (functional_dit.tiny)
KINDS = {"flux": 64, "flux2": 256, "flux2-klein": 64, "qwen-image": 256}
PROMPTS = ["a red cube", "a small green sphere"]
KW = dict(height=32, width=32, steps=2, seed=3, output_type="latent")
ORDER = ("replicate", "cpu", "offload", "shard")  # "shard" last: it splits the encoders in place
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _param_bytes(module) -> int:
    """Live storage behind the parameters on this rank (`sharding.live_bytes`: a DTensor's
    local shard; each unique storage once, so tied weights once and a shard that kept a view
    of the whole weight counts whole)."""
    return sharding.live_bytes(dict(module.named_parameters()))


def _single(kind, **kw):
    pipe = tiny.pipeline(kind)
    return fd.sample(fd.from_diffusers(pipe.transformer), pipe, PROMPTS, max_sequence_length=KINDS[kind], **KW, **kw)


def _kind_on_ranks(kind, mesh) -> dict:
    pipe = tiny.pipeline(kind)
    params = fd.from_diffusers(pipe.transformer)
    pipe.transformer = None
    sharded = sharding.shard_params(params, mesh)
    kw = dict(max_sequence_length=KINDS[kind], **KW)
    out = {p: fd.sample(sharded, pipe, PROMPTS, encoder_placement=p, **kw) for p in ORDER}
    out["again"] = fd.sample(sharded, pipe, PROMPTS, **kw)  # sharded encoders stay sharded
    try:
        fd.sample(sharded, pipe, PROMPTS, encoder_placement="cpu", **kw)
        out["cpu after shard"] = "no error"
    except ValueError as e:
        out["cpu after shard"] = str(e)
    fresh = tiny.components(kind)
    out["bytes"] = {n: _param_bytes(m) for n, m in _placement.encoders(pipe).items()}
    out["predicted"] = {n: _placement.bytes_per_rank(fresh[n], 2) for n in out["bytes"]}
    out["full"] = {n: _placement.bytes_per_rank(fresh[n], 1) for n in out["bytes"]}
    # "fsdp" on top: what tp left whole fully sharded over the tp group, gathered per layer
    out["fsdp"] = fd.sample(sharded, pipe, PROMPTS, encoder_placement="fsdp", **kw)
    out["fsdp bytes"] = {n: _param_bytes(m) for n, m in _placement.encoders(pipe).items()}
    out["fsdp predicted"] = {n: _placement.bytes_per_rank(fresh[n], 2, 1, "fsdp") for n in out["bytes"]}
    return out


def _qwen3_tied():
    """A Qwen3 text encoder whose vocabulary, KV heads and tied head all split 2 ways (the
    tiny pipelines' 265-token vocabularies and single KV heads do not)."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=266, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    return tiny_parts.seeded(0, lambda: transformers.Qwen3ForCausalLM(cfg)).eval()


def _hidden(model) -> torch.Tensor:
    ids = torch.arange(2, 26).view(2, 12)
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def _ranks(rank, world):
    mesh = sharding.make_mesh(tp=world, device_type="cpu")
    out = {kind: _kind_on_ranks(kind, mesh) for kind in KINDS}
    model = _qwen3_tied()
    _placement.shard(model, mesh["tp"])
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    out["qwen3"] = dict(hidden=_hidden(model), tied=tied, bytes=_param_bytes(model))
    return out


def test_placements_on_two_ranks_equal_one_process():
    """tp=2: every placement gives the single-process latents (1e-5: sharded encoders
    and transformer reduce in another order), bitwise the same on both ranks; replicate,
    cpu and offload are bitwise one another (the same kernels on the CPU); the sharded
    encoders hold the predicted bytes (the memory table's count) and stay sharded; "fsdp"
    after them (the rest fully sharded over tp) holds its predicted bytes, fewer again."""
    ranks = spawn(_ranks, 2, timeout=500)
    for kind in KINDS:
        single = _single(kind)
        a, b = ranks[0][kind], ranks[1][kind]
        assert a["fsdp bytes"] == a["fsdp predicted"] == b["fsdp bytes"], kind
        assert sum(a["fsdp bytes"].values()) < sum(a["bytes"].values()), kind
        for p in (*ORDER, "again", "fsdp"):
            assert torch.equal(a[p], b[p]), (kind, p)  # every rank returns the same latents
            torch.testing.assert_close(a[p], single, **FP32)
        assert torch.equal(a["cpu"], a["replicate"]) and torch.equal(a["offload"], a["replicate"])
        assert torch.equal(a["again"], a["shard"])
        assert a["cpu after shard"].startswith("encoder_placement: ['text_encoder"), a["cpu after shard"]
        assert a["bytes"] == a["predicted"] == b["bytes"], kind
        assert sum(a["bytes"].values()) < sum(a["full"].values()), kind  # odd tiny vocabularies stay whole
    # split KV heads, vocabulary-parallel embedding, column-parallel head re-tied to it
    torch.testing.assert_close(ranks[0]["qwen3"]["hidden"], _hidden(_qwen3_tied()), **FP32)
    assert torch.equal(ranks[0]["qwen3"]["hidden"], ranks[1]["qwen3"]["hidden"])
    assert ranks[0]["qwen3"]["tied"] and ranks[0]["qwen3"]["bytes"] == _placement.bytes_per_rank(_qwen3_tied(), 2)
    whole = 4 * (2 * (16 + 16 + 8 + 8) + 16)  # only the norms stay whole: 2 layers x (2 x 16 + q/k 2 x 8) + 16, fp32
    assert 2 * _placement.bytes_per_rank(_qwen3_tied(), 2) - _placement.bytes_per_rank(_qwen3_tied(), 1) == whole


def test_single_process_placements_and_bad_arguments():
    """One process: "shard" without a tp mesh and "cpu"/"offload" give the replicate latents
    bitwise; bad placements and tiling flags are one ValueError naming the argument."""
    pipe = tiny.pipeline("flux2-klein")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(max_sequence_length=64, **KW)
    want = fd.sample(params, pipe, PROMPTS, **kw)
    for p in ("shard", "cpu", "offload"):
        assert torch.equal(fd.sample(params, pipe, PROMPTS, encoder_placement=p, **kw), want), p
    with pytest.raises(ValueError, match=r"encoder_placement: expected one of \['replicate', 'shard'.*got 'gpu'"):
        fd.sample(params, pipe, PROMPTS, encoder_placement="gpu", **kw)
    with pytest.raises(ValueError, match="vae_tiling: expected True or False, got 'yes'"):
        fd.sample(params, pipe, PROMPTS, vae_tiling="yes", **kw)
    with pytest.raises(ValueError, match="placement: expected 'shard' or 'fsdp', got 'cpu'"):
        _placement.bytes_per_rank(pipe.text_encoder, 2, 1, "cpu")


def test_vae_tiling_equals_stock_tiled_vae():
    """64x64 on the tiny FLUX.1 VAE (tiles of 32 px): ``vae_tiling=True`` gives the stock
    pipeline's image with ``vae.enable_tiling()`` (1e-5 as the latents), differs from the
    untiled decode (the tiles are blended), and leaves the VAE untiled afterwards."""
    pipe = tiny.pipeline("flux")
    params = fd.from_diffusers(pipe.transformer)
    kw = dict(height=64, width=64, steps=2, max_sequence_length=64, output_type="np")
    ours = fd.sample(params, pipe, "a red cube", seed=5, vae_tiling=True, **kw)
    assert not pipe.vae.use_tiling
    plain = fd.sample(params, pipe, "a red cube", seed=5, **kw)
    pipe.vae.enable_tiling()
    stock = pipe(
        prompt="a red cube", height=64, width=64, num_inference_steps=2, max_sequence_length=64,
        generator=torch.Generator().manual_seed(5), output_type="np",
    ).images  # fmt: skip
    np.testing.assert_allclose(ours, stock, **FP32)
    assert np.abs(ours - plain).max() > 1e-4


# ----------------------------------------------------------------------------- generate, memory table


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    """A tiny FluxPipeline saved as a diffusers folder, and its stock image (seed 3)."""
    folder = str(tmp_path_factory.mktemp("tiny_flux"))
    pipe = tiny.pipeline("flux")
    pipe.save_pretrained(folder)
    stock = pipe("a cube", height=32, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(3))
    return folder, np.asarray(stock.images[0])


GEN = ["--prompt", "a cube", "--height", "32", "--width", "48", "--steps", "2", "--seed", "3"]


def test_generate_encoders_cpu_and_shard_under_torchrun_write_the_stock_image(flux_folder, tmp_path):
    """``generate --encoders cpu`` and ``fsdp`` (one process) write the stock image bitwise (the same CPU kernels);
    ``--encoders shard --tp 2`` under torchrun within one level of 255 (the sharded encoders
    and transformer reduce in another order, which may round a pixel the other way)."""
    from functional_dit.__main__ import main

    folder, stock = flux_folder
    for p in ("cpu", "fsdp"):  # fsdp on one process: nothing to split over, whole beside the transformer
        assert main(["generate", "--model", folder, *GEN, "--encoders", p, "--out", str(tmp_path / f"{p}.png")]) == 0
        assert np.array_equal(np.asarray(Image.open(tmp_path / f"{p}.png")), stock), p
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    cmd += ["functional_dit", "generate", "--model", folder, *GEN, "--tp", "2", "--encoders", "shard"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*cmd, "--out", "shard.png"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.asarray(Image.open(tmp_path / "shard.png")).astype(int)
    assert np.abs(got - stock).max() <= 1


def test_memory_table_pipelines_last_line_is_the_worst_ratio():
    """``examples/memory_table.py --pipelines``: 4 placements x 5 released pipelines at tp =
    1..8, the ratios at tp=8 for "shard" and "fsdp", then 3 world sizes x 5 pipelines spent
    as tp, fsdp and tp x fsdp, and, last, the worst ratios. With "shard" Qwen-Image misses
    the 1.15 target (Qwen2.5-VL-7B's 28 heads do not split 8 ways, so its attention stays
    whole, `_placement.plan`); with "fsdp" (what tp leaves whole fully sharded) every
    pipeline meets it at tp=8 and on every mesh of 8 ranks, tp x fsdp within 2 %."""
    script = os.path.join(ROOT, "examples", "memory_table.py")
    out = subprocess.run([sys.executable, script, "--pipelines"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 + 20 + 2 + 1 + 15 + 2
    ratios = {
        p: dict(re.findall(r"([\w.-]+) ([\d.]+)", lines[21 + i].split(":", 1)[1]))
        for i, p in enumerate(("shard", "fsdp"))
    }
    assert all(len(r) == 5 for r in ratios.values())
    worst = re.fullmatch(r"worst pipeline ratio at tp=8: shard ([\d.]+), fsdp ([\d.]+)", lines[-1])
    assert worst and [float(w) for w in worst.groups()] == [max(map(float, ratios[p].values())) for p in ratios]
    assert all(
        float(ratios["shard"][k]) <= 1.15 for k in ("flux1-dev", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b")
    )
    assert float(ratios["shard"]["qwen-image"]) > 1.15 >= float(worst[2])
    on8 = dict(re.findall(r"((?:tp|fsdp)=\d(?: x fsdp=\d)?) ([\d.]+)", lines[-2]))
    assert sorted(on8) == ["fsdp=8", "tp=2 x fsdp=4", "tp=4 x fsdp=2", "tp=8"] and max(map(float, on8.values())) <= 1.15
    # what tp leaves whole is split over all tp x fsdp ranks (1.012 measured; over fsdp alone it was 1.071)
    assert float(on8["tp=4 x fsdp=2"]) < 1.02 and float(on8["tp=2 x fsdp=4"]) < 1.02, on8
    assert all(re.search(r"\| fsdp=\d:\s+\d", line) for line in lines[24:39])  # an fsdp cell on every row


def test_decoder_plans_are_transformers_base_model_tp_plan():
    """Where tp divides every size, the Mistral / Qwen3 / Qwen2.5-VL plan splits exactly the
    layers transformers' own ``base_model_tp_plan`` splits, the same way (its replicated
    entries stay whole), plus the vocabulary-parallel embedding and the LM head."""
    import transformers

    model = _qwen3_tied()
    for cfg in (transformers.MistralConfig, transformers.Qwen3Config, transformers.Qwen2_5_VLTextConfig):
        split = {k: v for k, v in cfg.base_model_tp_plan.items() if v in ("colwise", "rowwise")}
        want = {f"model.{k.replace('*', str(i))}": v for k, v in split.items() for i in range(2)}
        got = _placement.plan(model, 2)
        assert got == want | {"model.embed_tokens": "vocab", "lm_head": "colwise"}, cfg.__name__


def test_qwen3vl_plan_is_qwen3s_on_its_language_model():
    """FLUX.3's and Qwen-Image 2.1's Qwen3-VL: its decoder layers take Qwen3's plan (q and o
    split, the one KV head kept whole by every rank, the MLP split; the tiny 265-token
    vocabulary stays whole), its vision tower none; an encoder class with no plan is one
    ValueError naming it and the placements that work."""
    import transformers

    split = {k: v for k, v in transformers.Qwen3Config.base_model_tp_plan.items() if v in ("colwise", "rowwise")}
    one_kv = {k: v for k, v in split.items() if not k.endswith(("k_proj", "v_proj"))}
    want = {f"model.language_model.{k.replace('*', str(i))}": v for k, v in one_kv.items() for i in range(2)}
    for kind in ("flux3", "qwen-image-2.1"):
        assert _placement.plan(tiny.components(kind)["text_encoder"], 2) == want, kind
    with pytest.raises(ValueError, match="encoder_placement: no tensor-parallel plan for a GPT2Model text encoder"):
        _placement.plan(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)), 2)


# ----------------------------------------------------------------------------- fully sharded encoders

# the edit pipelines' prompts carry an image: the vision tower runs (Qwen-Image 2.1's Qwen3-VL
# adds its deepstack features to the first decoder layers); FLUX.3 encodes one prompt per call
FSDP_KINDS = {"qwen-image-edit": 256, "flux": 64, "qwen-image-2.1": None, "flux3": None}
IMAGE_KINDS = ("qwen-image-edit", "qwen-image-2.1")


def _embeds(pipe, kind) -> list[torch.Tensor]:
    """The prompt embeddings the pipeline's encoder gives (T5 and pooled CLIP; Qwen2.5-VL's
    and Qwen-Image 2.1's Qwen3-VL's of the prompts with an image each, and their mask;
    FLUX.3's stacked Qwen3-VL layers, a prompt at a time as `fd.sample` encodes them)."""
    if kind == "flux3":
        from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

        embed, te, tok = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds, pipe.text_encoder, pipe.tokenizer
        with torch.no_grad():
            return [embed(te, tok, p, hidden_states_layers=tiny.FLUX3_LAYERS) for p in PROMPTS]
    kw = {} if FSDP_KINDS[kind] is None else {"max_sequence_length": FSDP_KINDS[kind]}
    if kind in IMAGE_KINDS:
        kw["image"] = [Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)) for i in (1, 2)]
    with torch.no_grad():
        out = pipe.encode_prompt(PROMPTS, device="cpu", **kw)
    return [t for t in out if t is not None][:2]


def _embeds_one_by_one(pipe, kind) -> list[torch.Tensor]:
    """`_embeds` with each layer gathered only when it starts (no prefetch)."""
    with sharding.fsdp_options(prefetch=False):
        return _embeds(pipe, kind)


def _whole(module) -> dict:
    """Every parameter of ``module`` whole (``full_tensor()`` of the DTensor ones: a collective each)."""
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in module.named_parameters()}


def _fsdp_ranks(rank, world, meshes=None):
    """Per mesh and kind: the embeddings and live bytes with the encoders placed "shard"
    (tp's split; whole on a mesh without tp), then "fsdp" on top, and the predicted bytes."""
    out = {}
    for mesh_kw, sizes in meshes or (({"tp": world}, (world, 1)), ({"fsdp": world}, (1, world))):
        mesh = sharding.make_mesh(**mesh_kw, device_type="cpu")
        for kind in FSDP_KINDS:
            pipe = tiny.pipeline(kind)
            mods = _placement.encoders(pipe)
            with _placement.placed(pipe, "shard", mesh, "cpu"):
                shard = dict(embeds=_embeds(pipe, kind), bytes={n: _param_bytes(m) for n, m in mods.items()})
            with _placement.placed(pipe, "fsdp", mesh, "cpu"):
                first = _embeds(pipe, kind)
            fresh = tiny.components(kind)
            out[(kind, sizes)] = dict(
                shard=shard,
                shard_predicted={n: _placement.bytes_per_rank(fresh[n], sizes[0]) for n in mods},
                embeds=first,
                again=_embeds_one_by_one(pipe, kind),  # the shards stay, gathered afresh per call
                bytes={n: _param_bytes(m) for n, m in mods.items()},
                predicted={n: _placement.bytes_per_rank(fresh[n], *sizes, "fsdp") for n in mods},
                whole=[_whole(m) for m in mods.values()],
            )
    return out


@pytest.mark.slow
def test_fsdp_encoders_on_two_ranks_equal_one_process():
    """``encoder_placement="shard"``, then ``"fsdp"``, on 2 gloo ranks, the tiny
    Qwen-Image-Edit (Qwen2.5-VL: its single KV head and odd vocabulary stay whole under tp,
    its vision tower too, which the prompts' images run), FLUX.1 (CLIP + T5), Qwen-Image 2.1
    and FLUX.3 (Qwen3-VL; Qwen-Image 2.1's prompts with images, so its vision tower and
    deepstack features run) encoders: "shard" splits over tp (nothing on an fsdp-only
    mesh); then "fsdp": on a tp=2 mesh what tp leaves whole is fully sharded over the tp
    group, on an fsdp=2 mesh everything over fsdp; each layer gathered just before it runs.
    The prompt embeddings equal one process (fp32 1e-5: tp's row-parallel layers sum in
    another order; fsdp alone gathers the same weights), on both ranks alike and on a
    second call without prefetch; the live bytes per rank (the shards' storages, every
    layer released after it ran; `sharding.live_bytes`) equal the count the memory table
    uses, for "shard" and "fsdp"; every parameter's
    ``full_tensor()`` is the original weight. (tp=2 x fsdp=2: the next test, 4 ranks.)"""
    _check_fsdp_ranks(spawn(_fsdp_ranks, 2, timeout=300), 0.55)


@pytest.mark.slow
def test_fsdp_encoders_on_tp2_fsdp2_split_what_tp_leaves_whole_over_all_four_ranks():
    """tp=2 x fsdp=2 (4 gloo ranks): what tp splits is split further over fsdp, what tp leaves
    whole (the tiny Qwen2.5-VL's single KV head, odd vocabulary and vision tower; CLIP's and
    T5's norms) over all four ranks of the fsdp x tp plane (one flattened group, fsdp-major,
    placed ``[Shard(d), Shard(d)]`` on the mesh's (fsdp, tp) dims). As the 2-rank test: the
    embeddings equal one process, live bytes = the memory table's count, ``full_tensor()`` =
    the weight; each rank holds near a quarter of every encoder."""
    _check_fsdp_ranks(spawn(_fsdp_ranks, 4, (({"tp": 2, "fsdp": 2}, (2, 2)),), timeout=600), 0.3)


def _check_fsdp_ranks(ranks, share: float) -> None:
    """Every rank's `_fsdp_ranks` against one process; each holds under ``share`` of each
    encoder's bytes."""
    for (kind, sizes), a in ranks[0].items():
        b = ranks[-1][(kind, sizes)]
        single = tiny.pipeline(kind)
        want = _embeds(single, kind)
        for got in (a["shard"]["embeds"], a["embeds"], a["again"], b["embeds"]):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, **FP32)
        assert a["bytes"] == a["predicted"] == b["bytes"], (kind, sizes)
        assert a["shard"]["bytes"] == a["shard_predicted"] == b["shard"]["bytes"], (kind, sizes)
        whole = {n: _placement.bytes_per_rank(m, 1) for n, m in _placement.encoders(single).items()}
        for n, got in a["bytes"].items():  # near 1/ranks of the whole: only 1-D leaves with no even dim stay
            assert got < share * whole[n], (kind, sizes, n, got, whole[n])
        for got, m in zip(a["whole"], _placement.encoders(single).values()):
            for n, p in m.named_parameters():
                assert torch.equal(got[n], p.detach()), (kind, sizes, n)
