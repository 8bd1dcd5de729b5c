"""The phalanx side of the HTTP routing bench (`bench/router_http.py`): a thin HTTP proxy
that places each request with `phalanx.router.Router`, fed the way
`server/cluster_driver.py` feeds it, in front of simulated workers
(`bench/router_http_worker.py`).

    python bench/router_http_proxy.py --port 9200 --workers http://127.0.0.1:9101,... \
        [--policy prefix_aware] [--policy-config '{"load_weight": 0.5}'] [--capacity-pages N]

What the router gets, as in `ClusterDriver` (the same calls, in the same order):
- the router is `cluster_driver.make_router` over one DP group per worker (ids 0..n-1),
  each group's tree bounded by the workers' KV pages (`ClusterLayout.num_pages`);
- submit: a `RequestRecord` of the prompt's tokens, `Router.route(record)`; the request
  goes to that group's worker (streamed, so the first token is seen);
- first token: `record.accept`, then `Router.prefill_done(record)`;
- last token: `record.accept(..., finished=True)`, then `Router.finish(record)` (lists
  prompt + answer for the group);
- every `load_interval_s` (0.5 s): each worker's `/phalanx/stats` becomes
  `Router.update_load(g, cluster_driver._load_of(stats))`;
- every `prefix_interval_s` (2 s): `as_of = Router.prefix_clock`, then each worker's
  `/phalanx/held?since=N` through `actors.held_reports.HeldReports` (a full list every
  tenth round): a list goes to `refresh_prefixes`, `{"evicted": ...}` to
  `forget_prefixes`, both with `as_of`.
One event loop drives the router (it is not thread-safe). `GET /proxy/stats` gives the
router's decision counters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from typing import Any, Optional

import aiohttp
import msgspec
from aiohttp import web

from phalanx.actors.held_reports import HeldReports
from phalanx.engine.sampling_params import SamplingParams
from phalanx.router import RequestRecord, Router
from phalanx.router.admission import Admission, AdmissionConfig
from phalanx.server.cluster_driver import ClusterLayout, DriverConfig, _load_of, make_router

from router_http_messages import HeldChanges, WorkerStats
from router_http_text import decode, encode

EPOCH = 0  # the simulated workers never re-form


class PhalanxProxy:
    """Routes `/v1/completions` over `workers` with a phalanx `Router` (module docstring)."""

    def __init__(self, workers: list[str], router: Router,
                 config: DriverConfig = DriverConfig(),
                 admission: AdmissionConfig = AdmissionConfig()) -> None:
        self.workers, self.router, self.config = workers, router, config
        self.admission = Admission(router, admission)
        self._placing: dict[str, asyncio.Future] = {}
        self._reports = HeldReports()
        self._ids = itertools.count()
        self._session: Optional[aiohttp.ClientSession] = None
        self._refresher: Optional[asyncio.Task] = None
        self.failures = 0

    # ---- lifecycle -----------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/proxy/stats", self.stats)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None))
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def _stop(self, app: web.Application) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self._session is not None:
            await self._session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def stats(self, request: web.Request) -> web.Response:
        st, policy = self.router.decode.stats, self.router.decode.policy
        return web.json_response({
            "decisions": st.decisions, "prompt_tokens": st.prompt_tokens,
            "router_matched_tokens": st.matched_tokens,
            "per_group": {str(g): n for g, n in st.per_target.items()},
            "load_overrides": getattr(policy, "load_overrides", None),
            "cost_overrides": getattr(policy, "cost_overrides", None),
            "prefix_choices": getattr(policy, "prefix_choices", None),
            "saturated": getattr(policy, "saturated", None),
            "held_placed": self.admission.placed, "held_wait_s": self.admission.wait_s,
            "held_picks": self.admission.picks, "held_pick_s": self.admission.pick_s,
            "failures": self.failures})

    # ---- requests ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        prompt = decode(body["prompt"])
        max_tokens = int(body.get("max_tokens") or 16)
        record = RequestRecord(f"p{next(self._ids)}", prompt,
                               SamplingParams(max_tokens=max_tokens))
        self.router.prepare(record)
        group = await self._admit(record)
        try:
            answer, usage = await self._forward(group, body, record)
        except (aiohttp.ClientError, ValueError, KeyError) as e:
            self.failures += 1
            self.router.finish(record.request_id)
            self._place()
            return web.json_response({"error": repr(e)}, status=502)
        return web.json_response(
            {"id": record.request_id, "object": "text_completion", "model": body.get("model"),
             "choices": [{"index": 0, "text": encode(answer), "finish_reason": "length"}],
             "usage": usage}, headers={"X-Phalanx-Group": str(group)})

    async def _admit(self, record: RequestRecord) -> int:
        """The group `record` goes to: routed at once, or once admission places it."""
        if not self.admission.config.holds:
            return self.router.route(record)
        rid = record.request_id
        placed = self._placing[rid] = asyncio.get_running_loop().create_future()
        self.admission.hold(record)
        self._place()
        try:
            return await placed
        except asyncio.CancelledError:
            self._placing.pop(rid, None)
            if self.admission.drop(rid) is None:
                self.router.finish(rid)
            raise

    def _place(self) -> None:
        for record, group in self.admission.place():
            self._placing.pop(record.request_id).set_result(group)

    async def _forward(self, group: int, body: dict, record: RequestRecord
                       ) -> tuple[list[int], dict]:
        """Streams the request from `group`'s worker, feeding the router as the driver
        does: `prefill_done` at the first token, `finish` at the last."""
        assert self._session is not None
        upstream = {**body, "stream": True}
        answer: list[int] = []
        usage: dict = {}
        async with self._session.post(self.workers[group] + "/v1/completions",
                                      json=upstream) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0]
                tokens = decode(choice["text"])
                finished = choice.get("finish_reason") is not None
                record.accept(len(answer), tokens, finished=finished,
                              finish_reason=choice.get("finish_reason"))
                if not answer and tokens:
                    self.router.prefill_done(record)
                    self._place()
                answer += tokens
                if finished:
                    usage = chunk.get("usage") or {}
                    self.router.finish(record)
                    self._place()
        if not record.done:
            raise ValueError(f"worker {group} ended request {record.request_id} early")
        return answer, usage

    # ---- load and prefixes ---------------------------------------------------------

    async def _refresh_forever(self) -> None:
        cfg = self.config
        next_load = next_prefix = 0.0
        while True:
            now = time.monotonic()
            if now >= next_load:
                next_load = now + cfg.load_interval_s
                await self._refresh_load()
            if now >= next_prefix:
                next_prefix = now + cfg.prefix_interval_s
                await self._refresh_prefixes()
            await asyncio.sleep(max(0.0, min(next_load, next_prefix) - time.monotonic()))

    async def _get(self, url: str, type_: Any) -> Any:
        assert self._session is not None
        async with self._session.get(url) as resp:
            resp.raise_for_status()
            return msgspec.json.decode(await resp.read(), type=type_)

    async def _refresh_load(self) -> None:
        try:
            stats = await asyncio.gather(*(self._get(w + "/phalanx/stats", WorkerStats)
                                           for w in self.workers))
        except aiohttp.ClientError:
            return  # as the driver on a timeout: try again next time
        for g, s in enumerate(stats):
            self.router.update_load(g, _load_of(msgspec.structs.asdict(s)))
        self._place()

    async def _refresh_prefixes(self) -> None:
        r, reports = self.router, self._reports
        as_of = r.prefix_clock
        reports.next_round()
        urls = [f"{w}/phalanx/held?since={reports.since(g, EPOCH)}"
                for g, w in enumerate(self.workers)]
        try:
            replies = await asyncio.gather(*(self._get(u, HeldChanges) for u in urls))
        except aiohttp.ClientError:
            return
        for g, reply in enumerate(replies):
            report = reports.take(g, EPOCH, reply.as_reply())
            if isinstance(report, dict):
                r.forget_prefixes(g, report.get("evicted", ()), as_of)
            else:
                r.refresh_prefixes(g, report, as_of)


def build_router(workers: int, *, page_size: int, capacity_pages: int, policy: str,
                 policy_config: Any) -> tuple[Router, DriverConfig]:
    """The router `ClusterDriver` would build over `workers` DP groups (a mapping config's
    "admission" key is the `AdmissionConfig`, not the policy's)."""
    config = DriverConfig(policy=policy, policy_config=policy_config)
    layout = ClusterLayout(dp=workers, page_size=page_size, num_pages=capacity_pages)
    return make_router(layout, config), config


def _parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--workers", required=True, help="comma-separated worker base URLs")
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--policy-config", default=None, help="JSON mapping of config fields")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--capacity-pages", type=int, default=2048)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = _parse_args(argv)
    workers = a.workers.split(",")
    cfg = json.loads(a.policy_config) if a.policy_config else None
    admission = AdmissionConfig(**(cfg.pop("admission", None) or {})) if cfg else AdmissionConfig()
    router, config = build_router(len(workers), page_size=a.page_size,
                                  capacity_pages=a.capacity_pages, policy=a.policy,
                                  policy_config=cfg or None)
    proxy = PhalanxProxy(workers, router, config, admission)
    print(f"ready {a.port}", flush=True)
    web.run_app(proxy.app(), host=a.host, port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
