"""The offline API, in the shape vLLM users know:

    from phalanx import LLM, SamplingParams
    llm = LLM()                       # the tiny default model
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Optional, Sequence, Union

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .engine.llm_engine import LLMEngine
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams
from .models.loader import read_model_config

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


class LLM:
    """A single-rank engine plus the model's tokenizer, driven to completion per call."""

    def __init__(self, model: Optional[str | os.PathLike] = None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, page_size: int = 16, num_pages: int = 0,
                 enable_prefix_caching: bool = True, max_model_len: int = 0,
                 device: str = "cpu", dtype: str = "auto", seed: int = 0,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9) -> None:
        path = _resolve_model(model)
        try:
            model_cfg = read_model_config(path)
        except FileNotFoundError as e:
            raise ValueError(f"model: {e}") from None
        self.config = EngineConfig(
            model_path=path, model=model_cfg,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              enable_prefix_caching=enable_prefix_caching,
                              gpu_memory_utilization=gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            device=device, dtype=dtype, seed=seed, enforce_eager=enforce_eager)
        self.engine = LLMEngine(self.config)
        self._tokenizer = None
        self._ids = itertools.count()

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
            return texts, [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
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
                self.engine.add_request(rid, tokens, p)
                rids.append(rid)
        except Exception:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        return rids

    def generate(self, prompts: Prompts = None, sampling_params: Params = None,
                 prompt_token_ids: TokenPrompts = None) -> list[RequestOutput]:
        """Complete every prompt; results come back in the prompts' order."""
        texts, token_lists = self._inputs(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(token_lists))
        rids = self._submit(token_lists, params)
        seqs = {rid: self.engine.sequences[rid] for rid in rids}
        reasons: dict[str, Optional[str]] = {}
        pending = set(rids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished:
                        reasons[out.request_id] = out.finish_reason
                        pending.discard(out.request_id)
        finally:
            for rid in pending:
                self.engine.abort_request(rid)
        results = []
        for rid, text, tokens in zip(rids, texts, token_lists):
            seq = seqs[rid]
            out_ids = list(seq.output_token_ids)
            completion = CompletionOutput(0, self.decode(out_ids), out_ids, reasons[rid])
            results.append(RequestOutput(rid, text, tokens, [completion], seq.num_cached_tokens))
        return results

    def stream(self, prompt: str | Sequence[int],
               sampling_params: Optional[SamplingParams] = None) -> Iterator[int]:
        """Yield one request's tokens as they are produced."""
        tokens = self.tokenizer.encode(prompt, add_special_tokens=False) \
            if isinstance(prompt, str) else list(prompt)
        (rid,) = self._submit([tokens], [sampling_params or SamplingParams()])
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield from out.new_token_ids
                        done = out.finished
        finally:
            if not done:
                self.engine.abort_request(rid)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
