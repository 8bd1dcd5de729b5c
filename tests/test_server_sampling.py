"""The server's sampling fields with clients nobody here wrote: the official `openai`
package and lm-evaluation-harness' request shapes. Every answer is compared with the
offline `LLM` on the same model and params."""

from __future__ import annotations

import json
import math

import aiohttp
import pytest

from phalanx import LLM, SamplingParams
from app_server import served_engine

MODEL = "tiny-test"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def server(tiny_model):
    with served_engine(tiny_model, MODEL, max_num_seqs=16, num_pages=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, max_num_seqs=16, num_pages=512)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False)


async def test_completion_logprobs_equal_offline_and_stream_alike(client, offline):
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3,
                                          temperature=0.7, seed=11, extra_body={"ignore_eos": True})
    (ref,) = offline.generate([PROMPT], SamplingParams(temperature=0.7, seed=11, max_tokens=6,
                                                      logprobs=3, ignore_eos=True))
    lp = out.choices[0].logprobs
    want = ref.outputs[0].logprobs
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-5)
    assert lp.tokens == [offline.tokenizer.decode([w.token]) for w in want]
    assert [len(t) for t in lp.top_logprobs] == [3] * 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    streamed = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, temperature=0.7, seed=11,
        stream=True, extra_body={"ignore_eos": True})
    tokens, values, offsets = [], [], []
    async for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    assert values == pytest.approx(lp.token_logprobs, abs=1e-4)


async def test_loglikelihood_request_of_lm_eval(server, offline):
    """lm-evaluation-harness' `local-completions` loglikelihood: echo, logprobs 1,
    max_tokens 0, temperature 0; it reads token_logprobs of the continuation's tokens and
    whether each was the top token."""
    context, continuation = "Paris is the capital of", " France"
    body = {"model": MODEL, "prompt": [context + continuation, "2 + 2 ="], "echo": True,
            "logprobs": 1, "max_tokens": 0, "temperature": 0.0, "seed": 1234}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 0
    for choice, text in zip(data["choices"], body["prompt"]):
        assert choice["text"] == text and choice["finish_reason"] == "length"
        ids = _ids(offline, text)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        (ref,) = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=1))
        want = [w.logprob for w in ref.prompt_logprobs[1:]]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
        for k, top in enumerate(lp["top_logprobs"][1:], start=1):  # greedy check as lm-eval
            is_greedy = ref.prompt_logprobs[k].rank == 1
            assert (max(top, key=top.get) == lp["tokens"][k]) == is_greedy or \
                len(top) == 1 and list(top.values())[0] == pytest.approx(lp["token_logprobs"][k])
    # `echo` without logprobs: the prompt is repeated before the completion.
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "Hello", "echo": True, "max_tokens": 3,
                "temperature": 0}) as r:
            data = await r.json()
    (ref,) = offline.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))
    assert data["choices"][0]["text"] == "Hello" + ref.outputs[0].text


async def test_chat_logprobs_shape(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                               temperature=0, logprobs=True, top_logprobs=4)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    (ref,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, logprobs=4))
    assert [c.logprob for c in content] == pytest.approx(
        [w.logprob for w in ref.outputs[0].logprobs], abs=1e-5)
    for c in content:
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].token == c.token
        assert bytes(c.bytes).decode(errors="replace") == c.token
    chunks = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                  temperature=0, logprobs=True, stream=True)
    streamed = []
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [c.logprob for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)


async def test_n_choices_and_best_of(client, offline):
    out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3,
                                          temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        (ref,) = offline.generate([PROMPT], SamplingParams(temperature=1.0, seed=5 + i,
                                                          max_tokens=6, ignore_eos=True))
        assert choice.text == ref.outputs[0].text
    assert out.usage.completion_tokens == 18
    two = await client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=3, n=2,
                                          temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy: the same choice twice
    best = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=1,
                                           best_of=3, temperature=1.0, seed=5,
                                           extra_body={"ignore_eos": True})
    sums = [sum(lp.logprob for lp in offline.generate([PROMPT], SamplingParams(
        temperature=1.0, seed=5 + i, max_tokens=6, ignore_eos=True, logprobs=0))[0]
        .outputs[0].logprobs) for i in range(3)]
    assert best.choices[0].text == out.choices[max(range(3), key=sums.__getitem__)].text
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 18
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=3,
        stream=True)
    seen = set()
    async for chunk in chat:
        seen |= {c.index for c in chunk.choices}
    assert seen == {0, 1}


async def test_penalties_bias_and_min_tokens_equal_offline(client, offline):
    eos = offline.config.model.eos_token_ids[0]
    fields = dict(temperature=0.8, seed=9, presence_penalty=0.5, frequency_penalty=1.2,
                  max_tokens=8)
    extra = {"repetition_penalty": 1.3, "min_tokens": 8,
             "logit_bias": {str(eos): 50.0, "17": -100.0}}
    out = await client.completions.create(model=MODEL, prompt=PROMPT, extra_body={
        **extra, "return_token_ids": True}, **fields)
    ref = SamplingParams(**fields, repetition_penalty=1.3, min_tokens=8,
                         logit_bias={eos: 50.0, 17: -100.0})
    (want,) = offline.generate([PROMPT], ref)
    got = out.choices[0].model_extra["token_ids"]
    assert got == want.outputs[0].token_ids and len(got) == 8 and 17 not in got
    assert eos not in got  # held back by min_tokens despite a bias of 50
    # Past min_tokens the biased EOS ends the choice at once.
    short = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                            temperature=0, logit_bias={str(eos): 100},
                                            extra_body={"min_tokens": 2})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "stop"


async def test_the_filtered_tokens_logprob_is_finite_json(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "logprobs": 5, "top_k": 2,
            "temperature": 1.0, "seed": 3}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=body) as r:
            text = await r.text()
    data = json.loads(text)
    for top in data["choices"][0]["logprobs"]["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        assert all(math.isfinite(v) for v in values) and values[-1] == -9999.0


async def test_n_choices_share_the_prompts_pages(client, offline):
    prompt = " ".join(f"word{i}" for i in range(60))
    pages = len(_ids(offline, prompt)) // 16  # full pages of the backend's 16-token pages
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3,
                                          temperature=1.0, seed=1)
    # The first choice computed the prompt; the other two found its full pages cached.
    assert pages >= 2
    assert out.usage.prompt_tokens_details.cached_tokens >= 2 * (pages - 1) * 16


FIELDS = [
    dict(n=2, seed=4),
    dict(seed=5, presence_penalty=0.8, frequency_penalty=0.5, logit_bias={"17": 5},
         extra_body={"repetition_penalty": 1.2, "min_tokens": 3, "top_k": 40, "min_p": 0.05}),
    dict(seed=6, response_format={"type": "json_object"}, max_tokens=60),
    dict(seed=7, stop=["e"], extra_body={"stop_token_ids": [5, 6]}),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields", FIELDS, ids=["n", "penalties", "json", "stops"])
async def test_every_field_streams_what_it_answers_whole(client, route, fields):
    """Each field through the openai client on both routes: the streamed choices' text
    equals the whole answer's (same seed), and each choice's finish reason too."""
    kw = {"model": MODEL, "max_tokens": 12, "temperature": 0.9, **fields,
          "extra_body": dict(fields.get("extra_body", {}))}
    if route == "completions":
        if "response_format" in kw:  # not a parameter of the client's completions.create
            kw["extra_body"]["response_format"] = kw.pop("response_format")
        create, text_of = client.completions.create, (lambda c: c.text)
        kw["prompt"] = PROMPT
    else:
        create, text_of = client.chat.completions.create, (lambda c: c.message.content)
        kw["messages"] = [{"role": "user", "content": PROMPT}]
    whole = await create(**kw)
    texts, reasons = {}, {}
    async for chunk in await create(**kw, stream=True):
        for c in chunk.choices:
            piece = c.text if route == "completions" else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [texts[i] for i in sorted(texts)] == [text_of(c) for c in whole.choices]
    assert [reasons[i] for i in sorted(reasons)] == [c.finish_reason for c in whole.choices]
    if "response_format" in fields:
        assert all(isinstance(json.loads(text_of(c)), dict) for c in whole.choices
                   if c.finish_reason == "stop")
