"""`phalanx chaos --url` against a server that changes its answers after the reference
pass (no faults needed): the drill must fail, name the damage and exit 1."""

from __future__ import annotations

import json
import threading

from aiohttp import web

from phalanx.chaos.cli import _drill
from phalanx.chaos.runner import DrillConfig
from phalanx.server import BackgroundServer


def _lying_app() -> web.Application:
    calls = {"n": 0}
    lock = threading.Lock()

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": "me"}]})

    async def completions(request):
        body = await request.json()
        with lock:
            calls["n"] += 1
            late = calls["n"] > 8  # after the reference pass of 8 requests
        n = body["max_tokens"]
        ids = list(range(n))
        if late:
            ids[n // 2] = 999  # one changed token in the middle
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, t in enumerate(ids):
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": f" {t}", "token_ids": [t],
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request):
        return web.Response(text="phalanx_recoveries 0\nphalanx_backend_healthy 1\n")

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions),
                    web.get("/metrics", metrics)])
    return app


async def test_changed_tokens_fail_the_drill(tmp_path):
    server = BackgroundServer(_lying_app).start()
    try:
        config = DrillConfig(duration_s=1.0, requests=8, concurrency=2, seed=0)
        result, table = await _drill(server.url, None, config, tmp_path / "r")
    finally:
        server.stop()
    assert not result.passed and "changed" in {v.kind for v in result.verdicts}
    assert "| verdict | FAIL |" in table and "changed" in table
    assert json.loads((tmp_path / "r" / "report.json").read_text())["summary"]["passed"] is False
