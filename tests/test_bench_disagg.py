"""bench/disagg.py on CPU: its checkpoint loads as a model whose tensors are the seeded
draws, and the script's CPU mode (prefill TP2 -> decode DP2 on Ray rank actors, toy
dimensions) finds the layout's greedy tokens equal to the single engine's and reports the
load figures and the KV that moved."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
import disagg  # noqa: E402
import disagg_checkpoint  # noqa: E402
from multi_gpu_model import TINY  # noqa: E402

from phalanx.models.loader import read_model_config  # noqa: E402
from phalanx.models.random_weights import tensor_seed  # noqa: E402


def test_checkpoint_is_a_model_folder_of_seeded_draws(tmp_path):
    cfg = dict(TINY, num_hidden_layers=2, dtype="float32")
    folder, nbytes = disagg_checkpoint.write_checkpoint(tmp_path, cfg, seed=5,
                                                        device=torch.device("cpu"))
    model = read_model_config(folder)
    assert (model.num_hidden_layers, model.num_experts) == (2, TINY["num_experts"])
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert shards == ["layer-000.safetensors", "layer-001.safetensors", "outer.safetensors"]
    tensors = {k: v for p in folder.glob("*.safetensors") for k, v in load_file(p).items()}
    assert sum(t.nbytes for t in tensors.values()) == nbytes
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    gen = torch.Generator().manual_seed(tensor_seed(5, name))
    draw = torch.randn(tensors[name].shape, generator=gen) / tensors[name].shape[-1] ** 0.5
    assert torch.equal(tensors[name], draw)
    assert not torch.equal(tensors[name], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])


def test_cpu_run_checks_tokens_and_reports_the_load(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "disagg.py"), "--device", "cpu",
                           "--tiny", "--batches", "2,3", "--timeout-s", "240"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check float32: greedy tokens vs single engine: PASS" in proc.stdout
    result = json.loads((tmp_path / "disagg.json").read_text())
    assert result["check"]["float32"]["equal"]
    assert sorted(result["load"]) == ["2", "3"]
    for batch, fig in result["load"].items():
        assert fig["requests"] == 2 * int(batch)
        assert fig["ttft_ms_median"] > 0 and fig["prefill_tok_s_per_gpu"] > 0
    kv = result["kv_receivers"]
    assert kv["rejected"] == 0 and kv["conn_lost"] == 0
    # every prompt's KV landed once: the check's prompts and the load's, per token
    # 2 layers x (K, V) x 2 heads x 16 x 4 bytes
    args = disagg.parse_args(["--device", "cpu", "--tiny"])
    check = disagg.make_prompts(args.check_prompts, 16, 200, TINY["vocab_size"], args.seed)
    tokens = sum(map(len, check)) + 2 * (2 + 3) * args.ctx
    assert kv["bytes"] == tokens * 2 * 2 * 2 * 16 * 4


def _run(times, finished=None):
    return {"times": times, "finished": finished, "tokens": [0] * len(times), "submit": 0.0}


def test_decode_window_waits_for_every_request_then_times_them_together():
    # b's first token comes last (t=5): the window opens there and closes once both have
    # two more tokens (a at 7, b at 8)
    runs = {"a": _run([1, 2, 3, 6, 7, 9]), "b": _run([5, 6])}
    assert disagg.decode_window(runs, 2) is None  # b is one token short and unfinished
    runs["b"] = _run([5, 6, 8])
    assert disagg.decode_window(runs, 2) == (5, 8, True)
    runs["c"] = _run([], None)
    assert disagg.decode_window(runs, 2) is None  # c has no first token yet
    # a request that finishes inside the window closes it early, flagged incomplete
    runs = {"a": _run([1, 2, 6, 7], finished=7), "b": _run([5, 6, 8, 9])}
    assert disagg.decode_window(runs, 3) == (5, 7, False)
    fig = disagg.load_figures({k: dict(r, prompt=10) for k, r in runs.items()}, 3, 2, 1)
    assert fig["window_tokens"] == 3 and fig["decode_tok_s_per_gpu"] == 3 / 2 / 2
    assert fig["ttft_ms_median"] == 3000 and fig["prefill_tok_s_per_gpu"] == 20 / 5
