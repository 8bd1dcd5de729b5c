"""`SpyBackend`: an `EngineBackend` that records the request ids it was asked to abort
(tests of what a dropped or abandoned request releases)."""

from __future__ import annotations

from phalanx.server import EngineBackend


class SpyBackend(EngineBackend):
    def __init__(self, *args, **kwargs) -> None:
        self.aborted: list[str] = []
        super().__init__(*args, **kwargs)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await super().abort(request_id)
