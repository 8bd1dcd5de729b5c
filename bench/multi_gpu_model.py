"""Helpers of `bench/multi_gpu.py`: model shapes, deterministic random weights built
straight on the device for any shard, engine configs, a lockstep driver over
`Lockstep.step`, and the byte / FLOP floors.

Weights: every tensor is drawn from its own generator, seeded by a hash of
(seed, canonical parameter name, expert id), in float32 at its *full* (unsharded)
shape on the target device, then sliced to the shard and cast. A rank's experts or TP
slice therefore equal the same slice of the full model built in another process, on
any device of the same kind (CUDA Philox streams do not depend on the device index; CPU
and CUDA streams differ, so a CPU run compares only with CPU runs). Norm weights are 1.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch

from phalanx.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                            SchedulerConfig)
from phalanx.actors.rank import plan as planmod
from phalanx.actors.rank.lockstep import Lockstep
from phalanx.actors.rank.role import RankRole
from phalanx.engine.llm_engine import LLMEngine
from phalanx.actors.rank.spec import RankSpec
from phalanx.engine.sampling_params import SamplingParams
from phalanx.models.qwen3_moe import CausalLM, DenseMLP, SparseMoE
from phalanx.models.shard import ModelShard

# The Qwen3-30B-A3B shape (bench/decode_gpu.py and the probes take it from here).
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="bfloat16")

# CPU debugging preset: the same code paths at toy sizes (TP=2 and EP=2 both divide it).
TINY = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096)

STD = 0.02
PAGE_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def model_config(tiny: bool, layers: Optional[int], dtype: str) -> ModelConfig:
    hf = dict(TINY if tiny else QWEN3_30B_A3B, dtype=dtype)
    if layers:
        hf["num_hidden_layers"] = layers
    return ModelConfig.from_hf(hf)


# ------------------------------------------------------------------ weights

def param_seed(seed: int, name: str, expert: int = -1) -> int:
    """A 63-bit generator seed from (seed, name, expert): stable across processes."""
    digest = hashlib.blake2b(f"{seed}|{name}|{expert}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def full_randn(shape: tuple[int, ...], seed: int, name: str, device: torch.device,
               expert: int = -1) -> torch.Tensor:
    """The canonical full tensor `name` (float32, N(0, STD^2)) on `device`."""
    g = torch.Generator(device=device)
    g.manual_seed(param_seed(seed, name, expert))
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(STD)


@torch.no_grad()
def fill_weights(model: CausalLM, seed: int) -> None:
    """Fill `model` (any shard) with the canonical weights' slices; norms are ones."""
    cfg, shard = model.cfg, model.shard
    dev = model.norm.device
    if cfg.attention_bias or cfg.shared_expert_intermediate_size:
        raise ValueError("bench weights cover Qwen3-MoE shapes only (no biases, no shared expert)")
    h, hd = cfg.hidden_size, cfg.head_dim
    vocab = shard.vocab(cfg)
    rows = slice(vocab.start, vocab.stop)
    model.embed_tokens.copy_(full_randn((cfg.vocab_size, h), seed, "embed_tokens", dev)[rows])
    if not cfg.tie_word_embeddings:
        model.lm_head.copy_(full_randn((cfg.vocab_size, h), seed, "lm_head", dev)[rows])
    model.norm.fill_(1.0)
    qh, kvh = shard.q_heads(cfg), shard.kv_heads(cfg)
    q_rows = slice(qh.start * hd, qh.stop * hd)
    kv_rows = slice(kvh.start * hd, kvh.stop * hd)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        layer.input_norm.fill_(1.0)
        layer.post_attention_norm.fill_(1.0)
        a = layer.attn
        q = full_randn((cfg.num_attention_heads * hd, h), seed, f"{p}.q_proj", dev)[q_rows]
        k = full_randn((cfg.num_key_value_heads * hd, h), seed, f"{p}.k_proj", dev)[kv_rows]
        v = full_randn((cfg.num_key_value_heads * hd, h), seed, f"{p}.v_proj", dev)[kv_rows]
        a.qkv_proj.copy_(torch.cat([q, k, v]))
        a.o_proj.copy_(full_randn((h, cfg.num_attention_heads * hd), seed, f"{p}.o_proj", dev)[:, q_rows])
        if a.q_norm is not None:
            a.q_norm.fill_(1.0)
            a.k_norm.fill_(1.0)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            mlp.gate.copy_(full_randn((cfg.num_experts, h), seed, f"{p}.router", dev))
            inter = cfg.moe_intermediate_size
            for j, e in enumerate(shard.local_experts(cfg)):
                mlp.w13[j].copy_(full_randn((2 * inter, h), seed, f"{p}.experts.w13", dev, e))
                mlp.w2[j].copy_(full_randn((h, inter), seed, f"{p}.experts.w2", dev, e))
        elif isinstance(mlp, DenseMLP):
            cols = shard.cols(cfg.intermediate_size)
            c = slice(cols.start, cols.stop)
            gate = full_randn((cfg.intermediate_size, h), seed, f"{p}.gate_proj", dev)[c]
            up = full_randn((cfg.intermediate_size, h), seed, f"{p}.up_proj", dev)[c]
            mlp.gate_up_proj.copy_(torch.cat([gate, up]))
            mlp.down_proj.copy_(full_randn((h, cfg.intermediate_size), seed, f"{p}.down_proj", dev)[:, c])


def build_model(cfg: ModelConfig, shard: ModelShard, device: torch.device, dtype: torch.dtype,
                seed: int, comm=None, ep=None) -> CausalLM:
    """The shard's modules allocated on `device` in `dtype`, filled by `fill_weights`."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, shard, comm, ep)
    finally:
        torch.set_default_dtype(prev)
    fill_weights(model, seed)
    return model.eval()


def engine_config(cfg: ModelConfig, device: str, dtype: str, max_batch: int, num_pages: int,
                  eager: bool, max_model_len: int = 4096, ep_exchange: str = "exact"
                  ) -> EngineConfig:
    return EngineConfig(
        model_path="<in-memory>", model=cfg, device=device, dtype=dtype,
        parallel=ParallelConfig(ep_exchange=ep_exchange),
        cache=CacheConfig(page_size=PAGE_SIZE, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=16384,
                                  max_model_len=min(max_model_len, cfg.max_position_embeddings)),
        enforce_eager=eager, cuda_graph_max_batch=max_batch)


def pages_for(num_seqs: int, tokens: int) -> int:
    return num_seqs * -(-tokens // PAGE_SIZE) + 16


# ------------------------------------------------------------------ stepping

class Stepper:
    """One step of a rank (`Lockstep.step`: plan sharing, DP agreement, dummy steps, the
    leader scheduling as `Rank` does) or of the single-rank engine (`LLMEngine.step`);
    collects the sampled tokens."""

    def __init__(self, engine: LLMEngine, lockstep: Optional[Lockstep] = None) -> None:
        self.engine = engine
        self.lockstep = lockstep
        self.stopping = False  # the leader's next step tells its group to stop
        self.tokens: dict[str, list[int]] = {}
        self._role = RankRole()

    @classmethod
    def for_rank(cls, spec: RankSpec, comm, engine: LLMEngine, ep=None) -> "Stepper":
        lockstep = Lockstep(spec, lambda point: None)
        lockstep.comm, lockstep.engine = comm, engine
        lockstep.use_exchange(ep)
        lockstep.use_graphs(ep)  # a peer-exchange group's decode steps, unless the spec is eager
        return cls(engine, lockstep)

    def graph_replays(self) -> int:
        """Steps this rank has replayed as CUDA graphs so far (`GroupGraphs`)."""
        graphs = None if self.lockstep is None else self.lockstep.graphs
        return 0 if graphs is None else graphs.replays

    @property
    def leader(self) -> bool:
        return self.lockstep is None or self.lockstep.is_leader

    def step(self) -> int:
        ls = self.lockstep
        if ls is None:
            outs = self.engine.step()
            status = planmod.WORK
        else:
            status, planned = planmod.IDLE, None
            if ls.is_leader:
                if self.stopping:
                    status = planmod.STOP
                else:
                    planned = self.engine.schedule()
                    status = planmod.IDLE if planned is None else planmod.WORK
            status, outs = ls.step(status, planned, self._role)
        for o in outs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return status

    def drive(self, done: Callable[[], bool]) -> None:
        """Step until every leader's `done()` holds; every rank of the group calls it.
        DP groups agree each iteration (one gloo all-reduce); TP followers step until
        their leader broadcasts STOP."""
        ls = self.lockstep
        if ls is None:
            while not done():
                self.step()
            return
        if ls.spec.dp > 1:
            while ls.comm.all_reduce_world_max(0 if done() else 1):
                self.step()
            return
        while True:
            if ls.is_leader and done():
                self.stopping = True
            status = self.step()
            if status == planmod.STOP:
                self.stopping = False
                return


def admit_decoding(engine: LLMEngine, rids: list[str], ctx: int, max_tokens: int,
                   gen: torch.Generator) -> None:
    """Admit sequences as already prefilled with `ctx` tokens (reserve pages, then
    `admit_prefilled`, as a disaggregated decode rank does): the KV pages hold whatever
    the pool holds (random data, see `randomize_kv`)."""
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid in rids:
        prompt = torch.randint(0, vocab, (ctx,), generator=gen).tolist()
        if engine.reserve(rid, prompt) is None:
            raise RuntimeError(f"KV pool too small for {len(rids)} x {ctx} tokens")
        engine.admit_prefilled(rid, prompt, int(prompt[-1]), params)


@torch.no_grad()
def randomize_kv(engine: LLMEngine, seed: int) -> None:
    for i, (k, v) in enumerate(engine.runner.caches):
        g = torch.Generator(device=k.device)
        g.manual_seed(seed + i)
        k.normal_(generator=g)
        v.normal_(generator=g)


# ------------------------------------------------------------------ floors

def _layer_params(cfg: ModelConfig) -> tuple[int, int, int]:
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + cfg.num_attention_heads * hd * h
    return attn, cfg.num_experts * h, 3 * h * cfg.moe_intermediate_size


def decode_bytes_per_gpu(cfg: ModelConfig, batch: int, ctx: int, world: int = 1) -> float:
    """Bytes one GPU reads per decode step with `batch` sequences on it, in a DP×EP
    group of `world` ranks (world=1: the single-GPU engine): dense weights, LM head, its
    experts touched by the group's `world * batch` tokens (uniform routing), its KV.
    The all-to-all traffic is not counted."""
    attn, router, expert = _layer_params(cfg)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = (e / world) * (1 - (1 - k / e) ** (world * batch))
    weights = cfg.num_hidden_layers * (attn + router + touched * expert) + cfg.vocab_size * cfg.hidden_size
    kv = batch * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    return 2.0 * (weights + kv)


def prefill_flops(cfg: ModelConfig, num_seqs: int, length: int) -> float:
    """FLOPs of a prefill (active params, causal attention, LM head of the last rows)."""
    attn, router, expert = _layer_params(cfg)
    active = cfg.num_hidden_layers * (attn + router + cfg.num_experts_per_tok * expert)
    attn_flops = (num_seqs * cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim
                  * length * length / 2)
    return 2.0 * active * num_seqs * length + attn_flops + 2.0 * num_seqs * cfg.vocab_size * cfg.hidden_size


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Device copy bandwidth (read + write) and bf16 matmul rate, CUDA events, medians."""
    from cuda_timing import median_ms  # bench/, on the path of every bench that calls this
    def copy_rate() -> float:  # its 2 x 2 GiB are freed on return
        src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3)

    bw = copy_rate()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flops = 2 * 8192 ** 3 / (median_ms(lambda: a @ b) * 1e-3)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": flops}
