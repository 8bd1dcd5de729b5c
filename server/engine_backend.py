"""`ServingBackend` over one in-process, single-rank `LLMEngine`.

The engine lives on an `EngineLoop` thread; this class is the asyncio side. Each
request in flight has an asyncio queue on the loop that called `generate`; the engine
thread hands it each step's outputs with `loop.call_soon_threadsafe` (one call per
event loop per step). Nothing here calls the engine from an event loop thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from typing import AsyncIterator, Callable, Optional

from ..config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from ..engine.llm_engine import LLMEngine
from ..engine.outputs import StepOutput
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .backend import ServingBackend, TokenDelta
from .engine_loop import EngineLoop
from .pending import ABORTED as _ABORTED
from .pending import Pending as _Pending
from .pending import deliver_batches, post as _post

log = get_logger(__name__)

__all__ = ["EngineBackend"]

class EngineBackend(ServingBackend):
    """One engine on one thread, served to any number of asyncio consumers."""

    def __init__(self, config: EngineConfig, *, model_name: Optional[str] = None,
                 tokenizer=None) -> None:
        """Build the engine on its thread (blocks until loaded; re-raises load errors).

        model_name: id reported to clients (default: the model folder's name).
        tokenizer: defaults to `AutoTokenizer.from_pretrained(config.model_path)`."""
        self.config = config
        self.model_name = model_name or os.path.basename(os.path.normpath(config.model_path))
        self.max_model_len = config.max_model_len
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._engine_loop = EngineLoop(lambda: LLMEngine(config), self)
        self._engine_loop.start()

    @classmethod
    def from_model_dir(cls, model: Optional[str | os.PathLike] = None, *,
                       model_name: Optional[str] = None, max_num_seqs: int = 64,
                       max_num_batched_tokens: int = 2048, page_size: int = 16,
                       num_pages: int = 0, enable_prefix_caching: bool = True,
                       max_model_len: int = 0, device: str = "cpu", dtype: str = "auto",
                       seed: int = 0, enforce_eager: bool = False,
                       gpu_memory_utilization: float = 0.9) -> "EngineBackend":
        """A backend for a Hugging Face model folder (None: the tiny default model),
        configured like `phalanx.LLM` with tp = dp = 1. Raises ValueError for a folder
        that is not a model."""
        from ..models.loader import read_model_config
        if model is None:
            from ..models.tiny import default_model_dir
            model = default_model_dir()
        path = str(model)
        if not os.path.isdir(path):
            raise ValueError(f"model: {path!r} is not a model folder")
        try:
            model_cfg = read_model_config(path)
        except FileNotFoundError as e:
            raise ValueError(f"model: {e}") from None
        config = EngineConfig(
            model_path=path, model=model_cfg,
            cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                              enable_prefix_caching=enable_prefix_caching,
                              gpu_memory_utilization=gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            parallel=ParallelConfig(tp=1, dp=1),
            device=device, dtype=dtype, seed=seed, enforce_eager=enforce_eager)
        return cls(config, model_name=model_name)

    # -- ServingBackend --------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """See `ServingBackend.generate`."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        pending = self._register(request_id)
        done = False
        try:
            self._engine_loop.add(request_id, list(prompt_token_ids), params)
            emitted = 0
            backlog: deque = deque()
            while not done:
                if not backlog:
                    backlog.append(await pending.queue.get())
                while not pending.queue.empty():
                    backlog.append(pending.queue.get_nowait())
                delta, done = self._next_delta(backlog, emitted)
                emitted += len(delta.token_ids)
                yield delta
        finally:
            with self._lock:
                if self._pending.get(request_id) is pending:
                    del self._pending[request_id]
            if not done:
                self._engine_loop.abort(request_id)

    @staticmethod
    def _next_delta(backlog: deque, emitted: int) -> tuple[TokenDelta, bool]:
        """Fold the leading step outputs of `backlog` into one delta; raise a queued
        error. Returns (delta, finished)."""
        head = backlog[0]
        if isinstance(head, BaseException):
            backlog.clear()
            raise head
        if head is _ABORTED:
            backlog.clear()
            return TokenDelta(emitted, [], True, "abort"), True
        tokens: list[int] = []
        while backlog and isinstance(backlog[0], StepOutput):
            out: StepOutput = backlog.popleft()
            tokens.extend(out.new_token_ids)
            if out.finished:
                return TokenDelta(emitted, tokens, True, out.finish_reason,
                                  out.num_cached_tokens), True
        return TokenDelta(emitted, tokens), False

    def _register(self, request_id: str) -> _Pending:
        if self._closed:
            raise RuntimeError("backend is closed")
        pending = _Pending(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._pending[request_id] = pending
        if not self._engine_loop.alive:
            with self._lock:
                self._pending.pop(request_id, None)
            raise RuntimeError(f"engine is not running: {self._engine_loop.failure!r}")
        return pending

    async def abort(self, request_id: str) -> None:
        """See `ServingBackend.abort`; only enqueues, never waits for the engine."""
        with self._lock:
            pending = self._pending.pop(request_id, None)
        self._engine_loop.abort(request_id)
        if pending is not None:
            _post(pending, _ABORTED)

    def stats(self) -> dict[str, float]:
        """The engine's last published stats plus `num_pending` (requests with a
        consumer) and `healthy` (1.0 / 0.0)."""
        snapshot = dict(self._engine_loop.stats)
        snapshot["num_pending"] = len(self._pending)
        snapshot["healthy"] = 1.0 if self.healthy() else 0.0
        return snapshot

    def healthy(self) -> bool:
        return not self._closed and self._engine_loop.alive

    async def close(self) -> None:
        """Stop the engine thread (waits for its current step) and abort everything."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._engine_loop.stop)
        self._fail_all(lambda: _ABORTED)

    # -- EngineSink (called on the engine thread) ----------------------------------
    def on_outputs(self, outputs: list[StepOutput]) -> None:
        with self._lock:
            items = [(self._pending[o.request_id], o) for o in outputs
                     if o.request_id in self._pending]
        deliver_batches(items)

    def on_rejected(self, request_id: str, error: Exception) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is not None:
            _post(pending, error)

    def on_failure(self, error: BaseException) -> None:
        self._fail_all(lambda: RuntimeError(f"engine failed: {error!r}"))

    def _fail_all(self, make_item: Callable[[], object]) -> None:
        """End every request in flight with a fresh item from `make_item`."""
        with self._lock:
            pendings = list(self._pending.values())
            self._pending.clear()
        for pending in pendings:
            _post(pending, make_item())
