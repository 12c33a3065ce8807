"""Shared fixtures: one persistent gloo rank pool per world size (started once, reused by every test), and megatron's
model-parallel state over this process's GPU for GPU tests that run in-process."""

import os

import pytest
import torch

from megatron_muon.testing import RankPool

_pools: dict[int, RankPool] = {}
_started_world_sizes: list[int] = []


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _pools[world_size] = RankPool(world_size)
        _started_world_sizes.append(world_size)
    return pool


@pytest.fixture
def rank_pool_1() -> RankPool:
    return _pool(1)


@pytest.fixture
def rank_pool_2() -> RankPool:
    return _pool(2)


@pytest.fixture
def rank_pool_4() -> RankPool:
    return _pool(4)


@pytest.fixture(autouse=True)
def _transformer_engine_attention_environment():
    """Megatron's model build exports its attention backend to TE's NVTE_* variables for the whole process, and a
    later build with another backend asserts on them; each test starts from the environment the session had."""
    saved = {key: value for key, value in os.environ.items() if key.startswith("NVTE_")}
    yield
    for key in [key for key in os.environ if key.startswith("NVTE_")]:
        if key not in saved:
            del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="module")
def single_gpu_model_parallel():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """State in the log which gloo world sizes really ran (CI must show 2 and 4 ranks)."""
    if _started_world_sizes:
        sizes = ", ".join(str(size) for size in sorted(set(_started_world_sizes)))
        terminalreporter.write_line(f"gloo rank pools started for world sizes: {sizes}")


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def pytest_collection_modifyitems(config, items):
    """GPU tests run on the GPU machine; here they are skipped with the reason stated."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip_gpu)
