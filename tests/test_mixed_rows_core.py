"""Mixed resolutions in the core, FLUX.2 (dev, klein, its reference KV cache), FLUX.3 and
Qwen-Image 2.1 (its prefix KV cache): ``fd.apply(..., img_valid=...)`` with a RoPE table
per row.

- rows of different image lengths (and, for FLUX.3, reference lengths; for Qwen-Image 2.1,
  prompt lengths and condition-image sizes in one shared padded layout), padded to one
  length, each predict what they predict alone (fp32 1e-5), whatever the padding holds;
- changing row B's tokens leaves row A's output bitwise unchanged (the same ops in one
  process);
- a bad ``img_valid`` / ``image_cond_valid`` is refused naming it, and so are padded
  reference tokens under FLUX.2-klein's KV cache (the cache holds no mask);
- slow: the padded call on an sp=2 mesh equals one process.
"""

from __future__ import annotations

import cases_flux2
import cases_flux3
import cases_qwenimage21
import pytest
import torch

import functional_dit as fd
from functional_dit import flux2, flux3, qwenimage, qwenimage21
from functional_dit.nn import layers as L

TOL = dict(rtol=1e-5, atol=1e-5)
SIZES = ((2, 3), (3, 4))  # (h, w) latent grids: rows of 6 and 12 image tokens


def _pad(ts: list, n: int, seed: int = 7) -> torch.Tensor:
    """Tensors whose dim -2 is a sequence, padded to ``n`` rows with noise (padding must
    not matter) and stacked; (S, D) tables become (B, n, D), (1, S, C) rows (B, n, C)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.cat([t, torch.randn(*t.shape[:-2], n - t.shape[-2], t.shape[-1], generator=g)], -2) for t in ts]
    return torch.cat(out) if ts[0].ndim == 3 else torch.stack(out)


def _valid(lengths, n: int) -> torch.Tensor:
    return torch.stack([torch.arange(n) < s for s in lengths])


def _batch(rows: list, parts: list, keep: tuple) -> dict:
    """One call over ``rows`` (each fd.apply's keywords for one row, with ``rope`` per
    segment in ``parts``: a list of (cos, sin) per segment, (txt; img[; ref]) order):
    x and every segment padded to the longest row, the tables one per row, ``img_valid``;
    ``keep``: keywords stacked as they are (equal lengths)."""
    S = max(r["x"].shape[1] for r in rows)
    out = {k: torch.cat([r[k] for r in rows]) for k in keep if k in rows[0]}
    out.update(x=_pad([r["x"] for r in rows], S), img_valid=_valid([r["x"].shape[1] for r in rows], S))
    segs = []
    for i in range(len(parts[0])):
        n = max(p[i][0].shape[0] for p in parts)
        segs.append([_pad([p[i][j] for p in parts], n) for j in range(2)])
    out["rope"] = tuple(torch.cat([s[j] for s in segs], 1) for j in range(2))
    return out


def _flux2_row(config, h, w, seed, refs=False):
    """FLUX.2 keywords for one row of an h x w grid, with ``rope`` in place of the ids
    (and its segments); ``refs``: a 2 x 2 reference image in x, no KV cache."""
    kw = cases_flux2.inputs(config, batch=1, h=h, w=w, seed=seed, ref_hw=(2, 2) if refs else None)
    for k in ("kv_cache", "num_ref_tokens", "ref_fixed_timestep"):
        kw.pop(k, None)
    img_ids, txt_ids = kw.pop("img_ids"), kw.pop("txt_ids")
    pe_txt, pe_img = (L.rope(i, config.axes_dims_rope, config.rope_theta) for i in (txt_ids, img_ids))
    kw["rope"] = flux2.rope_table(config, img_ids, txt_ids)
    return kw, [pe_txt, pe_img]


FLUX2 = {
    "dev": (cases_flux2.TINY, False),
    "klein": (cases_flux2.TINY_KLEIN, False),
    "klein-refs": (cases_flux2.TINY_KLEIN, True),
}


@pytest.fixture(scope="module")
def flux2_params():
    return {k: fd.init(c, seed=0) for k, c in (("dev", cases_flux2.TINY), ("klein", cases_flux2.TINY_KLEIN))}


@pytest.mark.parametrize("case", list(FLUX2))
def test_flux2_padded_rows_equal_each_row_alone(flux2_params, case):
    config, refs = FLUX2[case]
    params = flux2_params[case.split("-")[0]]
    rows = [_flux2_row(config, h, w, seed, refs) for seed, (h, w) in enumerate(SIZES)]
    kw = _batch([r for r, _ in rows], [p for _, p in rows], ("t", "txt", "guidance"))
    both = fd.apply(params, **kw)
    for b, (row, _) in enumerate(rows):
        S = row["x"].shape[1]
        torch.testing.assert_close(both[b : b + 1, :S], fd.apply(params, **row), **TOL)
    other = dict(kw, x=kw["x"].clone())
    other["x"][1] = torch.randn(other["x"][1].shape)  # row B's tokens changed: row A's output is not
    assert torch.equal(fd.apply(params, **other)[0], both[0])


def test_flux2_bad_img_valid_refused_by_name(flux2_params):
    rows = [_flux2_row(cases_flux2.TINY, h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    kw = _batch([r for r, _ in rows], [p for _, p in rows], ("t", "txt", "guidance"))
    for bad in (kw["img_valid"].float(), kw["img_valid"][:, 1:], kw["img_valid"][:1]):
        with pytest.raises(ValueError, match="img_valid"):
            fd.apply(flux2_params["dev"], **dict(kw, img_valid=bad))


def _kv_rows(config, R=4):
    """Two klein KV rows (extract kwargs) of one reference length and two image sizes,
    with their RoPE tables (x: (ref; img) rows)."""
    out = []
    for seed, (h, w) in enumerate(SIZES):
        kw = cases_flux2.inputs(config, batch=1, h=h, w=w, seed=seed, ref_hw=(2, 2), ref_fixed_timestep=0.0)
        img_ids, txt_ids = kw.pop("img_ids"), kw.pop("txt_ids")
        pe_txt, pe_img = (L.rope(i, config.axes_dims_rope, config.rope_theta) for i in (txt_ids, img_ids))
        out.append((dict(kw, rope=flux2.rope_table(config, img_ids, txt_ids)), [pe_txt, pe_img], img_ids, txt_ids))
    return out


def test_flux2_klein_kv_cache_padded_rows_equal_each_row_alone(flux2_params):
    """Extract (references of one length first in x, images of two sizes), then a cached
    step: each row's output and cache equal the row alone."""
    config, params = cases_flux2.TINY_KLEIN, flux2_params["klein"]
    rows = _kv_rows(config)
    kw = _batch([r for r, *_ in rows], [p for _, p, *_ in rows], ("t", "txt"))
    kw.update(kv_cache="extract", num_ref_tokens=4, ref_fixed_timestep=0.0)
    out, cache = fd.apply(params, **kw)
    alone = [fd.apply(params, **r) for r, *_ in rows]
    for b, (o, c) in enumerate(alone):
        torch.testing.assert_close(out[b : b + 1, : o.shape[1]], o, **TOL)
        for key, v in c.flat().items():
            torch.testing.assert_close(cache.flat()[key][b : b + 1], v, **TOL)
    steps = []
    for (r, _, img_ids, txt_ids), (_, c) in zip(rows, alone):
        n = cases_flux2.next_step(dict(r, img_ids=img_ids, txt_ids=txt_ids), c)  # drops the reference rows
        ids = (n.pop("txt_ids"), n.pop("img_ids"))
        pe = [L.rope(i, config.axes_dims_rope, config.rope_theta) for i in ids]
        steps.append((dict(n, rope=flux2.rope_table(config, ids[1], ids[0])), pe))
    kw = _batch([n for n, _ in steps], [p for _, p in steps], ("t", "txt"))
    out = fd.apply(params, **kw, kv_cache=cache)
    for b, (n, _) in enumerate(steps):
        torch.testing.assert_close(out[b : b + 1, : n["x"].shape[1]], fd.apply(params, **n), **TOL)


def test_flux2_klein_kv_extract_refuses_padded_references(flux2_params):
    rows = _kv_rows(cases_flux2.TINY_KLEIN)
    kw = _batch([r for r, *_ in rows], [p for _, p, *_ in rows], ("t", "txt"))
    kw.update(kv_cache="extract", num_ref_tokens=4, ref_fixed_timestep=0.0)
    kw["img_valid"] = kw["img_valid"].clone()
    kw["img_valid"][0, 3] = False  # a padded reference token
    with pytest.raises(ValueError, match="img_valid: with kv_cache='extract'"):
        fd.apply(flux2_params["klein"], **kw)


def _flux3_row(config, h, w, seed, ref_hw=None):
    kw = cases_flux3.inputs(config, batch=1, h=h, w=w, ref_hw=ref_hw, seed=seed)
    ids = [kw.pop("txt_ids"), kw.pop("img_ids")] + ([kw.pop("image_cond_ids")] if ref_hw else [])
    parts = [L.rope(i, config.axes_dims_rope, config.rope_theta) for i in ids]
    kw["rope"] = flux3.rope_table(config, ids[1], ids[0], ids[2] if ref_hw else None)
    return kw, parts


FLUX3 = {
    "flow-map": (cases_flux3.TINY, (None, None)),
    "base": (cases_flux3.TINY_BASE, (None, None)),
    "base-refs": (cases_flux3.TINY_BASE, ((2, 2), (3, 2))),  # references of two sizes too
}


@pytest.fixture(scope="module")
def flux3_params():
    return {k: fd.init(c, seed=0) for k, c in (("flow-map", cases_flux3.TINY), ("base", cases_flux3.TINY_BASE))}


@pytest.mark.parametrize("case", list(FLUX3))
def test_flux3_padded_rows_equal_each_row_alone(flux3_params, case):
    config, refs = FLUX3[case]
    params = flux3_params[case.split("-refs")[0]]
    rows = [_flux3_row(config, h, w, seed, ref) for seed, ((h, w), ref) in enumerate(zip(SIZES, refs))]
    kw = _batch([r for r, _ in rows], [p for _, p in rows], ("t", "txt", "target_timestep"))
    if refs[0] is not None:
        R = max(r["image_cond"].shape[1] for r, _ in rows)
        kw["image_cond"] = _pad([r["image_cond"] for r, _ in rows], R)
        kw["image_cond_valid"] = _valid([r["image_cond"].shape[1] for r, _ in rows], R)
    both = fd.apply(params, **kw)
    for b, (row, _) in enumerate(rows):
        S = row["x"].shape[1]
        torch.testing.assert_close(both[b : b + 1, :S], fd.apply(params, **row), **TOL)
    other = dict(kw, x=kw["x"].clone())
    other["x"][1] = torch.randn(other["x"][1].shape)
    assert torch.equal(fd.apply(params, **other)[0], both[0])
    if refs[0] is not None:
        for bad in (kw["image_cond_valid"].float(), kw["image_cond_valid"][:, 1:]):
            with pytest.raises(ValueError, match="image_cond_valid"):
                fd.apply(params, **dict(kw, image_cond_valid=bad))
    with pytest.raises(ValueError, match="img_valid"):
        fd.apply(params, **dict(kw, img_valid=kw["img_valid"].float()))


def test_flux3_image_cond_valid_without_references_refused(flux3_params):
    kw, _ = _flux3_row(cases_flux3.TINY, 2, 3, 0)
    with pytest.raises(ValueError, match="image_cond_valid: only used with image_cond"):
        fd.apply(flux3_params["flow-map"], **kw, image_cond_valid=torch.ones(1, 4, dtype=torch.bool))


def _sp_work(rank, world, config, kw):
    """One rank: the padded call on an sp=2 mesh (Ulysses), and on one process."""
    import sharding

    params = fd.init(config, seed=0)
    mesh = sharding.make_mesh(sp=world)
    out = fd.apply(sharding.shard_params(params, mesh), **kw)
    return torch.as_tensor(out).clone(), fd.apply(params, **kw)


@pytest.mark.slow
def test_padded_rows_under_sequence_parallelism_equal_one_process():
    """FLUX.2 (klein, references in x), FLUX.3 (references of two sizes) and Qwen-Image 2.1
    (two prompt lengths): ``img_valid`` and the per-row tables cut over sp=2 equal one
    process on the real image tokens within 1e-5."""
    from _dist import spawn

    rows = [_flux2_row(cases_flux2.TINY_KLEIN, h, w, s, True) for s, (h, w) in enumerate(SIZES)]
    kw2 = _batch([r for r, _ in rows], [p for _, p in rows], ("t", "txt"))
    refs = FLUX3["base-refs"][1]
    rows = [_flux3_row(cases_flux3.TINY_BASE, h, w, s, ref) for s, ((h, w), ref) in enumerate(zip(SIZES, refs))]
    kw3 = _batch([r for r, _ in rows], [p for _, p in rows], ("t", "txt"))
    kw3["image_cond"] = _pad([r["image_cond"] for r, _ in rows], 6)
    kw3["image_cond_valid"] = _valid([4, 6], 6)
    for config, kw in ((cases_flux2.TINY_KLEIN, kw2), (cases_flux3.TINY_BASE, kw3)):
        (sp, one), _ = spawn(_sp_work, 2, config, kw, timeout=300)
        valid = kw["img_valid"].bool()
        torch.testing.assert_close(sp[valid], one[valid], **TOL)
    config = cases_qwenimage21.TINY  # Qwen-Image 2.1: the image rows are the joint sequence's tail
    kw = _q21_batch(config, [_q21_row(config, T, hw, seed) for seed, (T, hw) in enumerate(QWEN21_ROWS)])
    (sp, one), _ = spawn(_sp_work, 2, config, kw, timeout=300)
    valid = kw["img_valid"].bool()
    S = valid.shape[1]
    torch.testing.assert_close(sp[:, -S:][valid], one[:, -S:][valid], **TOL)


# ----------------------------------------------------------------------------- Qwen-Image 2.1

QWEN21_ROWS = ((3, (2, 2)), (5, (2, 4)))  # (text rows, target grid): prompts and images of two sizes


def _q21_row(config, T, hw, seed):
    """One text-to-image row alone: fd.apply's keywords and its RoPE table (T + h·w rows)."""
    g = torch.Generator().manual_seed(seed)
    S = hw[0] * hw[1]
    kw = dict(
        x=torch.randn(1, S, config.in_channels, generator=g),
        t=torch.rand(1, generator=g),
        txt=torch.randn(1, T, config.context_in_dim, generator=g),
        img_shapes=[[(1, *hw)]],
        img_mask=torch.tensor([[False] * T + [True] * (S // 4)]),
    )
    lay = qwenimage21.read_layout(kw["img_mask"], kw["img_shapes"], T, S)
    return kw, qwenimage.rope(lay.ids, config.axes_dims_rope)


def _q21_batch(config, rows) -> dict:
    """The rows in one call: text padded to the longest prompt (masked by txt_mask), the
    target to the longest image (img_valid), the shared padded layout (the longest row's
    slots and grid), each row's own positions in its RoPE table."""
    T = max(r["txt"].shape[1] for r, _ in rows)
    S = max(r["x"].shape[1] for r, _ in rows)
    Ts = [r["txt"].shape[1] for r, _ in rows]
    tables = [[(pe[j][:t], pe[j][t:]) for j in range(2)] for (_, pe), t in zip(rows, Ts)]
    rope = tuple(
        torch.cat([_pad([tb[j][0] for tb in tables], T), _pad([tb[j][1] for tb in tables], S)], 1) for j in range(2)
    )
    big = max(rows, key=lambda r: r[0]["x"].shape[1])[0]
    return dict(
        x=_pad([r["x"] for r, _ in rows], S),
        t=torch.cat([r["t"] for r, _ in rows]),
        txt=_pad([r["txt"] for r, _ in rows], T),
        txt_mask=_valid(Ts, T),
        img_shapes=big["img_shapes"] * len(rows),
        img_mask=torch.tensor([[False] * T + [True] * (S // 4)] * len(rows)),
        rope=rope,
        img_valid=_valid([r["x"].shape[1] for r, _ in rows], S),
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal-condition", "plain"])
def test_qwen21_padded_rows_equal_each_row_alone(causal):
    """Qwen-Image 2.1 text to image: prompts of 3 and 5 rows, images of 4 and 8 tokens in
    one call (one shared layout, a table per row): each row's text and image rows equal the
    row alone; row B's tokens do not reach row A; a bad img_valid is refused by name."""
    config = cases_qwenimage21.TINY if causal else cases_qwenimage21.TINY_NC
    params = fd.init(config, seed=0)
    rows = [_q21_row(config, T, hw, seed) for seed, (T, hw) in enumerate(QWEN21_ROWS)]
    kw = _q21_batch(config, rows)
    both, Tm = fd.apply(params, **kw), kw["txt"].shape[1]
    for b, (row, _) in enumerate(rows):
        alone, T, S = fd.apply(params, **row), row["txt"].shape[1], row["x"].shape[1]
        torch.testing.assert_close(both[b : b + 1, :T], alone[:, :T], **TOL)
        torch.testing.assert_close(both[b : b + 1, Tm : Tm + S], alone[:, T:], **TOL)
    other = dict(kw, x=kw["x"].clone())
    other["x"][1] = torch.randn(other["x"][1].shape)
    assert torch.equal(fd.apply(params, **other)[0], both[0])
    for bad in (kw["img_valid"].float(), kw["img_valid"][:, 1:]):
        with pytest.raises(ValueError, match="img_valid"):
            fd.apply(params, **dict(kw, img_valid=bad))


def test_qwen21_kv_cache_padded_rows_equal_each_row_alone():
    """The prefix KV cache over padded rows: the extract pass and a cached step equal each
    row alone (its cache's real prefix rows too)."""
    config = cases_qwenimage21.TINY
    params = fd.init(config, seed=0)
    rows = [_q21_row(config, T, hw, seed) for seed, (T, hw) in enumerate(QWEN21_ROWS)]
    kw = _q21_batch(config, rows)
    out, cache = fd.apply(params, **kw, kv_cache="extract")
    Tm = kw["txt"].shape[1]
    x2 = torch.randn(kw["x"].shape, generator=torch.Generator().manual_seed(9))
    step = fd.apply(params, **dict(kw, x=x2, t=kw["t"] / 2), kv_cache=cache)
    for b, (row, _) in enumerate(rows):
        T, S = row["txt"].shape[1], row["x"].shape[1]
        o, c = fd.apply(params, **row, kv_cache="extract")
        torch.testing.assert_close(out[b : b + 1, Tm : Tm + S], o[:, -S:], **TOL)  # out: the joint rows
        for key, v in c.flat().items():
            torch.testing.assert_close(cache.flat()[key][b : b + 1, :T], v, **TOL)
        alone = fd.apply(params, **dict(row, x=x2[b : b + 1, :S], t=row["t"] / 2), kv_cache=c)
        torch.testing.assert_close(step[b : b + 1, :S], alone[:, -S:], **TOL)


def _q21_edit_row(config, h, w, seed):
    """One edit row alone: 3 text rows, an h x w condition image, 2 text rows, an h x w
    target; fd.apply's keywords and its RoPE table over the joint sequence."""
    g = torch.Generator().manual_seed(seed)
    n = h * w
    slots = [False] * 3 + [True] * (n // 4) + [False] * 2
    kw = dict(
        x=torch.randn(1, 2 * n, config.in_channels, generator=g),
        t=torch.rand(1, generator=g),
        txt=torch.randn(1, len(slots), config.context_in_dim, generator=g),
        img_shapes=[[(1, h, w), (1, h, w)]],
        img_mask=torch.tensor([slots + [True] * (n // 4)]),
    )
    lay = qwenimage21.read_layout(kw["img_mask"], kw["img_shapes"], len(slots), 2 * n)
    return kw, qwenimage.rope(lay.ids, config.axes_dims_rope)


def _cut(a: torch.Tensor, n: int) -> tuple:
    """An edit row's joint rows (or encoder rows, n = its slots) as its four runs: text,
    the condition image, text, the target."""
    return a[:3], a[3 : 3 + n], a[3 + n : 5 + n], a[5 + n :]


def test_qwen21_condition_images_of_two_sizes_share_one_layout():
    """Edit rows whose condition images and targets differ in size (4 and 8 tokens): the
    encoder's sequence re-laid per row (the smaller image's slots padded inside the text,
    the larger row's layout shared), each row's condition and target rows equal the row
    alone."""
    config = cases_qwenimage21.TINY
    params = fd.init(config, seed=0)
    grids = ((2, 2), (2, 4))
    rows = [_q21_edit_row(config, h, w, seed) for seed, (h, w) in enumerate(grids)]
    ns = [h * w for h, w in grids]
    n = max(ns)
    runs = [[_cut(pe[j], s) for (_, pe), s in zip(rows, ns)] for j in range(2)]
    rope = tuple(torch.cat([_pad([r[i] for r in rs], (3, n, 2, n)[i]) for i in range(4)], 1) for rs in runs)
    txt = [_cut(r["txt"][0], s // 4) for (r, _), s in zip(rows, ns)]
    xs = [(r["x"][0, :s], r["x"][0, s:]) for (r, _), s in zip(rows, ns)]
    big = rows[1][0]
    kw = dict(
        x=torch.cat([_pad([x[i] for x in xs], n) for i in range(2)], 1),
        t=torch.cat([r["t"] for r, _ in rows]),
        txt=torch.cat([_pad([t[i] for t in txt], (3, n // 4, 2)[i]) for i in range(3)], 1),
        img_shapes=big["img_shapes"] * 2,
        img_mask=big["img_mask"].expand(2, -1).clone(),
        rope=rope,
        img_valid=torch.cat([_valid(ns, n)] * 2, 1),
    )
    both = fd.apply(params, **kw)
    for b, ((row, _), s) in enumerate(zip(rows, ns)):
        alone = fd.apply(params, **row)
        torch.testing.assert_close(both[b : b + 1, 3 : 3 + s], alone[:, 3 : 3 + s], **TOL)  # the condition
        torch.testing.assert_close(both[b : b + 1, -n:][:, :s], alone[:, -s:], **TOL)  # the target
