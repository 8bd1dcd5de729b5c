"""Simulated HTTP workers for the routing bench (`bench/router_http.py`): each one a
`SimEngine` behind the HTTP surface an SGLang worker offers a gateway, plus what a
phalanx rank reports to the cluster driver.

    python bench/router_http_worker.py --ports 9101,9102,9103,9104 [--slots 4] ...

Routes (one engine per port; all ports served by one process and one event loop):
- `GET /health`, `/health_generate`, `/v1/models`, `/loads` and `/v1/loads` (SGLang's load report:
  waiting/running requests, token usage), what SMG probes and polls;
- `POST /v1/completions` and `/generate`: `prompt` (or `text`) is token ids written by
  `router_http_text.encode`; `max_tokens` answer tokens come back the same way; with
  `"stream": true`, SSE: one chunk with the first token once the prefill is done, one
  with the rest, then `[DONE]`; usage carries `prompt_tokens_details.cached_tokens`;
- `GET /phalanx/stats` (`WorkerStats`) and `GET /phalanx/held?since=N`
  (`HeldChanges`): what a DP leader answers `leader_stats` / `held_prefix_changes`;
- `GET /sim/truth` (`GroundTruth`): the worker's own hit counters.
Any other path is answered 404 and logged to stderr (to see what a gateway asks).
Prints `ready <ports>` on stdout once every port listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import msgspec
from aiohttp import web

from router_http_engine import EngineConfig, SimEngine
from router_http_messages import GroundTruth, HeldChanges, WorkerStats
from router_http_text import decode, encode

MODEL = "sim-moe"
_encode = msgspec.json.encode


def _msg(obj) -> web.Response:
    return web.Response(body=_encode(obj), content_type="application/json")


def _completion(rid: str, text: str, prompt_tokens: int, answer_tokens: int,
                cached: int, finish: bool) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": "length" if finish else None}
    out = {"id": rid, "object": "text_completion", "created": int(time.time()),
           "model": MODEL, "choices": [choice]}
    if finish:
        out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": answer_tokens,
                        "total_tokens": prompt_tokens + answer_tokens,
                        "prompt_tokens_details": {"cached_tokens": cached}}
    return out


class Worker:
    """The HTTP face of one `SimEngine`."""

    def __init__(self, engine: SimEngine, name: str) -> None:
        self.engine, self.name = engine, name
        self._requests = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        app.router.add_get("/v1/models", self.models)
        for path in ("/v1/loads", "/loads"):
            app.router.add_get(path, self.loads)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.completions)
        app.router.add_get("/phalanx/stats", self.stats)
        app.router.add_get("/phalanx/held", self.held)
        app.router.add_get("/sim/truth", self.truth)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "sglang",
             "root": MODEL, "max_model_len": 1 << 17}]})

    async def loads(self, request: web.Request) -> web.Response:
        e = self.engine
        load = {"dp_rank": 0, "num_running_reqs": e.num_running,
                "num_waiting_reqs": e.num_waiting,
                "num_waiting_uncached_tokens": e.waiting_tokens(),
                "num_total_reqs": e.num_running + e.num_waiting,
                "num_used_tokens": int(e.kv_usage() * e.config.capacity_pages
                                       * e.config.page_size),
                "max_total_num_tokens": e.config.capacity_pages * e.config.page_size,
                "token_usage": e.kv_usage(), "gen_throughput": 0.0, "cache_hit_rate": 0.0,
                "utilization": e.kv_usage(), "max_running_requests": e.config.slots}
        return web.json_response({"timestamp": "", "dp_rank_count": 1, "loads": [load]})

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        return _msg(WorkerStats(e.num_waiting, e.waiting_tokens(), e.num_running,
                                e.kv_usage()))

    async def held(self, request: web.Request) -> web.Response:
        cache = self.engine.cache
        since = int(request.query.get("since", "-1"))
        if since >= 0:
            seq = cache.evictions
            evicted = cache.evicted_since(since)
            if evicted is not None:
                return _msg(HeldChanges(seq, evicted=evicted))
        seq = cache.evictions  # read first: a later eviction shows in the next report
        return _msg(HeldChanges(seq, full=cache.held()))

    async def truth(self, request: web.Request) -> web.Response:
        c = self.engine.counters
        return _msg(GroundTruth(c.requests, c.prompt_tokens, c.hit_tokens, c.prefill_busy_s,
                                self.engine.cache.evictions))

    async def unknown(self, request: web.Request) -> web.Response:
        print(f"[{self.name}] unhandled {request.method} {request.path_qs}", file=sys.stderr,
              flush=True)
        return web.Response(status=404, text="not found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        text = body.get("prompt", body.get("text"))
        if isinstance(text, list):
            text = text[0]
        prompt = decode(text)
        max_tokens = int(body.get("max_tokens") or
                         (body.get("sampling_params") or {}).get("max_new_tokens") or 16)
        self._requests += 1
        rid = f"{self.name}-{self._requests}"
        if not body.get("stream"):
            async def nothing(first: int, cached: int) -> None:
                return None
            answer, cached = await self.engine.generate(prompt, max_tokens, nothing)
            return web.json_response(_completion(rid, encode(answer), len(prompt),
                                                 len(answer), cached, True))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def first_chunk(first: int, cached: int) -> None:
            chunk = _completion(rid, encode([first]), len(prompt), 1, cached, False)
            await resp.write(b"data: " + _encode(chunk) + b"\n\n")

        answer, cached = await self.engine.generate(prompt, max_tokens, first_chunk)
        last = _completion(rid, encode(answer[1:]), len(prompt), len(answer), cached, True)
        await resp.write(b"data: " + _encode(last) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _parse_args(argv=None) -> argparse.Namespace:
    d = EngineConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ports", required=True, help="comma-separated ports, one per worker")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--slots", type=int, default=d.slots)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--capacity-pages", type=int, default=d.capacity_pages)
    ap.add_argument("--prefill-fixed-s", type=float, default=d.prefill_fixed_s)
    ap.add_argument("--prefill-s-per-token", type=float, default=d.prefill_s_per_token)
    ap.add_argument("--decode-s-per-token", type=float, default=d.decode_s_per_token)
    return ap.parse_args(argv)


async def serve(ports: list[int], host: str, config: EngineConfig) -> None:
    runners = []
    for i, port in enumerate(ports):
        runner = web.AppRunner(Worker(SimEngine(config), f"w{i}").app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        runners.append(runner)
    print("ready " + ",".join(map(str, ports)), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for r in runners:
            await r.cleanup()


def main(argv=None) -> None:
    a = _parse_args(argv)
    cfg = EngineConfig(slots=a.slots, page_size=a.page_size, capacity_pages=a.capacity_pages,
                       prefill_fixed_s=a.prefill_fixed_s,
                       prefill_s_per_token=a.prefill_s_per_token,
                       decode_s_per_token=a.decode_s_per_token)
    try:
        asyncio.run(serve([int(p) for p in a.ports.split(",")], a.host, cfg))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
