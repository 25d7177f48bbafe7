"""`weights.save` over an existing checkpoint, killed at every step: the folder must load
as the old checkpoint or as the new one, never a mix, and the next save or load removes
what the killed save left. Also: the 64-byte data layout that makes mmap'ed tensors
aligned (docs/numerics.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

import functional_dit as fd
import weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "flux1-tiny"
# (old, new) max_shard_size: sharded -> sharded (same count: new names needed),
# one file -> shards, shards -> one file, one file -> one file.
TRANSITIONS = [("150KB", "150KB"), ("5GB", "150KB"), ("150KB", "5GB"), ("5GB", "5GB")]


class Killed(BaseException):
    """Stands in for SIGKILL in-process: not an Exception, so no clean-up handler runs."""


def _same(a: fd.Params, b: fd.Params) -> bool:
    return a.config == b.config and all(torch.equal(x, y) for x, y in zip(a.leaves(), b.leaves()))


def _kill_at(monkeypatch, k: int) -> list[int]:
    """Raise `Killed` instead of the k-th rename or removal (0-based); counts them all."""
    calls, real = [0], {"replace": os.replace, "remove": os.remove, "rename": os.rename}

    def hook(name):
        def op(*args, **kw):
            calls[0] += 1
            if calls[0] - 1 == k:
                raise Killed(f"{name} #{k}")
            return real[name](*args, **kw)

        return op

    for name in real:
        monkeypatch.setattr(os, name, hook(name))
    return calls


def _which(path, old, new) -> str:
    loaded = weights.load(path)
    return "old" if _same(loaded, old) else "new" if _same(loaded, new) else "a mix"


@pytest.mark.parametrize("old_size, new_size", TRANSITIONS)
def test_save_killed_at_each_step_loads_as_old_or_new(tmp_path, monkeypatch, old_size, new_size):
    """Every rename/removal of a save, in turn, is where it dies; after each death the
    folder loads as old or new (first old, then new once the switch has happened), the
    next load removes the killed save's temporaries, and a save then succeeds."""
    old, new = fd.init(CONFIG, seed=0), fd.init(CONFIG, seed=1)
    monkeypatch.setattr(weights._commit, "_alive", lambda pid: False)  # the "killed" save was ours
    seen, k = [], 0
    while True:
        folder = tmp_path / f"k{k}"
        weights.save(old, folder, max_shard_size=old_size)
        (folder / "README.md").write_text("mine")
        _kill_at(monkeypatch, k)
        try:
            weights.save(new, folder, max_shard_size=new_size)
            done = True
        except Killed:
            done = False
        monkeypatch.undo()
        monkeypatch.setattr(weights._commit, "_alive", lambda pid: False)
        seen.append(_which(folder, old, new))
        assert not [n for n in os.listdir(folder) if n.endswith(".tmp")], os.listdir(folder)  # load cleaned up
        if done:
            break
        k += 1
    assert seen == sorted(seen, key=["old", "new"].index) and seen[0] == "old" and seen[-1] == "new", seen
    weights.save(new, folder, max_shard_size=old_size)
    assert _same(weights.load(folder), new) and "README.md" in os.listdir(folder)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import functional_dit as fd, weights
    folder, size, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    count = [0]
    def dies_at(real, n):  # SIGKILL instead of the n-th call (0-based)
        def call(*args, **kw):
            count[0] += 1
            if count[0] - 1 == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kw)
        return call
    if k < 0:  # k = -n: while writing the n-th tensor
        weights._format.Writer.write = dies_at(weights._format.Writer.write, -k)
    else:  # the k-th rename or removal
        os.replace, os.remove = dies_at(os.replace, k), dies_at(os.remove, k)
    weights.save(fd.init("{config}", seed=1), folder, max_shard_size=size)
    """
).replace("{config}", CONFIG)


def test_sigkill_of_a_real_save_process_loads_as_old_or_new(tmp_path):
    """A save process killed with SIGKILL half way through writing the shards, right
    before the switch and right after it: old, old, new; the temporaries it left are
    gone after the next load (their process is dead)."""
    old, new = fd.init(CONFIG, seed=0), fd.init(CONFIG, seed=1)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # 4 shards at 150KB: 4 renames (calls 0-3), the index (4: the switch), old shards' removal (5-)
    for k, expected, left in ((-40, "old", True), (4, "old", True), (5, "new", False)):
        folder = tmp_path / f"k{k}"
        weights.save(old, folder, max_shard_size="150KB")
        done = subprocess.run([sys.executable, "-c", _CHILD, str(folder), "150KB", str(k)], env=env, timeout=300)
        assert done.returncode == -signal.SIGKILL, done.returncode
        assert any(n.endswith(".tmp") for n in os.listdir(folder)) == left, os.listdir(folder)
        assert _which(folder, old, new) == expected, k
        assert not [n for n in os.listdir(folder) if n.endswith(".tmp")], os.listdir(folder)


def test_leftovers_of_a_live_save_stay(tmp_path):
    """A temporary whose process is alive belongs to a save in progress: not removed."""
    weights.save(fd.init(CONFIG, seed=0), tmp_path)
    live = tmp_path / f"diffusion_pytorch_model.safetensors.{os.getppid()}.tmp"
    dead = tmp_path / "diffusion_pytorch_model.safetensors.999999999.tmp"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    weights.load(tmp_path)
    assert live.exists() and not dead.exists()


def test_saved_tensors_are_64_byte_aligned_when_mapped(tmp_path):
    """Every tensor whose size is a multiple of 64 bytes starts 64-byte aligned in the
    file, so safetensors' mmap (what diffusers' from_pretrained uses) gives aligned
    tensors; the others come last. Stock safetensors reads the file back bitwise."""
    params = fd.init(CONFIG, seed=0)
    odd = {"a": torch.randn(3), "b": torch.randn(16, 16), "c": torch.randn(5, 2), "d": torch.randn(32)}
    writer = weights._format.Writer(str(tmp_path / "odd.safetensors"), {k: (t.dtype, t.shape) for k, t in odd.items()})
    for k in ("d", "a", "c", "b"):  # any order
        writer.write(k, odd[k])
    writer.close()
    back = safetensors.torch.load_file(tmp_path / "odd.safetensors")
    assert all(torch.equal(back[k], t) for k, t in odd.items())
    assert back["b"].data_ptr() % 64 == 0 and back["d"].data_ptr() % 64 == 0
    weights.save(params, tmp_path / "m", max_shard_size="150KB")
    for name in os.listdir(tmp_path / "m"):
        if name.endswith(".safetensors"):
            mapped = safetensors.torch.load_file(tmp_path / "m" / name)
            assert all(t.data_ptr() % 64 == 0 for t in mapped.values()), name


def test_single_file_under_diffusion_model_prefix_loads(tmp_path):
    """ComfyUI / Kohya single files keep the BFL keys under ``diffusion_model.`` (without
    ``model.``): the prefix is stripped as ``model.diffusion_model.`` is."""
    from test_weights_bfl import _case, diffusers_convert, random_state

    _, config, shapes = _case("flux1-dev")
    bfl = random_state(shapes(config), seed=6)
    save_file({f"diffusion_model.{k}": v for k, v in bfl.items()}, tmp_path / "f.safetensors")
    ref = diffusers_convert(config, bfl)
    loaded = weights.load(tmp_path / "f.safetensors", config="flux1-tiny")
    assert all(torch.equal(t, ref[k]) for k, t in loaded.flat().items())


@pytest.fixture
def umask():
    """Set the process umask for one test (``umask(0o022)``), restored after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_weights_save_and_write_file_follow_the_umask(tmp_path, umask, mask, mode):
    """`weights.save`'s files and `weights.internal.write_file`'s (LoRA files) get the mode
    the umask gives a new file (safetensors' own ``save_file`` writes 0600 whatever it is)."""
    from weights.internal import write_file

    umask(mask)
    weights.save(fd.init(CONFIG, seed=0), tmp_path / "m")
    write_file(tmp_path / "one.safetensors", {"a": torch.arange(6.0).view(2, 3)}, {"format": "pt", "k": "v"})
    for file in (tmp_path / "m" / "diffusion_pytorch_model.safetensors", tmp_path / "one.safetensors"):
        assert oct(os.stat(file).st_mode & 0o777) == oct(mode), file
    with safetensors.safe_open(tmp_path / "one.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"} and torch.equal(
            f.get_tensor("a"), torch.arange(6.0).view(2, 3)
        )


def test_write_file_is_atomic_and_removes_dead_leftovers(tmp_path, monkeypatch):
    """A write that fails half way (the second tensor) leaves the old file as it was and no
    temporary; a dead process's temporary of the same file goes on the next write, a live
    one's and other files' stay; a value safetensors cannot store is refused by name."""
    from weights.internal import write_file

    path = tmp_path / "lora.safetensors"
    write_file(path, {"a": torch.zeros(2)})
    old = path.read_bytes()
    real, calls = weights._format.Writer.write, []

    def dies_on_second(self, key, tensor):
        calls.append(key)
        if len(calls) == 2:
            raise Killed("mid-write")
        return real(self, key, tensor)

    monkeypatch.setattr(weights._format.Writer, "write", dies_on_second)
    with pytest.raises(Killed):
        write_file(path, {"a": torch.ones(2), "b": torch.ones(3)})
    monkeypatch.undo()
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["lora.safetensors"]
    dead, live = tmp_path / "lora.safetensors.999999999.tmp", tmp_path / f"lora.safetensors.{os.getppid()}.tmp"
    other = tmp_path / "other.safetensors.999999999.tmp"
    for f in (dead, live, other):
        f.write_bytes(b"x")
    write_file(path, {"a": torch.ones(2)})
    assert not dead.exists() and live.exists() and other.exists()
    assert torch.equal(safetensors.torch.load_file(path)["a"], torch.ones(2))
    with pytest.raises(ValueError, match=r"tensors: b: expected a tensor of a dtype safetensors stores, got list"):
        write_file(path, {"a": torch.ones(2), "b": [1.0]})
