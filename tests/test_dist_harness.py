"""`_dist.spawn` itself: ranks fork from a warm forkserver yet behave like fresh `spawn`
children of the caller (its environment, working directory and ``sys.path`` now, one
intra-op thread, their own process and gloo group) and their output reaches the test."""

import os
import sys

import _dist
import torch
from _dist import spawn


def _probe(rank, world, parent):
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    print(f"hello from rank {rank}")
    return dict(
        env=os.environ.get("FD_DIST_PROBE"),
        rank_env=(os.environ["RANK"], os.environ["WORLD_SIZE"]),
        cwd=os.getcwd(),
        path=sys.path[:],
        threads=torch.get_num_threads(),
        pid=os.getpid(),
        not_the_caller=os.getpid() != parent and os.getppid() != parent,
        preloaded="_warm" in sys.modules and "diffusers.pipelines.flux.pipeline_flux" in sys.modules,
        reduced=t.item(),
    )


def test_ranks_see_the_callers_state_and_fork_from_a_preloaded_server(tmp_path, monkeypatch, capfd):
    _dist._context()  # the server may already run, started with an older environment and cwd
    monkeypatch.setenv("FD_DIST_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = spawn(_probe, 2, os.getpid(), timeout=300)
    for rank, r in enumerate(ranks):
        assert r["env"] == "set after the server started"
        assert r["rank_env"] == (str(rank), "2")
        assert r["cwd"] == str(tmp_path)
        assert r["path"] == sys.path
        assert r["threads"] == 1
        assert r["not_the_caller"]
        assert r["preloaded"], "the forkserver did not import tests/_warm.py: every rank imports from scratch"
        assert r["reduced"] == 3.0  # 1 + 2 over the ranks' own gloo group
    assert ranks[0]["pid"] != ranks[1]["pid"]
    err = capfd.readouterr().err
    assert "--- rank 0 output:\nhello from rank 0" in err and "hello from rank 1" in err
