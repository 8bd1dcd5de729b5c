"""The thread that owns one `LLMEngine`: every engine call happens on it.

Other threads only enqueue commands (submit, abort, stop) into an inbox and read the
stats snapshot the loop publishes (refreshed before each step's outputs are handed
out, so a consumer that saw an output sees stats at least that recent); the inbox and
lifecycle are `OwnerThread`'s. The loop: drain the inbox (blocking while the engine is
idle), run one `step()` if there is work, hand the step's outputs to the sink in one
call, publish stats, repeat.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import StepOutput
from ..engine.sampling_params import SamplingParams
from ..log import get_logger
from .owner_thread import OwnerThread

log = get_logger(__name__)

__all__ = ["EngineSink", "EngineLoop"]


class EngineSink(Protocol):
    """Receives what the loop produces; every method is called on the engine thread
    and must return quickly (hand off to another thread/loop, never block)."""

    def on_outputs(self, outputs: list[StepOutput]) -> None: ...

    def on_rejected(self, request_id: str, error: Exception) -> None: ...

    def on_failure(self, error: BaseException) -> None: ...


class EngineLoop(OwnerThread):
    """One background thread that builds, owns and steps an engine.

    `submit` queues a request (a refusal arrives through `sink.on_rejected`); `stop`
    aborts what is in flight, ends the thread and waits for it."""

    def __init__(self, make_engine: Callable[[], LLMEngine], sink: EngineSink,
                 name: str = "phalanx-engine") -> None:
        super().__init__(sink, name)
        self._make_engine = make_engine
        self._engine: Optional[LLMEngine] = None  # only touched on the engine thread
        self._ready = threading.Event()
        self._init_error: Optional[BaseException] = None

    # -- any thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait until the engine is built; re-raise a build error."""
        super().start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    # -- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._engine = self._make_engine()
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
            if not self._drain(block=not engine.has_unfinished()):
                for rid in list(engine.sequences):
                    engine.abort_request(rid)
                self.stats = dict(engine.stats())
                return
            outputs = engine.step() if engine.has_unfinished() else []
            self.stats = dict(engine.stats())  # before the outputs: never older than them
            if outputs:
                self._sink.on_outputs(outputs)

    def _apply_submit(self, rid: str, tokens: list[int], params: SamplingParams) -> None:
        try:
            self._engine.add_request(rid, tokens, params)
        except Exception as e:  # noqa: BLE001 - refused requests leave the engine usable
            self._sink.on_rejected(rid, e)

    def _apply_abort(self, rid: str) -> None:
        self._engine.abort_request(rid)
