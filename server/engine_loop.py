"""The thread that owns one `LLMEngine`: every engine call happens on it.

Other threads only enqueue commands (add, abort, stop) into an inbox and read the
stats snapshot the loop publishes (refreshed before each step's outputs are handed
out, so a consumer that saw an output sees stats at least that recent). The loop: drain the inbox (blocking while the
engine is idle), run one `step()` if there is work, hand the step's outputs to the
sink in one call, publish stats, repeat.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional, Protocol

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import StepOutput
from ..engine.sampling_params import SamplingParams
from ..log import get_logger

log = get_logger(__name__)

__all__ = ["EngineSink", "EngineLoop"]


class EngineSink(Protocol):
    """Receives what the loop produces; every method is called on the engine thread
    and must return quickly (hand off to another thread/loop, never block)."""

    def on_outputs(self, outputs: list[StepOutput]) -> None: ...

    def on_rejected(self, request_id: str, error: Exception) -> None: ...

    def on_failure(self, error: BaseException) -> None: ...


_STOP = object()


class EngineLoop:
    """One background thread that builds, owns and steps an engine."""

    def __init__(self, make_engine: Callable[[], LLMEngine], sink: EngineSink,
                 name: str = "phalanx-engine") -> None:
        self._make_engine = make_engine
        self._sink = sink
        self._inbox: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._ready = threading.Event()
        self._init_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.failure: Optional[BaseException] = None  # set before the sink hears of it
        self.stats: dict[str, float] = {}

    # -- any thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait until the engine is built; re-raise a build error."""
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; a refusal arrives later through `sink.on_rejected`."""
        self._inbox.put(("add", request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: Optional[float] = None) -> None:
        """Abort what is in flight, end the thread and wait for it."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._make_engine()
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._init_error = e
            self._ready.set()
            return
        self.stats = dict(engine.stats())
        self._ready.set()
        try:
            self._loop(engine)
        except BaseException as e:  # noqa: BLE001 - a dead loop must tell its requests
            log.error("engine_loop_failed", error=repr(e))
            self.failure = e
            self._sink.on_failure(e)

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            if not self._drain(engine, block=not engine.has_unfinished()):
                for rid in list(engine.sequences):
                    engine.abort_request(rid)
                self.stats = dict(engine.stats())
                return
            outputs = engine.step() if engine.has_unfinished() else []
            self.stats = dict(engine.stats())  # before the outputs: never older than them
            if outputs:
                self._sink.on_outputs(outputs)

    def _drain(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued commands (waiting for one when `block`); False on stop."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(engine, cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, engine: LLMEngine, cmd: tuple) -> None:
        if cmd[0] == "abort":
            engine.abort_request(cmd[1])
            return
        _, rid, tokens, params = cmd
        try:
            engine.add_request(rid, tokens, params)
        except Exception as e:  # noqa: BLE001 - refused requests leave the engine usable
            self._sink.on_rejected(rid, e)
