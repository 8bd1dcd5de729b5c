"""Shared fixtures: tiny checkpoints built once per session into a temp folder."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# The checkout is the `phalanx` package itself (installed editable). As a path entry
# (`python -m pytest` puts the working directory first) its rooms would shadow top-level
# packages of the same name: `kernels` is also Hugging Face's kernel hub, which
# transformers (the oracle) imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# Keep the default-model cache of the test run out of the user's home folder; a folder
# made here is the run's own and goes when the run ends (a given PHALANX_CACHE_DIR stays).
if "PHALANX_CACHE_DIR" not in os.environ:
    os.environ["PHALANX_CACHE_DIR"] = tempfile.mkdtemp(prefix="phalanx-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PHALANX_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402

try:
    import torch  # noqa: E402
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


# Modules whose tests start processes (Ray rank actors, spawned ranks, servers, bench
# scripts) or run Triton's interpreter at length: marked `slow`, so that
# `pytest -m "not slow"` is the fast tier (pure logic, single-rank engine, in-process
# server). CI runs everything.
SLOW_MODULES = frozenset({
    "test_bench_disagg", "test_bench_kv_transfer", "test_bench_multi_gpu", "test_bench_ucx",
    "test_chaos_cli", "test_chaos_injectors", "test_comm_dispatch", "test_disagg", "test_groups",
    "test_kernel_resources", "test_kernels_triton", "test_kv_slab_copy", "test_kv_transport",
    "test_optional_triton", "test_peer_exchange", "test_rank_kills", "test_sdk_local", "test_serve",
    "test_serve_multinode", "test_server_aiperf", "test_shm_agreement", "test_shm_broadcast",
    "test_shm_collectives",
})


def pytest_collection_finish(session):
    """The background jobs of the selected tests' modules start (`background_jobs`)."""
    import background_jobs

    files = [str(item.path) for item in session.items]
    background_jobs.start(list(dict.fromkeys(files)))


def pytest_sessionfinish(session, exitstatus):
    import background_jobs

    background_jobs.stop()


def pytest_collection_modifyitems(config, items):
    import background_jobs

    # Modules whose fixtures run in the background go last (in their order): their jobs
    # then have the whole run's idle cores before anything waits on them.
    ahead = background_jobs.SESSION.module_files()
    items.sort(key=lambda item: str(item.path) in ahead)
    slow = pytest.mark.slow
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(slow)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Builds a tiny checkpoint of each supported family on first use: kind -> folder."""
    from phalanx.models.tiny import build_variant

    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = str(build_variant(root / kind, kind, seed=0))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_model(model_dirs) -> str:
    return model_dirs("qwen3_moe")


@pytest.fixture(autouse=True, scope="module")
def _no_ray_after_the_module():
    """A module whose tests start Ray in this process (a multi-rank `LLM` or client)
    leaves none running for the next module (which may start its own, or need none)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def local_ray():
    """A fresh local Ray for one test module (never another cluster on this machine)."""
    import ray

    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
async def client(server):
    """The official OpenAI client on the module's `server` fixture (a served app without
    an API key); a module whose server takes a key defines its own."""
    from app_server import openai_client

    async with openai_client(server) as c:
        yield c
