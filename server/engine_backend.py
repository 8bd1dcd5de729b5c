"""`ServingBackend` over one in-process, single-rank `LLMEngine`.

The engine lives on an `EngineLoop` thread; this class is the asyncio side, a
`ThreadedBackend` (threaded_backend.py: request queues, `generate`, `abort`, `close`).
The engine thread hands each request's queue that step's `StepOutput`s (one
`call_soon_threadsafe` per event loop per step); `_fold` turns them into deltas.
Nothing here calls the engine from an event loop thread.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import StepOutput
from ..log import get_logger
from .backend import TokenDelta
from .engine_loop import EngineLoop
from .threaded_backend import ThreadedBackend

log = get_logger(__name__)

__all__ = ["EngineBackend"]


class EngineBackend(ThreadedBackend):
    """One engine on one thread, served to any number of asyncio consumers.

    `stats()`: the engine's last published stats plus `num_pending` (requests with a
    consumer) and `healthy` (1.0 / 0.0). `close()` stops the engine thread (waiting for
    its current step) and aborts everything. A request sent after the engine died is
    refused with RuntimeError; requests in flight when it dies raise RuntimeError."""

    def __init__(self, config: EngineConfig, *, model_name: Optional[str] = None,
                 tokenizer=None) -> None:
        """Build the engine on its thread (blocks until loaded; re-raises load errors).

        model_name: id reported to clients (default: the model folder's name).
        tokenizer: defaults to `AutoTokenizer.from_pretrained(config.model_path)`."""
        super().__init__()
        self.config = config
        self.model_name = model_name or os.path.basename(os.path.normpath(config.model_path))
        self.max_model_len = config.max_model_len
        self.eos_token_ids = tuple(config.model.eos_token_ids)
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer = tokenizer
        self._start(EngineLoop(lambda: _warmed(LLMEngine(config)), self))

    @classmethod
    def from_model_dir(cls, model: Optional[str | os.PathLike] = None, *,
                       model_name: Optional[str] = None, max_num_seqs: int = 64,
                       max_num_batched_tokens: int = 2048, page_size: int = 16,
                       num_pages: int = 0, enable_prefix_caching: bool = True,
                       max_model_len: int = 0, device: str = "cpu", dtype: str = "auto",
                       seed: int = 0, enforce_eager: bool = False,
                       cuda_graph_max_prefill: int = 512,
                       gpu_memory_utilization: float = 0.9,
                       quantization: Optional[str] = None,
                       load_format: str = "auto", batch_invariant: bool = False) -> "EngineBackend":
        """A backend for a Hugging Face model folder (None: the tiny default model),
        configured like `phalanx.LLM` with tp = dp = 1. Raises ValueError for a folder
        that is not a model."""
        from ..llm import engine_config
        config = engine_config(
            model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            page_size=page_size, num_pages=num_pages,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
            device=device, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            cuda_graph_max_prefill=cuda_graph_max_prefill,
            gpu_memory_utilization=gpu_memory_utilization, quantization=quantization,
            load_format=load_format, batch_invariant=batch_invariant)
        return cls(config, model_name=model_name)

    # -- ThreadedBackend -------------------------------------------------------------
    def _fold(self, backlog: deque, emitted: int) -> TokenDelta:
        """Fold the leading `StepOutput`s of `backlog` into one delta at index `emitted`
        (the engine delivers each request's tokens once, in order)."""
        delta = TokenDelta(emitted, [])
        while backlog and isinstance(backlog[0], StepOutput):
            out: StepOutput = backlog.popleft()
            delta = delta.merged(TokenDelta(emitted, list(out.new_token_ids), out.finished,
                                            out.finish_reason, out.num_cached_tokens,
                                            out.logprobs, out.prompt_logprobs, out.queued_s,
                                            out.prefill_s))
            if out.finished:
                break
        return delta

    def _refusal(self) -> Optional[Exception]:
        if self._worker.alive:
            return None
        return RuntimeError(f"engine is not running: {self._worker.failure!r}")

    # -- EngineSink (called on the engine thread) ----------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        self._deliver((o.request_id, o) for o in outputs)

    def on_rejected(self, request_id: str, error: Exception) -> None:
        self._post_to(request_id, error)

    def on_failure(self, error: BaseException) -> None:
        self._end_all(lambda: RuntimeError(f"engine failed: {error!r}"))


def _warmed(engine: LLMEngine) -> LLMEngine:
    """Grammars loading in the background; on a GPU, every kernel compiled (warm-up)."""
    engine.warm_grammars()
    engine.warm_up()
    return engine
