"""Differentiation rules of the named-axis collectives (autograd, ``torch.func``).

Each collective's backward makes every rank's gradients equal the unsharded ones
(Megatron-LM's pairing): ``psum`` all-reduce / identity, ``pvary`` identity /
all-reduce, ``all_gather`` / this rank's slice, ``all_to_all`` / the reverse all-to-all,
``ppermute`` (ring attention's pass to the next rank) / the pass back to the previous one.
All five are linear, so jvp and vmap apply the op itself. Each is an
``autograd.Function`` with a ``vmap`` rule; the ``jvp`` rule lives on a subclass used
only under forward AD, since dynamo refuses ``fullgraph`` training graphs through a
Function defining ``jvp``. The table and the reasons: docs/autodiff.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.autograd import forward_ad


def _funcol():
    return funcol


def _done(t: torch.Tensor) -> torch.Tensor:
    """The finished result of a functional collective. Eager funcol returns an
    ``AsyncCollectiveTensor`` that waits only when an op dispatches on it; views of it
    (``narrow``, ``movedim``) stay un-waited, and a reader that bypasses dispatch
    (``torch.save``, ``.numpy()``) would see the buffer before the collective filled it.
    So every collective here waits at once. (Traced code gets plain tensors and an
    explicit ``wait_tensor`` from funcol, so this is a no-op under torch.compile/export.)"""
    funcol = _funcol()
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_gather_dim0():
    # torch 2.13 renamed funcol.all_gather_tensor to all_gather_single and made the old
    # name warn (FutureWarning) on every eager call; torch 2.9 has only the old name.
    funcol = _funcol()
    return getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


# ----------------------------------------------------------------------------- the raw collectives


def _eager_cpu(x: torch.Tensor) -> bool:
    """True for a plain CPU tensor outside tracing: where an all-gather goes through c10d's
    own API (`issue_all_gather` says why) rather than the functional op."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(x)


def _c10d_all_gather(x: torch.Tensor, n: int, group, async_op: bool):
    """(the gathered buffer, c10d's work) of ``x`` along dim 0 over ``group``'s ``n`` ranks,
    through c10d's own all-gather (`issue_all_gather` says why)."""
    # torch 2.13 renamed dist.all_gather_into_tensor to all_gather_single (the old name warns)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    return out, gather(out, x, group=group, async_op=async_op)


class Pending:
    """An all-gather issued eagerly through c10d (`issue_all_gather`): the buffer it fills
    (``out``, not to be read before `waited`) and its work. ``dtype`` and ``numel()`` say
    what it will hold, as the functional op's unwaited result does."""

    __slots__ = ("out", "work")

    def __init__(self, out: torch.Tensor, work):
        self.out, self.work = out, work

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    def numel(self) -> int:
        return self.out.numel()


def issue_all_gather(x: torch.Tensor, n: int, group_name: str):
    """Issue the all-gather of ``x`` along dim 0 over the ``n`` ranks of the group named
    ``group_name`` and return its handle *not waited*: read it only through `waited`.
    funcol's own all-gather waits at once when traced (``_maybe_wrap_tensor``), putting
    every wait right after its collective in a compiled graph; the raw functional op
    leaves the wait where the caller puts it, eager and traced alike, so a collective
    issued ahead (fsdp's prefetch) is issued ahead in the compiled graph too.

    Eager on CPU the handle is a `Pending` from c10d's ``all_gather_single``, not the
    functional op: on gloo the functional op runs as an ``allgather_into_tensor_coalesced``
    work, and two of those in flight at once corrupt the heap (torch 2.13; glibc aborts
    with "malloc(): unaligned tcache chunk detected" or "double free" within a few hundred
    fsdp training steps; ``tests/test_collectives_inflight.py`` says how often, and checks
    this path). c10d's plain all-gather work has no such fault."""
    if _eager_cpu(x):
        return Pending(*_c10d_all_gather(x, n, c10d._resolve_process_group(group_name), async_op=True))
    return torch.ops._c10d_functional.all_gather_into_tensor(x, n, group_name)


def waited(t) -> torch.Tensor:
    """The result of `issue_all_gather`, once the collective has finished."""
    if isinstance(t, Pending):
        t.work.wait()
        return t.out
    return torch.ops._c10d_functional.wait_tensor(t)


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    return _done(_funcol().all_reduce(x, op, group))


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    sent = x.movedim(dim, 0).contiguous()
    if _eager_cpu(sent):  # see `issue_all_gather`
        out, _ = _c10d_all_gather(sent, dist.get_world_size(group), group, async_op=False)
    else:
        out = _done(_all_gather_dim0()(sent, 0, group))
    return out.movedim(0, dim)


def all_to_all(x: torch.Tensor, group, n: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    chunks = x.movedim(split_dim, 0).unflatten(0, (n, -1)).contiguous()  # (n, chunk, ...)
    out = _done(_funcol().all_to_all_single(chunks.flatten(0, 1), None, None, group))
    out = out.unflatten(0, (n, -1)).movedim(1, split_dim + 1)  # (n, ..., chunk at split_dim, ...)
    return out.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


def permute(x: torch.Tensor, group, n: int, index: int, shift: int) -> torch.Tensor:
    """Send ``x`` to rank ``index + shift`` of the group (mod ``n``) and return what rank
    ``index - shift`` sent: one neighbour-to-neighbour pass of a ring. Written as an
    all-to-all whose splits send everything to one peer (``funcol`` has no send/recv, and
    this form traces under torch.compile; on NCCL it lowers to one send and one recv)."""
    flat = x.contiguous().view(-1)
    m, dst, src = flat.numel(), (index + shift) % n, (index - shift) % n
    sends = [m if r == dst else 0 for r in range(n)]
    receives = [m if r == src else 0 for r in range(n)]
    return _done(_funcol().all_to_all_single(flat, receives, sends, group)).view(x.shape)


def forward_ad_active() -> bool:
    """True while forward-mode AD is recording: a ``torch.autograd.forward_ad`` dual
    level, or a ``torch.func.jvp`` / ``jacfwd`` transform on the functorch stack."""
    if torch.compiler.is_compiling():
        return False
    if forward_ad._current_level >= 0:
        return True
    stack = torch._C._functorch.get_interpreter_stack() or ()
    jvp = torch._C._functorch.TransformType.Jvp
    return any(i.key() == jvp for i in stack)


def _front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    """The vmapped ``x`` with its batch dim in front (a size-1 one when unbatched)."""
    return x.unsqueeze(0) if bdim is None else x.movedim(bdim, 0)


# ----------------------------------------------------------------------------- the rules


class Psum(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(x, group):
        return all_reduce(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g, None

    @staticmethod
    def vmap(info, in_dims, x, group):
        return psum(x, group), in_dims[0]


class Pvary(torch.autograd.Function):
    """Identity forward; all-reduce (sum) backward."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return psum(g, ctx.group), None

    @staticmethod
    def vmap(info, in_dims, x, group):
        return pvary(x, group), in_dims[0]


class AllGather(torch.autograd.Function):
    """All-gather along ``dim`` forward; this rank's slice (``index``) backward."""

    @staticmethod
    def forward(x, group, dim, index):
        return all_gather(x, group, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.group, ctx.dim, ctx.index = inputs
        ctx.chunk = x.shape[ctx.dim]

    @staticmethod
    def backward(ctx, g):
        return g.narrow(ctx.dim, ctx.index * ctx.chunk, ctx.chunk), None, None, None

    @staticmethod
    def vmap(info, in_dims, x, group, dim, index):
        return gather(_front(x, in_dims[0]), group, dim + 1, index), 0


class AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all forward; the reverse all-to-all backward."""

    @staticmethod
    def forward(x, group, n, split_dim, concat_dim):
        return all_to_all(x, group, n, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.n, ctx.split_dim, ctx.concat_dim = inputs

    @staticmethod
    def backward(ctx, g):
        return swap(g, ctx.group, ctx.n, ctx.concat_dim, ctx.split_dim), None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, group, n, split_dim, concat_dim):
        return swap(_front(x, in_dims[0]), group, n, split_dim + 1, concat_dim + 1), 0


class Permute(torch.autograd.Function):
    """Ring pass by ``shift`` forward; the pass back (by ``-shift``) backward."""

    @staticmethod
    def forward(x, group, n, index, shift):
        return permute(x, group, n, index, shift)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.n, ctx.index, ctx.shift = inputs

    @staticmethod
    def backward(ctx, g):
        return ppermute(g, ctx.group, ctx.n, ctx.index, -ctx.shift), None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, group, n, index, shift):
        return ppermute(_front(x, in_dims[0]), group, n, index, shift), 0


class _PsumJvp(Psum):
    @staticmethod
    def jvp(ctx, tx, _):
        return psum(tx, ctx.group)


class _PvaryJvp(Pvary):
    @staticmethod
    def jvp(ctx, tx, _):
        return tx


class _AllGatherJvp(AllGather):
    @staticmethod
    def jvp(ctx, tx, *_):
        return gather(tx, ctx.group, ctx.dim, ctx.index)


class _AllToAllJvp(AllToAll):
    @staticmethod
    def jvp(ctx, tx, *_):
        return swap(tx, ctx.group, ctx.n, ctx.split_dim, ctx.concat_dim)


class _PermuteJvp(Permute):
    @staticmethod
    def jvp(ctx, tx, *_):
        return ppermute(tx, ctx.group, ctx.n, ctx.index, ctx.shift)


# ----------------------------------------------------------------------------- entry points


def _needs_rules(x: torch.Tensor) -> bool:
    """Whether ``x`` takes part in differentiation (reverse or forward mode) or is a
    ``torch.func`` wrapper (vmap, grad, jvp): only then is the Function worth its cost."""
    if torch.is_grad_enabled() and x.requires_grad:
        return True
    if torch.compiler.is_compiling():  # traced inference: the plain collective, as before
        return False
    return torch._C._functorch.is_functorch_wrapped_tensor(x) or forward_ad_active()


def _fn(plain, with_jvp):
    return with_jvp if forward_ad_active() else plain


def psum(x: torch.Tensor, group) -> torch.Tensor:
    if not _needs_rules(x):
        return all_reduce(x, group)
    return _fn(Psum, _PsumJvp).apply(x, group)


def pvary(x: torch.Tensor, group) -> torch.Tensor:
    if not _needs_rules(x):
        return x
    return _fn(Pvary, _PvaryJvp).apply(x, group)


def gather(x: torch.Tensor, group, dim: int, index: int) -> torch.Tensor:
    if not _needs_rules(x):
        return all_gather(x, group, dim)
    return _fn(AllGather, _AllGatherJvp).apply(x, group, dim, index)


def swap(x: torch.Tensor, group, n: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    if not _needs_rules(x):
        return all_to_all(x, group, n, split_dim, concat_dim)
    return _fn(AllToAll, _AllToAllJvp).apply(x, group, n, split_dim, concat_dim)


def ppermute(x: torch.Tensor, group, n: int, index: int, shift: int) -> torch.Tensor:
    if not _needs_rules(x):
        return permute(x, group, n, index, shift)
    return _fn(Permute, _PermuteJvp).apply(x, group, n, index, shift)
