"""Row-parallel sums whose bits do not depend on the TP width (models/row_parallel.py).

The TP ranks here are threads over one process (a barrier-backed comm that sums in rank
order, as the shared-memory channel does), so a TP2 and a TP4 shard of the tiny model run
their real forward, collectives included, in milliseconds; the layouts over Ray are
checked end to end in tests/test_disagg.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from phalanx.engine.kv_memory import allocate_kv_cache
from phalanx.kernels.attention import AttentionMetadata
from phalanx.kernels.moe import fused_expert_pairs, fused_experts_ref, make_expert_map, sum_slots
from phalanx.models.checkpoint import Checkpoint
from phalanx.models.loader import read_model_config
from phalanx.models.qwen3_moe import CausalLM
from phalanx.models.row_parallel import check_leaves, layout_width, pairwise_sum
from phalanx.models.shard import ModelShard
from phalanx.models.weights import load_weights


class ThreadComm:
    """TP rank `rank` of `size` threads: sums in rank order, gathers in rank order."""

    def __init__(self, rank: int, size: int, board: list, barrier: threading.Barrier) -> None:
        self.tp_rank, self.tp_size, self._board, self._barrier = rank, size, board, barrier

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._board[self.tp_rank] = t.clone()
        self._barrier.wait()
        parts = list(self._board)
        self._barrier.wait()
        return parts

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        acc = parts[0].clone()
        for p in parts[1:]:
            acc += p
        return t.copy_(acc)

    def all_gather_tp(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=dim)


def _prefill_metadata(n: int, page_size: int = 16) -> AttentionMetadata:
    pages = -(-n // page_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64), max_query_len=n, max_seq_len=n)


def _logits(folder: str, tp: int, width: int, dtype: torch.dtype, ids: torch.Tensor,
            device: str = "cpu") -> torch.Tensor:
    """The prompt's logits [T, vocab] from a TP `tp` group of threads."""
    cfg = read_model_config(folder)
    board, barrier, out = [None] * tp, threading.Barrier(tp), [None] * tp

    def rank(r: int) -> None:
        experts = tuple(range(r, cfg.num_experts, tp)) if tp > 1 else None
        model = CausalLM(cfg, ModelShard(r, tp, experts), ThreadComm(r, tp, board, barrier), None, width)
        load_weights(model, Checkpoint(folder))
        model = model.to(device=device, dtype=dtype).eval()
        caches = allocate_kv_cache(model, 8, 16, dtype, torch.device(device))
        meta = _prefill_metadata(len(ids))
        meta = AttentionMetadata(*(getattr(meta, f).to(device) for f in (
            "query_start_loc", "seq_lens", "block_tables", "slot_mapping")),
            meta.max_query_len, meta.max_seq_len)
        with torch.inference_mode():
            hidden = model(ids.to(device), torch.arange(len(ids), device=device), caches, meta)
            out[r] = model.compute_logits(hidden).cpu()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(o is not None for o in out), "a rank thread failed"
    for o in out[1:]:
        assert torch.equal(o, out[0])
    return out[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp1_tp2_and_tp4_give_the_same_bits_at_width_4(tiny_model, dtype):
    ids = torch.arange(3, 40) * 7 % 1000
    one = _logits(tiny_model, 1, 4, dtype, ids)
    assert torch.equal(_logits(tiny_model, 2, 4, dtype, ids), one)
    assert torch.equal(_logits(tiny_model, 4, 4, dtype, ids), one)
    # the plain all-reduce's bits follow the width (else this test would prove nothing)
    plain = [_logits(tiny_model, tp, 1, dtype, ids) for tp in (1, 2)]
    assert not torch.equal(plain[0], plain[1])
    torch.testing.assert_close(one.float(), plain[0].float(), rtol=0.05, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_in_the_batch_invariant_mode_too(tiny_model, dtype):
    """The mode's GEMM per leaf (float32 out) and the experts' per-pair output
    (kernels/gpu/moe.py) give TP1 and TP2 the same bits; without the width they differ."""
    from phalanx.kernels.batch_invariant import batch_invariant

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ids = torch.arange(3, 60) * 7 % 1000
    with batch_invariant(True):
        one = _logits(tiny_model, 1, 2, dtype, ids, "cuda")
        assert torch.equal(_logits(tiny_model, 2, 2, dtype, ids, "cuda"), one)
        plain = [_logits(tiny_model, tp, 1, dtype, ids, "cuda") for tp in (1, 2)]
    assert not torch.equal(plain[0], plain[1])


def test_pairwise_sum_is_a_balanced_tree_in_order():
    a, b, c, d = (torch.tensor([x], dtype=torch.float32) for x in (1e8, -1e8, 1.0, 3e-8))
    assert pairwise_sum([a, b, c, d]).item() == ((a + b) + (c + d)).item()
    assert pairwise_sum([a]) is a
    with pytest.raises(ValueError, match="power of two"):
        pairwise_sum([a, b, c])


def test_widths_are_checked_and_chosen_from_the_layout(tiny_model):
    cfg = read_model_config(tiny_model)
    with pytest.raises(ValueError, match="power of two"):
        check_leaves(3, 1, {})
    with pytest.raises(ValueError, match="multiple of tp=4"):
        check_leaves(2, 4, {})
    with pytest.raises(ValueError, match="does not divide k=6"):
        check_leaves(4, 2, {"k": 6})
    assert layout_width(cfg, (2, 1)) == 2
    assert layout_width(cfg, (3,)) == 1
    assert layout_width(cfg, ()) == 1
    with pytest.raises(ValueError, match="tp_invariant_width"):
        CausalLM(cfg, ModelShard(0, 2), ThreadComm(0, 2, [None] * 2, threading.Barrier(2)), None, 1 << 20)


def test_config_takes_the_width_and_fp8_takes_one(tiny_model):
    from phalanx.llm import engine_config

    assert engine_config(tiny_model).tp_invariant_width == 0
    assert engine_config(tiny_model, tp_invariant_width=2).tp_invariant_width == 2
    assert engine_config(tiny_model, quantization="fp8").tp_invariant_width == 1
    with pytest.raises(ValueError, match="tp_invariant_width"):
        engine_config(tiny_model, quantization="fp8", tp_invariant_width=2)
    with pytest.raises(ValueError, match="tp_invariant_width"):
        engine_config(tiny_model, tp_invariant_width=3)
    with pytest.raises(ValueError, match="tp_invariant_width"):
        engine_config(tiny_model, tp=4, tp_invariant_width=2)


def test_expert_pairs_summed_in_slot_order_are_the_experts_bits():
    """Each (token, slot) output is nonzero on the one rank holding its expert, so the
    ranks' pairs add exactly; their slot-order sum is one rank's combine."""
    g = torch.Generator().manual_seed(7)
    E, H, I, T, k = 8, 32, 16, 11, 3
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 4).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 4).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    whole = fused_experts_ref(x, weights, ids, w13, w2)
    spread = torch.zeros(T, k, H, dtype=x.dtype)
    for rank in range(2):
        local = tuple(range(rank, E, 2))
        spread += fused_expert_pairs(x, weights, ids, w13[list(local)], w2[list(local)],
                                     make_expert_map(E, local))
    assert torch.equal(sum_slots(spread, x.dtype), whole)
    assert fused_expert_pairs(x[:0], weights[:0], ids[:0], w13, w2).shape == (0, k, H)
