"""Resumable streams, end to end: every SSE event carries `id: <stream>/<index>`; a
client whose connection drops asks again with `Last-Event-ID` and gets the rest of the
same generation, each event once. Through a TCP proxy that cuts the first connection
mid-stream, `phalanx.sdk.AsyncClient` resumes on its own: the tokens equal an uncut
run's, none lost or repeated. Raw HTTP: a resumption from any index replays from the
next one; an unknown or expired stream is 404 `stream_not_found`; with no follower the
stream is aborted after the grace."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from phalanx.sdk import AsyncClient
from app_server import serving
from spy_backend import SpyBackend

MODEL = "tiny-resume"
BODY = {"model": MODEL, "prompt": "alpha bravo", "max_tokens": 60, "temperature": 0.8,
        "seed": 5, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def backend(tiny_model):
    return SpyBackend.from_model_dir(tiny_model, model_name=MODEL, max_num_seqs=8, num_pages=256)


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, stream_resume_s=2.0) as srv:
        yield srv


class CuttingProxy:
    """Forwards TCP to the server; the first connection is cut after `cut_after` bytes
    from the server (mid-stream), the later ones pass whole."""

    def __init__(self, port: int, cut_after: int) -> None:
        self.port, self.cut_after, self.connections = port, cut_after, 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer) -> None:
        self.connections += 1
        limit = self.cut_after if self.connections == 1 else None
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(src, dst, limit):
            sent = 0
            try:
                while data := await src.read(256):
                    if limit is not None and sent + len(data) > limit:
                        dst.write(data[:limit - sent])
                        break
                    dst.write(data)
                    sent += len(data)
                    await dst.drain()
            finally:
                for w in (writer, up_writer):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, None), pipe(up_reader, writer, limit),
                             return_exceptions=True)

    async def close(self) -> None:
        self._server.close()


async def _tokens(client: AsyncClient) -> list[int]:
    out = []
    async for chunk in client.stream(**{k: v for k, v in BODY.items() if k != "model"}):
        out += chunk.choices[0].token_ids or []
    return out


async def test_the_sdk_resumes_a_cut_stream_with_no_token_lost_or_repeated(server):
    async with AsyncClient(server.url, model=MODEL) as direct:
        reference = await _tokens(direct)
    assert len(reference) == 60
    proxy = CuttingProxy(server.port, cut_after=3000)
    port = await proxy.start()
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", model=MODEL) as client:
            got = await _tokens(client)
            assert client.resumes >= 1 and proxy.connections >= 2
    finally:
        await proxy.close()
    assert got == reference


async def _events(resp) -> list[tuple[str, str]]:
    out, event_id = [], None
    async for line in resp.content:
        line = line.decode().rstrip("\r\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
    return out


async def test_resuming_from_any_event_replays_the_rest_once(server):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json={**BODY, "stream": True}) as r:
            whole = await _events(r)
        ids = [i for i, _ in whole]
        stream = ids[0].rpartition("/")[0]
        assert ids == [f"{stream}/{k}" for k in range(len(ids))] and whole[-1][1] == "[DONE]"
        for k in (0, len(ids) // 2, len(ids) - 2):
            async with s.post(server.url + "/v1/completions", json=BODY,
                              headers={"Last-Event-ID": ids[k]}) as r:
                assert r.status == 200 and r.headers["X-Request-Id"] == stream
                assert await _events(r) == whole[k + 1:]
        for bad in (f"{stream}x/3", "no-such-stream/1", "garbage"):
            async with s.post(server.url + "/v1/completions", json=BODY,
                              headers={"Last-Event-ID": bad}) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "stream_not_found"


async def test_a_stream_nobody_resumes_is_aborted_after_the_grace(server, backend):
    async with aiohttp.ClientSession() as s:
        resp = await s.post(server.url + "/v1/completions",
                            json={**BODY, "max_tokens": 900, "stream": True})
        stream = resp.headers["X-Request-Id"]
        await resp.content.readline()
        resp.close()  # gone for good
    for _ in range(200):
        if stream in backend.aborted:
            break
        await asyncio.sleep(0.05)
    assert stream in backend.aborted
