"""KV staging memory is kept out of the KV pool: the arithmetic, the per-role reservation
of the disaggregated layout, and the pool sizing around it (no GPU needed)."""

import pytest

from phalanx.actors.disagg_client import with_staging
from phalanx.config import CacheConfig, EngineConfig, ModelConfig
from phalanx.engine.kv_memory import ACTIVATION_RESERVE, pages_within
from phalanx.kv_transfer.transport.staging_memory import (CPU_MESSAGE_BYTES, GPU_MESSAGE_BYTES,
                                                STAGING_BUFFERS, staging_bytes)

GIB = 1 << 30
MODEL = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    intermediate_size=64)


def test_staging_bytes_per_connection_and_device():
    assert staging_bytes(0, "cuda") == 0
    assert staging_bytes(4, "cuda:1") == 4 * STAGING_BUFFERS * GPU_MESSAGE_BYTES
    assert staging_bytes(2, "cpu") == 2 * STAGING_BUFFERS * CPU_MESSAGE_BYTES
    with pytest.raises(ValueError, match="connections"):
        staging_bytes(-1, "cuda")


def test_each_role_reserves_for_the_connections_it_holds():
    base = EngineConfig(model_path="unused", model=MODEL, device="cuda")
    prefill = with_staging(base, 8)  # a prefill rank streams to decode DP4 x TP2
    decode = with_staging(base, 4)  # a decode rank hears from 2 instances of TP2
    assert prefill.cache.kv_staging_bytes == staging_bytes(8, "cuda") == 6 * GIB
    assert decode.cache.kv_staging_bytes == staging_bytes(4, "cuda") == 3 * GIB
    assert base.cache.kv_staging_bytes == 0  # the caller's config is left as it was
    given = EngineConfig(model_path="unused", model=MODEL, device="cuda",
                         cache=CacheConfig(kv_staging_bytes=GIB))
    assert with_staging(given, 8).cache.kv_staging_bytes == GIB  # an explicit value wins


def test_pool_is_sized_around_activations_and_staging():
    page = 1 << 20
    budget = 20 * GIB
    plain = pages_within(budget, CacheConfig(), page, free=0, total=0)
    assert plain == (budget - ACTIVATION_RESERVE) // page
    staged = pages_within(budget, CacheConfig(kv_staging_bytes=3 * GIB), page, free=0, total=0)
    assert plain - staged == 3 * GIB // page
    with pytest.raises(ValueError, match="3.0 GiB for KV staging"):
        pages_within(ACTIVATION_RESERVE + 2 * GIB, CacheConfig(kv_staging_bytes=3 * GIB), page,
                     free=GIB, total=8 * GIB)


@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
def test_staging_bytes_must_be_a_count_of_bytes(bad):
    with pytest.raises(ValueError, match="kv_staging_bytes"):
        CacheConfig(kv_staging_bytes=bad)
