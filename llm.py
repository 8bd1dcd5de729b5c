"""The offline API, in the shape vLLM users know:

    from phalanx import LLM, SamplingParams
    llm = LLM()                       # the tiny default model
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Iterator, Mapping, Optional, Sequence, Union

from .config import (KV_IN_PLACE_MIN_BYTES, CacheConfig, EngineConfig, EPWidthConfig,
                     MicrobatchConfig, ParallelConfig, SchedulerConfig)
from .engine.llm_engine import LLMEngine
from .engine.choices import ChoiceRun
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams
from .models.checkpoint import Checkpoint, read_hf_config
from .models.fp8_weights import check_fp8_tp, is_fp8_checkpoint
from .models.row_parallel import check_leaves, row_parallel_dims
from .models.loader import read_model_config
from .policies.ep_width import ep_width_policy_names
from .policies.microbatch import microbatch_policy_names

Prompts = Union[str, Sequence[str], None]
TokenPrompts = Union[Sequence[int], Sequence[Sequence[int]], None]
Params = Union[SamplingParams, Sequence[SamplingParams], None]


def _resolve_model(model: Optional[str | os.PathLike]) -> str:
    if model is None:
        from .models.tiny import default_model_dir
        return str(default_model_dir())
    if not os.path.isdir(model):
        raise ValueError(f"model: {str(model)!r} is not a model folder")
    return str(model)


def engine_config(model: Optional[str | os.PathLike] = None, *, tp: int = 1, dp: int = 1,
                  max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                  page_size: int = 16, num_pages: int = 0, enable_prefix_caching: bool = True,
                  max_model_len: int = 0, device: str = "cpu", dtype: str = "auto",
                  seed: int = 0, enforce_eager: bool = False, cuda_graph_max_prefill: int = 512,
                  gpu_memory_utilization: float = 0.9,
                  collective_timeout_s: float = 30.0, max_recoveries: int = 5,
                  recovery_window_s: float = 600.0, replace_timeout_s: float = 30.0,
                  ep_exchange: str = "exact",
                  kv_in_place_min_bytes: int = KV_IN_PLACE_MIN_BYTES, ep_policy: str = "fixed",
                  ep_groups: int = 1, ep_costs: str = "",
                  ep_options: Optional[Mapping] = None, microbatch: str = "adaptive",
                  microbatch_options: Optional[Mapping] = None,
                  quantization: Optional[str] = None,
                  load_format: str = "auto", batch_invariant: bool = False,
                  tp_invariant_width: int = 0) -> EngineConfig:
    """The engine configuration for a Hugging Face model folder (None: the tiny default
    model). ValueError naming the argument for a folder that is not a model or a bad
    value. `load_format` "dummy": seeded random weights, the folder's safetensors (if
    any) unread. `batch_invariant`: kernels whose row results do not depend on the batch
    (kernels/batch_invariant.py; a GPU's FP8 weights have none yet). `tp_invariant_width`:
    `EngineConfig`'s (models/row_parallel.py; 0: the layout's widest TP)."""
    path = _resolve_model(model)
    ep_width = EPWidthConfig.from_dict({"policy": ep_policy, "groups": ep_groups,
                                        "costs": ep_costs, **(ep_options or {})})
    if dp > 1 and dp % ep_width.groups:
        raise ValueError(f"ep_groups: {ep_width.groups} groups do not split dp={dp} evenly")
    if ep_width.policy not in ep_width_policy_names():
        raise ValueError(f"ep_policy: unknown EP-width policy {ep_width.policy!r}; known: "
                         f"{ep_width_policy_names()}")
    micro = MicrobatchConfig.from_dict({"policy": microbatch, **(microbatch_options or {})})
    if micro.policy not in microbatch_policy_names():
        raise ValueError(f"microbatch: unknown micro-batch policy {micro.policy!r}; known: "
                         f"{microbatch_policy_names()}")
    try:
        model_cfg = read_model_config(path)
        if load_format != "dummy":
            Checkpoint(path).close()  # the weights are there (read when the ranks load)
    except FileNotFoundError as e:
        raise ValueError(f"model: {e}") from None
    fp8 = quantization == "fp8" or is_fp8_checkpoint(read_hf_config(path))
    if fp8:
        check_fp8_tp(model_cfg, tp)
        if batch_invariant and device != "cpu":
            raise ValueError("batch_invariant: FP8 weights have no batch-invariant GPU kernels yet "
                             "(their linears quantize activations at prefill, not at decode); "
                             "serve the bf16 weights, or FP8 without the mode")
    tp_invariant_width = _checked_width(model_cfg, tp, tp_invariant_width, fp8)
    return EngineConfig(
        model_path=path, model=model_cfg,
        cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                          enable_prefix_caching=enable_prefix_caching,
                          gpu_memory_utilization=gpu_memory_utilization,
                          kv_in_place_min_bytes=kv_in_place_min_bytes),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len),
        parallel=ParallelConfig(tp=tp, dp=dp, collective_timeout_s=collective_timeout_s,
                                max_recoveries=max_recoveries,
                                recovery_window_s=recovery_window_s,
                                replace_timeout_s=replace_timeout_s, ep_exchange=ep_exchange,
                                ep_width=ep_width, microbatch=micro),
        device=device, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
        cuda_graph_max_prefill=cuda_graph_max_prefill, quantization=quantization,
        load_format=load_format, batch_invariant=batch_invariant,
        tp_invariant_width=tp_invariant_width)


def _checked_width(model_cfg, tp: int, width: int, fp8: bool) -> int:
    """`tp_invariant_width` as the config keeps it (FP8 weights: 1), or ValueError naming it."""
    if fp8:
        if width > 1:
            raise ValueError("tp_invariant_width: FP8 weights have no TP-invariant sums; give 0 or 1")
        return 1
    if width:
        try:
            check_leaves(width, tp, row_parallel_dims(model_cfg))
        except ValueError as e:
            raise ValueError(f"tp_invariant_width: {e}") from None
    return width


def check_fp8_disagg(config: EngineConfig, layout) -> None:
    """ValueError naming the side whose TP size would cut an FP8 weight's 128-column
    blocks (`layout`: a `DisaggConfig`; nothing to check unless the weights are FP8)."""
    if config.quantization == "fp8" or is_fp8_checkpoint(read_hf_config(config.model_path)):
        check_fp8_tp(config.model, layout.prefill_tp, "prefill_tp")
        check_fp8_tp(config.model, layout.decode_tp, "decode_tp")


def disagg_config(prefill_tp: Optional[int], decode_dp: Optional[int], decode_tp: Optional[int],
                  prefill_instances: Optional[int], prefill_page_size: Optional[int],
                  transfer_timeout_s: float = 30.0):
    """The disaggregated layout from `LLM`'s keywords (None: the default of each)."""
    from .config import DisaggConfig
    return DisaggConfig(prefill_tp=prefill_tp or 1, decode_dp=decode_dp or 1,
                        decode_tp=decode_tp or 1, prefill_instances=prefill_instances or 1,
                        prefill_page_size=prefill_page_size or 0,
                        transfer_timeout_s=transfer_timeout_s)


class LLM:
    """A single-rank engine plus the model's tokenizer, driven to completion per call."""

    def __init__(self, model: Optional[str | os.PathLike] = None, *, tp: int = 1, dp: int = 1,
                 max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, page_size: int = 16, num_pages: int = 0,
                 enable_prefix_caching: bool = True, max_model_len: int = 0,
                 device: str = "cpu", dtype: str = "auto", seed: int = 0,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9,
                 cuda_graph_max_prefill: int = 512,
                 collective_timeout_s: float = 30.0, max_recoveries: int = 5,
                 recovery_window_s: float = 600.0, replace_timeout_s: float = 30.0,
                 ray_address: Optional[str] = None,
                 prefill_tp: Optional[int] = None, decode_dp: Optional[int] = None,
                 decode_tp: Optional[int] = None, prefill_instances: Optional[int] = None,
                 prefill_page_size: Optional[int] = None, ep_exchange: str = "exact",
                 kv_in_place_min_bytes: int = KV_IN_PLACE_MIN_BYTES, ep_policy: str = "fixed",
                 ep_groups: int = 1, ep_costs: str = "",
                 ep_options: Optional[Mapping] = None, microbatch: str = "adaptive",
                 microbatch_options: Optional[Mapping] = None,
                 quantization: Optional[str] = None, load_format: str = "auto",
                 batch_invariant: bool = False, tp_invariant_width: int = 0) -> None:
        """`tp`/`dp`: one colocated group. Any of `prefill_tp`, `decode_dp`, `decode_tp`,
        `prefill_instances`: the disaggregated layout (prefill TP instances stream KV to
        a decode DP×EP group; `page_size` is the decode side's, `prefill_page_size` the
        prefill side's). `max_recoveries` within `recovery_window_s` seconds: how many times
        groups that lose a rank may be re-formed (their requests resumed) before the call
        fails with `GroupFailure`. `replace_timeout_s`: how long a dead rank's placement
        may wait for room before its group re-forms one DP rank narrower.
        `ep_exchange`: the MoE all-to-all of DP×EP groups (`ParallelConfig`).
        `kv_in_place_min_bytes`: the KV transport's in-place threshold (`CacheConfig`).
        `ep_policy`: how the EP width is chosen while serving (a registered "ep_width"
        policy: "fixed", "widest", "cost_model"), starting from `ep_groups` DP×EP groups
        (the `dp` or `decode_dp` ranks split evenly); `ep_costs`: cost tables for
        "cost_model" (`bench/ep_width.py` writes them; "": measured on the ranks at
        start, `actors/ep_calibration.py`); `ep_options`: the rest of `EPWidthConfig`
        (`itl_target_ms`, `margin`, `min_interval_s`, `interval_s`).
        `microbatch`: whether a DP×EP step runs as two overlapped micro-batches (a
        registered "microbatch" policy: "off", "on", "threshold", "adaptive");
        `microbatch_options`: the rest of `MicrobatchConfig` (`min_tokens`, `samples`,
        `probe`). `quantization`: "fp8" quantizes the checkpoint's projections to
        block-scaled FP8 on load (an FP8 checkpoint loads as FP8 anyway). `load_format`:
        "auto" (the folder's safetensors) or "dummy" (seeded random weights of the
        folder's config.json shapes; benchmarks). `cuda_graph_max_prefill`: prefill and
        mixed steps of up to that many tokens replay CUDA graphs on one GPU (0: eager).
        `batch_invariant`: a request's logits are the same bits in any batch and after a
        re-prefill on a GPU too, at a cost in speed (kernels/batch_invariant.py).
        `tp_invariant_width`: row-parallel sums with the same bits at every TP width
        dividing it (models/row_parallel.py; 0: the layout's widest TP, 1 alone)."""
        self.config = engine_config(
            model, tp=tp, dp=dp, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
            num_pages=num_pages, enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len, device=device, dtype=dtype, seed=seed,
            enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
            cuda_graph_max_prefill=cuda_graph_max_prefill,
            collective_timeout_s=collective_timeout_s, max_recoveries=max_recoveries,
            recovery_window_s=recovery_window_s, replace_timeout_s=replace_timeout_s,
            ep_exchange=ep_exchange, kv_in_place_min_bytes=kv_in_place_min_bytes,
            ep_policy=ep_policy, ep_groups=ep_groups, ep_costs=ep_costs, ep_options=ep_options,
            microbatch=microbatch, microbatch_options=microbatch_options,
            quantization=quantization, load_format=load_format, batch_invariant=batch_invariant,
            tp_invariant_width=tp_invariant_width)
        self.engine: Optional[LLMEngine] = None
        self.cluster = None  # a multi-rank layout's client (actors.cluster.ClusterClient)
        self._start((prefill_tp, decode_dp, decode_tp, prefill_instances, prefill_page_size),
                    tp * dp, collective_timeout_s, ray_address)
        self._tokenizer = None
        self._ids = itertools.count()
        self._seeds = random.Random(seed)  # base seeds of unseeded requests with n > 1

    def _start(self, disagg: tuple, ranks: int, collective_timeout_s: float,
               ray_address: Optional[str]) -> None:
        """The engine (one rank) or the rank actors of the layout: disaggregated when any
        of `disagg` (prefill_tp, decode_dp, decode_tp, prefill_instances,
        prefill_page_size) is given, else colocated over `ranks` = tp * dp."""
        if any(v is not None for v in disagg):
            if ranks != 1:
                raise ValueError("tp/dp: give either tp/dp (colocated) or the prefill_*/decode_* "
                                 "layout (disaggregated), not both")
            from .actors.cluster_builder import build_cluster
            layout = disagg_config(*disagg, collective_timeout_s)
            check_fp8_disagg(self.config, layout)
            self.cluster = build_cluster(self.config, layout, ray_address)
        elif ranks == 1:
            self.engine = LLMEngine(self.config)
            self.engine.warm_up()  # GPU: nothing compiles once requests come
        else:
            from .actors.cluster_builder import build_cluster
            self.cluster = build_cluster(self.config, None, ray_address)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
        return self._tokenizer

    def _inputs(self, prompts: Prompts, prompt_token_ids: TokenPrompts):
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("generate: give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            if any(not isinstance(t, str) for t in texts):
                raise ValueError("prompts: must be a string or a list of strings")
            return texts, [self.tokenizer.encode(t) for t in texts]
        ids = list(prompt_token_ids)
        if ids and all(isinstance(t, int) for t in ids):
            ids = [ids]
        return [None] * len(ids), [list(p) for p in ids]

    @staticmethod
    def _params(sampling_params: Params, n: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
        return params

    def _submit(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[str]:
        """Add every request or none: a refused one withdraws those already queued."""
        rids: list[str] = []
        try:
            for tokens, p in zip(token_lists, params):
                rid = f"offline-{next(self._ids)}"
                if self.cluster is not None:
                    self.cluster.submit(rid, tokens, p)
                else:
                    self.engine.add_request(rid, tokens, p)
                rids.append(rid)
        except Exception:
            for rid in rids:
                self._abort(rid)
            raise
        return rids

    def _abort(self, rid: str) -> None:
        if self.cluster is not None:
            self.cluster.abort(rid)
        else:
            self.engine.abort_request(rid)

    def _poll(self):
        return self.cluster.poll() if self.cluster is not None else self.engine.step()

    def close(self) -> None:
        """Stop the group's rank actors (no-op for a single-rank engine)."""
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def generate(self, prompts: Prompts = None, sampling_params: Params = None,
                 prompt_token_ids: TokenPrompts = None) -> list[RequestOutput]:
        """Complete every prompt; results come back in the prompts' order, each with
        `sampling_params.n` outputs (choice i seeded with seed + i). A text prompt is
        tokenized with the tokenizer's special tokens (a BOS where it adds one), as the
        server's `/v1/completions` does by default. The first choice of
        a prompt runs ahead; the others join once its prompt is in the cache, so they
        share its pages."""
        texts, token_lists = self._inputs(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        choices = [p.choices(lambda: self._seeds.getrandbits(63)) for p in params]
        runs = [ChoiceRun(tokens, len(c)) for tokens, c in zip(token_lists, choices)]
        heads = self._submit(token_lists, [c[0] for c in choices])
        owner = {rid: (i, 0) for i, rid in enumerate(heads)}
        for run, rid in zip(runs, heads):
            run.rids.append(rid)
        waiting = {rid: i for i, rid in enumerate(heads) if len(choices[i]) > 1}
        try:
            while any(not run.done for run in runs):
                for out in self._poll():
                    at = owner.get(out.request_id)
                    if at is None:
                        continue
                    runs[at[0]].take(at[1], out)
                    i = waiting.pop(out.request_id, None)
                    if i is not None:  # the prompt's pages are registered: the rest join
                        rest = self._submit([token_lists[i]] * (len(choices[i]) - 1), choices[i][1:])
                        for k, rid in enumerate(rest, start=1):
                            owner[rid] = (i, k)
                            runs[i].rids.append(rid)
        finally:
            for run in runs:
                for rid in run.unfinished():
                    self._abort(rid)
        return [run.output(text, self.decode) for run, text in zip(runs, texts)]

    def chat(self, messages, sampling_params: Params = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[Mapping] = None) -> list[RequestOutput]:
        """`generate` over conversations rendered with the model folder's chat template:
        `messages` is one conversation (a list of `{"role", "content"}` dicts) or a list
        of them."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if not conversations or any(not conv for conv in conversations):
            raise ValueError("messages: give a conversation (a non-empty list of messages) "
                             "or a list of them")
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            prompts.append(list(self.tokenizer.encode(text, add_special_tokens=False)))
        return self.generate(prompt_token_ids=prompts, sampling_params=sampling_params)

    def stream(self, prompt: str | Sequence[int],
               sampling_params: Optional[SamplingParams] = None) -> Iterator[int]:
        """Yield one request's tokens as they are produced."""
        tokens = self.tokenizer.encode(prompt) \
            if isinstance(prompt, str) else list(prompt)
        (rid,) = self._submit([tokens], [sampling_params or SamplingParams()])
        done = False
        try:
            while not done:
                for out in self._poll():
                    if out.request_id == rid:
                        yield from out.new_token_ids
                        done = out.finished
        finally:
            if not done:
                self._abort(rid)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
