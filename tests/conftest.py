import importlib.metadata
import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Intra-op threads: the cores divided among the xdist workers (one each for `-n 2` on two
# cores), unless OMP_NUM_THREADS is set. Each worker's default, a thread per core, puts
# twice as many spinning OpenMP threads as cores on the machine, and on these tiny ops
# that oversubscription measured 121 s against 67 s of wall time for test_sample,
# test_lora_per_item and test_notebooks under `-n 2` on 2 cores. Set in the environment
# before torch starts its pool, so the subprocesses a test starts (CLI runs, servers,
# notebook kernels, torchrun ranks) inherit it.
if "PYTEST_XDIST_WORKER" in os.environ:  # a worker (one process without xdist keeps torch's default)
    _WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def pytest_terminal_summary(terminalreporter):
    """The versions this run resolved (a fresh environment takes the newest releases),
    printed even under ``-q``, just above the final counts."""
    names = ("torch", "diffusers", "transformers", "safetensors", "optree", "pytest", "hypothesis", "ruff")
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    terminalreporter.write_line("packages: " + ", ".join(versions))


# The slowest tests (multi-rank spawns, compiles; from `pytest --durations`), started
# first so that under ``-n 2`` no worker is left running one of them alone at the end.
SLOW_FIRST = (
    "test_sharding_ring.py::test_ring_and_usp_equal_one_process",
    "test_controlnet_dist.py::test_sharded_controlnet_equals_one_process",
    "test_adapter_dropin.py::test_pyramid_attention_broadcast_equals_stock",
    "test_layerwise_casting.py::test_shard_params_keeps_fp8_storage",
    "test_fsdp.py::test_fsdp_equals_one_process",
    "test_fsdp_compile.py::test_compiled_fsdp_equals_eager",
    "test_train_lora.py::test_torchrun_fsdp2_learns_resumes_bitwise_and_writes_a_file_diffusers_loads",
    "test_fsdp_lora.py::test_lora_on_the_fly_fsdp2_tp2",
    "test_serve_tp.py::test_tp2_server_answers_and_a_killed_rank_is_a_503_and_a_nonzero_exit",
    "test_serve_tp.py::test_dp2_groups_run_concurrent_requests_and_a_killed_rank_is_a_503",
    "test_serve_tp.py::test_sp2_server_with_a_step_cache_answers_and_a_killed_rank_is_a_503",
    "test_serve_xla_tp.py::test_tp2_fixed_backend_equals_fd_sample_and_drains",
    "test_serve_xla_tp.py::test_sp2_fixed_backend_equals_fd_sample_and_drains",
    "test_serve_xla_tp.py::test_dp2_fixed_backend_groups_and_metrics_summed_over_groups",
    "test_grad_sharded.py::test_compiled_backward_equals_eager",
    "test_dcp.py::test_dcp_save_tp2_load_on_1_rank_tp2_and_tp2_sp2",
    "test_compile.py::test_sharded_compile_has_zero_graph_breaks",
    "test_sample_many.py::test_dp2_tp2_equals_tp2",
    "test_generate_many.py::test_prompts_run_killed_and_resumed",
    "test_grad_sharded.py::test_sharded_grads_equal_unsharded",
    "test_sharding.py::test_two_ranks_collectives_shard_map_and_shard_params",
    "test_cache.py::test_bench_cache_rows",
    "test_notebooks.py::test_notebook_executes",
    "test_weights_commit.py::test_sigkill_of_a_real_save_process",
    "test_cli.py::test_demo_shortened_writes_pngs_a_table_and_nothing_else_on_stderr",
    "test_dcp.py::test_finetune_example_resumes_from_dcp",
    "test_grad_sharded.py::test_finetune_example_tp2",
    "test_cli.py::test_check_on_cpu_compiles_without_recompiling",
    "test_sharding_models.py::test_sharded_equals_unsharded",
    "test_sharding.py::test_a_rank_that_raises_mid_forward",
    "test_func_transforms.py::test_sharded_jvp_and_vmap",
    "test_sample_many.py::test_distinct_prompts_over_dp2",
    "test_sharding_flux3_qwen21.py::test_sharded_equals_unsharded_and_grads",
    "test_lora_per_item.py::test_tp2_sp2_dp2_equal_single_process",
    "test_quantize.py::test_tp2_and_sp2_equal_one_quantized_process",
)


# The `slow` marker (``pytest -m "not slow"``: the quick subset, README): every test of
# these modules (multi-rank, compile, export, notebooks, XLA, killed processes), every
# test in SLOW_FIRST, and every test whose own code spawns ranks or processes or compiles.
SLOW_MODULES = (
    "test_adapter_dist.py", "test_checkpoint_dist.py", "test_compile.py", "test_dcp.py", "test_dist_harness.py",
    "test_export.py", "test_grad_sharded.py", "test_lora_dist.py", "test_notebooks.py", "test_sample_image_ranks.py",
    "test_sample_many.py", "test_sample_xla.py", "test_sample_xla_image.py", "test_sharding.py",
    "test_sharding_flux3_qwen21.py", "test_sharding_models.py", "test_weights_commit.py", "test_weights_dist.py",
)  # fmt: skip
SLOW_CALLS = ("spawn(", "torch.distributed.run", "subprocess.", "torch.compile(")


def _slow(item, node: str) -> bool:
    if node.split("::")[0] in SLOW_MODULES or node.startswith(SLOW_FIRST):
        return True
    try:
        source = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False
    return any(call in source for call in SLOW_CALLS)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        node = item.nodeid.split("/")[-1]
        return next((i for i, prefix in enumerate(SLOW_FIRST) if node.startswith(prefix)), len(SLOW_FIRST))

    for item in items:
        if _slow(item, item.nodeid.split("/")[-1]):
            item.add_marker(pytest.mark.slow)
    items.sort(key=rank)  # stable: the rest keep their order
