"""The trainer's captions (`functional_dit.train`): from same-name ``.txt`` files or a
``metadata.jsonl`` (``file_name``, ``text``: the diffusers / datasets image-folder layout),
``--trigger`` put before each, ``--caption-dropout`` choosing the cached empty caption's
embeddings from the seeded generator (reproducible, resumed with the generator's state in
the checkpoint). In process on the tiny FLUX.1 pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from functional_dit.train import _data, _loop, check_args
from functional_dit.train._buckets import batch_indices


def _image(path) -> None:
    Image.fromarray((np.random.default_rng(len(str(path))).random((32, 32, 3)) * 255).astype(np.uint8)).save(path)


@pytest.fixture
def folder(tmp_path):
    """a.png captioned in metadata.jsonl only; b.png in both (metadata.jsonl wins); c.png
    by its .txt only; d.png in neither (left out)."""
    root = tmp_path / "data"
    root.mkdir()
    for name in "abcd":
        _image(root / f"{name}.png")
    (root / "b.txt").write_text("the txt caption of b")
    (root / "c.txt").write_text("  a caption from c.txt \n")
    rows = [
        {"file_name": "a.png", "text": "a caption from metadata"},
        {"file_name": "b.png", "text": "b from metadata"},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_captions_from_metadata_jsonl_and_txt_files(folder):
    got = _data.find_items(str(folder))
    assert got == [
        (str(folder / "a.png"), "a caption from metadata"),
        (str(folder / "b.png"), "b from metadata"),
        (str(folder / "c.png"), "a caption from c.txt"),
    ]
    assert _data.with_trigger(got, "sks")[0][1] == "sks a caption from metadata"
    assert _data.with_trigger(got, None) == got


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"file_name": "a.png"}', 'line 3: expected {"file_name": str, "text": str}, got \'{"file_name": "a.png"}\''),
        ('{"file_name": "zz.png", "text": "x"}', "line 3: expected an image in {folder}, got 'zz.png' (not found)"),
        ('{"file_name": "sub/a.png", "text": "x"}', "line 3: expected an image file name (.png, .jpg, .jpeg, .webp)"),
    ],
)
def test_a_bad_metadata_line_is_refused_naming_it(folder, tmp_path, capsys, monkeypatch, line, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with open(folder / "metadata.jsonl", "a") as f:
        f.write(line + "\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        check_args(["--data", str(folder), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and f"--data: {folder / 'metadata.jsonl'} {message.replace('{folder}', str(folder))}" in err
    ), err
    assert not out.exists()


def test_caption_dropout_draws_from_the_seeded_generator():
    idx = list(range(8)) * 100

    def rows(p, seed):
        gen = torch.Generator().manual_seed(seed)
        return _data.caption_rows(idx, p, gen, 99), gen.get_state()

    (a, _), (b, _), (c, _) = rows(0.3, 0), rows(0.3, 0), rows(0.3, 1)
    assert a == b and a != c  # the same seed, the same captions dropped; another seed, others
    assert 0.25 < a.count(99) / len(a) < 0.35 and all(r in (i, 99) for r, i in zip(a, idx))
    kept, state = rows(0.0, 0)
    assert kept == idx and torch.equal(state, torch.Generator().manual_seed(0).get_state())  # nothing drawn
    assert rows(1.0, 0)[0] == [99] * len(idx)


def test_trigger_and_dropout_reach_the_model_inputs_reproducibly(folder, tmp_path, monkeypatch):
    """--trigger sks: the cache holds the embeddings of "sks <caption>" and, in row N, of
    the empty caption, as the pipeline encodes them; a step with --caption-dropout feeds a
    dropped item that row; two runs from the seed are bitwise equal, and another seed drops
    other items."""
    from functional_dit import tiny

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.set_num_threads(1)
    base = ["--data", str(folder), "--output-dir", str(tmp_path / "run"), "--resolution", "32", "--rank", "2"]
    base += ["--max-sequence-length", "32", "--dtype", "float32", "--trigger", "sks", "--batch-size", "3"]
    a = check_args([*base, "--caption-dropout", "0.5"])
    r, _ = _loop.begin(a)
    pipe = tiny.pipeline("flux", seed=0)
    for row, caption in enumerate(
        ["sks a caption from metadata", "sks b from metadata", "sks a caption from c.txt", ""]
    ):
        with torch.no_grad():  # (as the trainer encodes)
            e, pooled, _ = pipe.encode_prompt(caption, prompt_2=None, max_sequence_length=32)
        got = r.data.batch([0], [row])
        assert torch.equal(got["txt"][0], e[0]) and torch.equal(got["pooled"][0], pooled[0]), caption
    runs = []
    for seed in ("0", "0", "7"):
        a = check_args([*base, "--caption-dropout", "0.5", "--seed", seed])
        r, _ = _loop.begin(a)
        gen = torch.Generator().set_state(r.gen.get_state())
        idx, _ = batch_indices(0, 3, r.data.groups, a.seed)
        rows = _data.caption_rows(idx, 0.5, gen, 3)  # what the step draws, in its order
        batch = r.data.batch(idx, rows)
        kw, _ = _loop.inputs(batch, torch.zeros(batch["latents"].shape), torch.zeros(3), 1.0, r.params, r.device)
        own = r.data.batch(idx)["txt"]
        empty = r.data.batch(idx[:1], [3])["txt"][0]
        assert all(torch.equal(kw["txt"][i], empty if row == 3 else own[i]) for i, row in enumerate(rows))
        line, _ = _loop.train_step(r, a, 0)
        runs.append((rows, line["loss"], [x.detach().clone() for x in r.adapter.leaves()]))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(x, y) for x, y in zip(runs[0][2], runs[1][2]))
    assert 3 in runs[0][0] + runs[2][0] and runs[0][0] != runs[2][0], runs  # something dropped; seeds differ
    other = check_args([*base, "--trigger", "zz"])  # another trigger: the cache is encoded again
    row0 = _loop.begin(other)[0].data.batch([0])["txt"][0]
    with torch.no_grad():
        assert torch.equal(
            row0, pipe.encode_prompt("zz a caption from metadata", prompt_2=None, max_sequence_length=32)[0][0]
        )
