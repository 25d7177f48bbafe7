"""Mixed resolutions in the core, FLUX.2 (dev, klein, its reference KV cache) and FLUX.3:
``fd.apply(..., img_valid=...)`` with a RoPE table per row.

- rows of different image lengths (and, for FLUX.3, reference lengths), padded to one
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
import pytest
import torch

import functional_dit as fd
from functional_dit import flux2, flux3
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
    """FLUX.2 (klein, references in x) and FLUX.3 (references of two sizes): ``img_valid``
    and the per-row tables cut over sp=2 equal one process on the real tokens within 1e-5."""
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
