"""bench/multi_gpu.py on CPU: shard weights are slices of the full model, the per-peer
all-to-all bytes and the file barrier, and the script's CPU mode (2 or 4 gloo ranks + one
single-rank process, toy dimensions) runs every phase and finds the DPN x EPN greedy
tokens equal to the single-rank engine's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from phalanx.models.shard import ModelShard

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
_spec = importlib.util.spec_from_file_location("multi_gpu_model", os.path.join(BENCH, "multi_gpu_model.py"))
mm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mm)
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # the bench modules import each other by plain name
import multi_gpu_moe  # noqa: E402
import multi_gpu_procs  # noqa: E402


class _TPComm:
    def __init__(self, rank: int, size: int) -> None:
        self.tp_rank, self.tp_size = rank, size


def test_shard_weights_are_slices_of_the_full_model():
    cfg = mm.model_config(tiny=True, layers=2, dtype="float32")
    cpu = torch.device("cpu")
    full = mm.build_model(cfg, ModelShard(), cpu, torch.float32, seed=3)
    ep_shard = mm.build_model(cfg, ModelShard(0, 1, (4, 5, 6, 7)), cpu, torch.float32, seed=3)
    tp_shard = mm.build_model(cfg, ModelShard(1, 2, (4, 5, 6, 7)), cpu, torch.float32, seed=3,
                              comm=_TPComm(1, 2))
    hd, h = cfg.head_dim, cfg.hidden_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    assert torch.equal(ep_shard.embed_tokens, full.embed_tokens)
    v = cfg.vocab_size // 2
    assert torch.equal(tp_shard.lm_head, full.lm_head[v:])
    for f, e, t in zip(full.layers, ep_shard.layers, tp_shard.layers):
        assert torch.equal(e.attn.qkv_proj, f.attn.qkv_proj)
        assert torch.equal(e.mlp.w13, f.mlp.w13[4:]) and torch.equal(e.mlp.w2, f.mlp.w2[4:])
        assert torch.equal(t.mlp.w13, f.mlp.w13[4:]) and torch.equal(t.mlp.gate, f.mlp.gate)
        q, k, vv = f.attn.qkv_proj.split([nq, nkv, nkv])
        want = torch.cat([q[nq // 2:], k[nkv // 2:], vv[nkv // 2:]])
        assert torch.equal(t.attn.qkv_proj, want)
        assert torch.equal(t.attn.o_proj, f.attn.o_proj[:, nq // 2:])
        assert t.attn.o_proj.shape == (h, nq // 2)
    other = mm.build_model(cfg, ModelShard(), cpu, torch.float32, seed=4)
    assert not torch.equal(other.layers[0].mlp.w13, full.layers[0].mlp.w13)


def test_wire_bytes_per_peer():
    # rank 1 of 3: sends 2 / 3 / 4 pairs to ranks 0 / 1 / 2 and gets 5 / 3 / 1 rows back
    w = multi_gpu_moe._wire_bytes([2, 3, 4], [5, 3, 1], row_bytes=100, rank=1)
    assert w["bytes_to_peer"] == [8 + 2 * 116 + 5 * 100, 0, 8 + 4 * 116 + 1 * 100]
    assert w["bytes_from_peer"] == [8 + 5 * 116 + 2 * 100, 0, 8 + 1 * 116 + 4 * 100]
    assert w["pairs_to_peer"] == [2, 0, 4] and (w["pairs_sent"], w["rows_received"]) == (9, 9)
    # the same total as before the per-peer split: rows to / from the others, counts
    assert w["bytes_to_peers"] == 6 * 116 + 6 * 100 + 8 * 2


def test_file_barrier_waits_for_every_rank(tmp_path):
    opts = {"rdv_dir": str(tmp_path)}
    left = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        multi_gpu_procs.file_barrier(opts, "b", r, 3, timeout_s=10)
        left[r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r, 0.3 * (r == 2))) for r in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(left) == [0, 1, 2] and min(left.values()) - t0 >= 0.3
    with pytest.raises(TimeoutError):
        multi_gpu_procs.file_barrier(opts, "lonely", 0, 2, timeout_s=0.2)


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_mode_runs_every_phase(tmp_path, world):
    env = dict(os.environ, OUT=str(tmp_path))
    cmd = [sys.executable, os.path.join(BENCH, "multi_gpu.py"), "--device", "cpu", "--tiny",
           "--world", str(world),
           "--check-dtypes", "float32", "--batches", "2", "--steps", "2", "--prefill", "2x32",
           "--moe-iters", "2", "--timeout-s", "150"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("check float32:")]
    assert len(verdict) == 1 and ": PASS;" in verdict[0], proc.stdout[-3000:]
    res = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert not res["errors"]
    assert res["check"]["float32"]["equal"]
    assert [r["batch_per_rank"] for r in res["decode"]] == [2]
    assert res["decode"][0]["tok_s_per_gpu"] > 0 and res["decode"][0]["single_eager_tok_s"] > 0
    moe = res["moe"][0]
    for key in ("moe_us", "dispatch_combine_us", "a2a_groupcomm_us", "a2a_nccl_us", "experts_us"):
        assert moe[key] > 0, key
    assert res["prefill"][0]["shape"] == "2x32" and res["prefill"][0]["single_tok_s"] > 0
    lay = res["layout"]
    assert (lay["decode"], lay["prefill"]) == (f"DP{world}xEP{world}", f"TP{min(world, 4)}")
    assert lay["experts_per_rank"] == [8 // world] * world  # tiny: 8 experts
    assert len(res["check"]["float32"]["prompts"]) == 4
    for r in range(world):
        per_peer = res["raw"]["ranks"][str(r)]["moe"][0]["bytes_to_peer"]
        assert len(per_peer) == world and per_peer[r] == 0
    assert f"decode DP{world}xEP{world} " in proc.stdout and f"prefill TP{min(world, 4)} " in proc.stdout
