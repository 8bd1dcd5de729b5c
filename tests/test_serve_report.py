"""What `phalanx serve` prints while serving: an access line per request and a
throughput line per busy window (none when idle)."""

from __future__ import annotations

import logging

import aiohttp

from phalanx.server import EngineBackend, create_app, start_server
from phalanx.server.app import METRICS_KEY
from phalanx.server.serve_report import ACCESS_FORMAT, throughput_line


def test_the_throughput_line_and_silence_when_idle():
    zero = {"requests": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0}
    busy = {"requests": 20.0, "prompt_tokens": 1000.0, "generation_tokens": 5000.0}
    stats = {"num_running": 3, "num_waiting": 1, "kv_usage": 0.25}
    assert throughput_line(zero, busy, stats, 10.0) == (
        "2.0 req/s, prompt 100.0 tok/s, generation 500.0 tok/s; running 3, waiting 1, "
        "KV 25.0% (window 10 s)")
    assert throughput_line(busy, busy, {"num_running": 0}, 10.0) is None


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_an_access_line_per_request_and_the_totals_behind_the_throughput(tiny_model):
    backend = EngineBackend.from_model_dir(tiny_model, model_name="m", max_num_seqs=4,
                                           num_pages=128)
    logger = logging.getLogger("test.access")
    logger.setLevel(logging.INFO)
    lines = _Lines()
    logger.addHandler(lines)
    app = create_app(backend)
    server = await start_server(app, access_log=logger, access_log_format=ACCESS_FORMAT)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "alpha", "max_tokens": 3, "ignore_eos": True}
            async with s.post(server.url + "/v1/completions", json=body,
                              headers={"X-Request-Id": "trace-7"}) as r:
                assert r.status == 200
            async with s.get(server.url + "/nowhere") as r:
                assert r.status == 404
    finally:
        await server.close()
        await backend.close()
        logger.removeHandler(lines)
    assert any('"POST /v1/completions HTTP/1.1" 200' in x and x.endswith("trace-7")
               for x in lines.lines), lines.lines
    assert any('"GET /nowhere HTTP/1.1" 404' in x for x in lines.lines), lines.lines
    totals = app[METRICS_KEY].totals()
    assert totals["requests"] == 1 and totals["generation_tokens"] == 3
    assert totals["prompt_tokens"] >= 1
