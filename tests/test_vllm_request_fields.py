"""vLLM's request fields beyond the sampling basics, through the official `openai` client's
`extra_body`: `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
`skip_special_tokens`, `truncate_prompt_tokens`, `add_special_tokens`,
`return_tokens_as_token_ids`, `prompt_logprobs`, the prompt's ids with `return_token_ids`,
`priority`, `cache_salt`, `stop_reason`, `stream_options.continuous_usage_stats`, and
`min_tokens` against `stop` strings.

The model is the tiny one with a tokenizer that adds a BOS (`<|im_start|>`), so
`add_special_tokens` shows. Tokens are compared with the offline `LLM` given the same
params; text with the tokenizer's decoding of those tokens under vLLM's rules."""

from __future__ import annotations

import json
import shutil

import aiohttp
import openai
import pytest

from phalanx import LLM, SamplingParams
from phalanx.engine.bad_words import bad_words_token_ids
from app_server import served_engine

MODEL = "tiny-bos"
BOS = "<|im_start|>"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    """The tiny model whose tokenizer puts a BOS before every encoded text."""
    folder = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_model, folder)
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    bos_id = next(a["id"] for a in tok["added_tokens"] if a["content"] == BOS)
    lead = [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    tok["post_processor"] = {"type": "Sequence", "processors": [tok["post_processor"], {
        "type": "TemplateProcessing", "single": lead,
        "pair": lead + [{"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}}}]}
    path.write_text(json.dumps(tok))
    return str(folder)


@pytest.fixture(scope="module")
def server(model_dir):
    with served_engine(model_dir, MODEL, max_num_seqs=4, num_pages=256,
                       max_model_len=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_num_seqs=4, num_pages=256)


async def _complete(client, prompt=PROMPT, max_tokens=12, temperature=0.0, **extra):
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=temperature,
                                          extra_body={"return_token_ids": True, **extra})
    choice = out.choices[0]
    return choice.text, choice.model_extra["token_ids"], choice.finish_reason, out.usage


def _offline(offline, ids, **params):
    (out,) = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(**params))
    return out.outputs[0]


def _contains(seq: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(part)]) == part for i in range(len(seq) - len(part) + 1))


async def test_allowed_token_ids_are_all_that_is_drawn(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    greedy = _offline(offline, ids, temperature=0, max_tokens=12, ignore_eos=True).token_ids
    allowed = sorted(set(greedy[1:6]) | {5, 77, 301})
    fields = dict(temperature=1.0, seed=11, max_tokens=12)
    text, got, _, _ = await _complete(client, allowed_token_ids=allowed, seed=11,
                                      temperature=1.0, ignore_eos=True)
    want = _offline(offline, ids, allowed_token_ids=allowed, ignore_eos=True, **fields)
    assert got == want.token_ids and set(got) <= set(allowed) and len(set(got)) > 1
    assert text == offline.tokenizer.decode(got, skip_special_tokens=True)


async def test_bad_words_never_appear_and_equal_offline(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    plain = _offline(offline, ids, temperature=0, max_tokens=12, ignore_eos=True)
    words = [offline.tokenizer.decode(plain.token_ids[2:4]).strip(),
             offline.tokenizer.decode(plain.token_ids[6:7]).strip()]
    banned = bad_words_token_ids(offline.tokenizer, words)
    assert any(_contains(plain.token_ids, b) for b in banned)  # the words were there
    text, got, _, _ = await _complete(client, bad_words=words, ignore_eos=True)
    want = _offline(offline, ids, temperature=0, max_tokens=12, ignore_eos=True,
                    bad_words_token_ids=banned)
    assert got == want.token_ids and text == want.text
    assert not any(_contains(got, b) for b in banned)


async def test_the_token_that_stopped_a_choice_and_stop_strings_in_its_text(client, offline):
    tok = offline.tokenizer
    ids = tok.encode(PROMPT)
    plain = _offline(offline, ids, temperature=0, max_tokens=12, ignore_eos=True).token_ids
    stop_id = plain[4]
    text, got, reason, _ = await _complete(client, stop_token_ids=[stop_id], ignore_eos=True)
    cut = plain[:plain.index(stop_id) + 1]
    assert got == cut and reason == "stop"
    assert text == tok.decode(cut[:-1]) == _offline(offline, ids, temperature=0, max_tokens=12,
                                                     ignore_eos=True, stop_token_ids=[stop_id]).text
    kept, _, _, _ = await _complete(client, stop_token_ids=[stop_id], ignore_eos=True,
                                    include_stop_str_in_output=True)
    assert kept == tok.decode(cut)
    full = tok.decode(plain)
    stop = full[len(tok.decode(plain[:3])) + 1:][:4]
    before, _, _, _ = await _complete(client, stop=[stop], ignore_eos=True)
    with_it, _, _, _ = await _complete(client, stop=[stop], ignore_eos=True,
                                       include_stop_str_in_output=True)
    assert before == full[:full.index(stop)] and with_it == before + stop


async def test_stop_reason_names_what_ended_a_choice(client, offline):
    """vLLM's `stop_reason`: the stop string or the listed stop token; null for EOS and
    length; on the last chunk of a stream."""
    tok = offline.tokenizer
    plain = _offline(offline, tok.encode(PROMPT), temperature=0, max_tokens=12,
                     ignore_eos=True).token_ids
    stop_id, stop = plain[3], tok.decode(plain[5:7]).strip()[:3]
    eos = offline.config.model.eos_token_ids[0]
    cases = [({"stop_token_ids": [stop_id], "ignore_eos": True}, stop_id),
             ({"stop": [stop], "ignore_eos": True}, stop),
             ({"allowed_token_ids": [eos], "stop_token_ids": [eos]}, None),  # EOS wins
             ({"ignore_eos": True}, None)]  # length
    for extra, want in cases:
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                              temperature=0, extra_body=extra)
        assert out.choices[0].model_extra["stop_reason"] == want, extra
    messages = [{"role": "user", "content": PROMPT}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, extra_body={"ignore_eos": True})
    stop = whole.choices[0].message.content[4:7]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        extra_body={"stop": [stop], "ignore_eos": True})
    chunks = [c async for c in stream]
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


async def test_a_stop_string_within_min_tokens_does_not_count(client, offline):
    tok = offline.tokenizer
    plain = _offline(offline, tok.encode(PROMPT), temperature=0, max_tokens=12,
                     ignore_eos=True).token_ids
    full = tok.decode(plain)
    stop = tok.decode(plain[1:2]).strip()[:2]  # text of the second token
    floor = len(tok.decode(plain[:4]))
    later = [i for i in range(len(full)) if full.startswith(stop, i) and i + len(stop) > floor]
    want = full[:later[0]] if later else full
    assert len(want) > full.index(stop)  # the first match was inside the first 4 tokens
    text, _, _, _ = await _complete(client, stop=[stop], min_tokens=4, ignore_eos=True)
    assert text == want


async def test_special_tokens_in_text_only_when_asked(client, offline):
    tok = offline.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos = offline.config.model.eos_token_ids[0]
    skipped, got, _, _ = await _complete(client, max_tokens=3, allowed_token_ids=[im_end],
                                         ignore_eos=True)
    shown, _, _, _ = await _complete(client, max_tokens=3, allowed_token_ids=[im_end],
                                     ignore_eos=True, skip_special_tokens=False)
    assert got == [im_end] * 3 and skipped == "" and shown == "<|im_end|>" * 3
    # EOS that ended the choice is not text, even unskipped, unless include_stop_str_in_output
    ended, got, reason, _ = await _complete(client, max_tokens=3, allowed_token_ids=[eos],
                                            skip_special_tokens=False)
    kept, _, _, _ = await _complete(client, max_tokens=3, allowed_token_ids=[eos],
                                    skip_special_tokens=False, include_stop_str_in_output=True)
    assert got == [eos] and reason == "stop" and ended == "" and kept == tok.decode([eos])


async def test_add_special_tokens_and_truncation(client, server, offline):
    tok = offline.tokenizer
    with_bos, bare = tok.encode(PROMPT), tok.encode(PROMPT, add_special_tokens=False)
    assert with_bos == tok.encode(BOS, add_special_tokens=False) + bare
    _, _, _, usage = await _complete(client, max_tokens=1)
    _, _, _, off = await _complete(client, max_tokens=1, add_special_tokens=False)
    assert usage.prompt_tokens == len(with_bos) and off.prompt_tokens == len(bare)
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/tokenize", json={"prompt": PROMPT}) as r:
            assert (await r.json())["count"] == usage.prompt_tokens
    text, got, _, usage = await _complete(client, truncate_prompt_tokens=5, ignore_eos=True)
    assert usage.prompt_tokens == 5
    assert got == _offline(offline, with_bos[-5:], temperature=0, max_tokens=12,
                           ignore_eos=True).token_ids
    _, got, _, usage = await _complete(client, truncate_prompt_tokens=5, ignore_eos=True,
                                       truncation_side="right")
    assert usage.prompt_tokens == 5
    assert got == _offline(offline, with_bos[:5], temperature=0, max_tokens=12,
                           ignore_eos=True).token_ids
    _, _, _, whole = await _complete(client, max_tokens=1, truncate_prompt_tokens=-1)
    assert whole.prompt_tokens == len(with_bos)
    messages = [{"role": "user", "content": PROMPT}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    bos_chat = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"add_special_tokens": True})
    cut = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    (rendered,) = offline.chat(messages, SamplingParams(max_tokens=1))
    assert chat.usage.prompt_tokens == len(rendered.prompt_token_ids)
    assert bos_chat.usage.prompt_tokens == chat.usage.prompt_tokens + 1
    assert cut.usage.prompt_tokens == 3


async def test_logprobs_name_tokens_by_id_when_asked(client):
    out = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                    "ignore_eos": True})
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs for k in top)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                    "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in
                                          chat.choices[0].model_extra["token_ids"]]


async def test_cache_salt_shares_cached_pages_only_within_a_salt(client):
    """vLLM's `cache_salt`: a salted request finds none of the pages another salt (or no
    salt) left in the prefix cache, and all of its own salt's; its tokens are the same."""
    prompt = " ".join(f"token{i}" for i in range(40))

    async def cached(**extra):
        _, got, _, usage = await _complete(client, prompt=prompt, max_tokens=2,
                                           ignore_eos=True, **extra)
        return usage.prompt_tokens_details.cached_tokens, got

    first, tokens = await cached()
    seen = [await cached(), await cached(cache_salt="tenant-a"),
            await cached(cache_salt="tenant-a"), await cached(cache_salt="tenant-b")]
    assert first == 0 and [n > 0 for n, _ in seen] == [True, False, True, False]
    assert all(got == tokens for _, got in seen)


async def test_continuous_usage_stats_put_usage_on_every_chunk(client, offline):
    """vLLM's `stream_options.continuous_usage_stats`: each chunk carries its choice's
    prompt and the tokens it has streamed so far; the closing usage chunk the totals."""
    prompt_tokens = len(offline.tokenizer.encode(PROMPT))
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [c async for c in stream]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c.choices
        seen[choice.index] += len(choice.model_extra["token_ids"])
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == \
            (prompt_tokens, seen[choice.index])
    assert seen == {0: 5, 1: 5} and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 10
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
        temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chunks = [c async for c in chat]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].usage.prompt_tokens > 0
    assert [c.usage.completion_tokens for c in chunks[1:-1]][-1] == 3
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    plain_chunks = [c async for c in plain]
    assert all(c.usage is None for c in plain_chunks[:-1]) and plain_chunks[-1].usage


async def test_prompt_logprobs_and_prompt_token_ids_in_vllms_shape(client, offline):
    """`prompt_logprobs`: per prompt position `{id: {logprob, rank, decoded_token}}` for the
    prompt's token and the best alternatives, equal to the offline engine's (null first);
    `return_token_ids` also gives the prompt's ids (a stream: on each choice's first chunk)."""
    tok = offline.tokenizer
    ids = tok.encode(PROMPT)
    (want,) = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=2))
    out = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = out.choices[0].model_extra
    got = choice["prompt_logprobs"]
    assert choice["prompt_token_ids"] == ids and len(got) == len(ids) and got[0] is None
    for pos, (entry, ref) in enumerate(zip(got[1:], want.prompt_logprobs[1:]), start=1):
        mine = entry[str(ids[pos])]
        assert mine["logprob"] == pytest.approx(ref.logprob, abs=1e-5) and mine["rank"] == ref.rank
        assert mine["decoded_token"] == tok.decode([ids[pos]])
        for rank, (t, v) in enumerate(ref.top, start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-5)
            assert t == ids[pos] or entry[str(t)]["rank"] == rank
    messages = [{"role": "user", "content": PROMPT}]
    chat = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    extra = chat.model_extra
    (rendered,) = offline.chat(messages, SamplingParams(max_tokens=1))
    assert extra["prompt_token_ids"] == rendered.prompt_token_ids
    assert len(extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in extra["prompt_logprobs"][1:])  # the prompt's token only
    stream = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=5, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    firsts = {}
    for c in [c async for c in stream]:
        firsts.setdefault(c.choices[0].index, c.choices[0].model_extra.get("prompt_token_ids"))
    assert firsts == {0: ids, 1: ids}
    chat_stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
        extra_body={"return_token_ids": True})
    chunks = [c async for c in chat_stream]
    assert chunks[0].model_extra["prompt_token_ids"] == rendered.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])


async def test_vllms_defaults_sent_explicitly_are_served(client):
    """A client that writes out vLLM's whole request model sends these at their defaults."""
    defaults = dict(priority=0, use_beam_search=False, length_penalty=1.0,
                    spaces_between_special_tokens=True, skip_special_tokens=True,
                    include_stop_str_in_output=False, add_special_tokens=True, min_tokens=0,
                    truncate_prompt_tokens=None, allowed_token_ids=None, bad_words=[],
                    stop_token_ids=[], ignore_eos=False, prompt_logprobs=None)
    plain = await _complete(client, max_tokens=4)
    assert await _complete(client, max_tokens=4, **defaults) == plain


@pytest.mark.parametrize("extra, param", [
    ({"priority": 1}, "priority"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),  # outside the vocabulary
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),  # past the context
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"cache_salt": "s" * 1025}, "cache_salt"),
    ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, "truncation_side"),
])
async def test_bad_values_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        await _complete(client, max_tokens=2, **extra)
    assert err.value.body["param"] == param
