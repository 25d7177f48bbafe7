"""How `save` puts a finished checkpoint in place so that a kill at any moment leaves
the folder loading as the old checkpoint or the new one, never a mix.

New shards never overwrite a file of the old checkpoint: each is written to a temporary
``<name>.<pid>.tmp``, flushed to disk (``fsync``) and renamed to a name the folder does
not hold yet. The one step that switches a loader from old to new is a single atomic
``os.replace`` (or, going from shards to one file, the removal of the old index: diffusers
and `weights.load` read the index first when there is one). Only then are the old files
removed. The folder itself is fsync'ed after each step, so the order survives a power
loss. Temporaries of a save that was killed (its process is gone) are removed by the next
`save` or `load` of that folder. See docs/checkpoints.md. `write_file` writes one
safetensors file (a LoRA's) the same way: a temporary, flushed, renamed over the old one.
"""

from __future__ import annotations

import json
import os
import re

import torch

from ._format import TORCH_TO_ST, Writer, data_order
from ._source import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME

_STEM = WEIGHTS_NAME.removesuffix(".safetensors")
# Our files: the single file, numbered shards (optionally with a save tag), the index.
OURS = re.compile(rf"{_STEM}(-\d{{5}}-of-\d{{5}}(-[0-9a-f]{{8}})?)?\.safetensors(\.index\.json)?\Z")
_TEMP = re.compile(r"(?P<final>.+)\.(?P<pid>\d+)\.tmp\Z")


def temp_name(final: str) -> str:
    """Where ``final`` is written before it is complete (this process's id in the name)."""
    return f"{final}.{os.getpid()}.tmp"


def fsync_dir(folder: str) -> None:
    """Make the renames and removals in ``folder`` durable (POSIX; a no-op elsewhere)."""
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(file: str, obj) -> None:
    """``file`` replaced atomically by ``obj`` as JSON, flushed to disk first."""
    tmp = temp_name(file)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def write_file(path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """The safetensors file ``path`` replaced atomically by ``tensors`` (and ``metadata``),
    as `save` writes its shards: written to ``<path>.<pid>.tmp`` by `_format.Writer`,
    flushed to disk, renamed; a kill at any moment leaves the old file or the new one. Its
    mode follows the umask, like every file `save` writes (0644 under umask 022; safetensors'
    own ``save_file`` writes 0600). Temporaries a killed write of ``path`` left are removed."""
    path = os.fspath(path)
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in TORCH_TO_ST:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"tensors: {k}: expected a tensor of a dtype safetensors stores, got {got}")
    folder = os.path.dirname(path) or "."
    _remove_dead_temps(folder, os.path.basename(path))
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    temp, writer = temp_name(path), None
    try:
        writer = Writer(temp, specs, metadata)
        for k in data_order(specs):
            writer.write(k, tensors[k])
        writer.close()
        os.replace(temp, path)
    except BaseException:
        if writer is not None:
            writer.file.close()
        if os.path.lexists(temp):
            os.remove(temp)
        raise
    fsync_dir(folder)


def _remove_dead_temps(folder: str, name: str) -> None:
    """The temporaries of ``name`` left by writes whose process is gone."""
    for other in os.listdir(folder):
        m = _TEMP.match(other)
        if m and m.group("final") == name and not _alive(int(m.group("pid"))):
            try:
                os.remove(os.path.join(folder, other))
            except OSError:  # not ours to remove: the write below says so if it matters
                pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_leftovers(folder: str) -> list[str]:
    """Remove the temporaries that killed saves left in ``folder`` (those of a live
    process are another save in progress and stay); returns the names removed. A folder
    we may not write to is left as it is."""
    removed = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        m = _TEMP.match(name)
        final = m.group("final") if m else ""
        if m and (OURS.match(final) or final == CONFIG_NAME) and not _alive(int(m.group("pid"))):
            try:
                os.remove(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def shard_names(folder: str, n: int) -> list[str]:
    """Names for ``n`` new files that no file in ``folder`` has: the standard names when
    free, else the standard names with a save tag, so no old shard is overwritten."""
    if n == 1:
        return [WEIGHTS_NAME]
    taken = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    plain = [f"{_STEM}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    while any(name in taken for name in plain):
        tag = os.urandom(4).hex()
        plain = [f"{_STEM}-{i + 1:05d}-of-{n:05d}-{tag}.safetensors" for i in range(n)]
    return plain


def commit(folder: str, temps: dict[str, str], index: dict | None, config: dict) -> None:
    """Move the finished temporaries ``{temp: final}`` into place; ``index`` is None for
    one file. The switch from old to new is one step, see the module docstring."""
    old_index = os.path.join(folder, INDEX_NAME)
    for temp, final in temps.items():  # shards under new names, or the single file
        os.replace(temp, final)  # a single file is read only once no index precedes it
    fsync_dir(folder)
    if index is not None:
        write_json(old_index, index)  # the switch (an index is read first)
    elif os.path.lexists(old_index):
        os.remove(old_index)  # the switch from shards to the one file
    fsync_dir(folder)
    _write_config(os.path.join(folder, CONFIG_NAME), config)
    keep = {os.path.basename(f) for f in temps.values()} | {CONFIG_NAME} | ({INDEX_NAME} if index else set())
    remove_stale(folder, keep)
    fsync_dir(folder)


def _write_config(path: str, config: dict) -> None:
    """config.json, rewritten only when it changes (so re-saving a model's weights has a
    single switch); a changed config follows the weights' switch at once."""
    try:
        with open(path) as f:
            if json.load(f) == config:
                return
    except (OSError, ValueError):
        pass
    write_json(path, config)


def remove_stale(folder: str, keep: set[str]) -> None:
    """Weight files a loader could pick up instead of ours (an index from an earlier
    sharded save, shards from a different count) and temporaries of killed saves."""
    for name in os.listdir(folder):
        if OURS.match(name) and name not in keep:
            os.remove(os.path.join(folder, name))
    clean_leftovers(folder)
