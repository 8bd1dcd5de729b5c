"""Incremental detokenization, stop strings and request decoding (no server, no model)."""

from __future__ import annotations

import random

import pytest

from phalanx.server import protocol as proto
from phalanx.server.detokenizer import IncrementalDetokenizer, TextAssembler, TextRules
from phalanx.server.errors import OpenAIError


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(ids[i:i + n])
        i += n
    return out


def test_incremental_text_equals_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    text = "naïve café — “quotes” 日本語 🙂 end"
    samples = [tokenizer.encode(text, add_special_tokens=False)]
    samples += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in samples:
        detok = IncrementalDetokenizer(tokenizer)
        parts = [detok.push(c) for c in _chunks(ids, rng)] + [detok.push([], final=True)]
        assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer)
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1 and detok.push(emoji[:1]) == ""  # half a character waits


def test_stop_strings_cut_the_text_across_chunk_boundaries(tokenizer):
    text = "one two three four five six"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop, expected in [(["three"], "one two "), (["x", "e f"], "one two thre"), (["ve s"], "one two three four fi"),
                           ([" six", "o t"], "one tw"), (["absent"], text)]:
        for seed in range(5):
            asm = TextAssembler(tokenizer, TextRules(stop=tuple(stop)))
            chunks = _chunks(ids, random.Random(seed))
            out = "".join(asm.feed(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks))
            assert out == expected and asm.text == expected
            assert asm.stopped == (expected != text)


def _decode_error(body: bytes, cls=proto.CompletionRequest) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        proto.decode_request(body, cls)
    assert e.value.status == 400
    return e.value


def test_decoding_is_strict_and_names_the_param():
    assert _decode_error(b'{"model":"m","prompt":"x","max_tokens":"3"}').param == "max_tokens"
    assert _decode_error(b'{"model":"m","prompt":"x","seed":1.5}').param == "seed"
    assert _decode_error(b'{"model":"m","prompt":"x","stream":"yes"}').param == "stream"
    assert _decode_error(b'{"model":"m","prompt":"x","stop":["a","b","c","d","e"]}').param == "stop"
    assert _decode_error(b'{"model":"m","prompt":"x","suffix":"y"}').param == "suffix"
    assert _decode_error(b'{"model":"m","prompt":"x","logprobs":-1}').param == "logprobs"
    assert _decode_error(b'{"model":"m","prompt":"x","max_tokens":0}').param == "max_tokens"
    assert _decode_error(b'{"model":"m","prompt":"x","n":2,"best_of":1}').param == "best_of"
    assert _decode_error(b'{"model":"m","prompt":"x","top_p":0}').param == "top_p"
    assert _decode_error(b'{"model":"m","prompt":"x","temperature":2.5}').param == "temperature"
    assert _decode_error(b'{"model":"m","prompt":"x","stream_options":{"foo":1}}').param \
        == "stream_options.foo"
    image = proto.decode_request(b'{"model":"m","messages":[{"role":"user","content":'
                                 b'[{"type":"image_url"}]}]}', proto.ChatCompletionRequest)
    with pytest.raises(OpenAIError) as e:
        proto.chat_messages(image)
    assert e.value.param == "messages[0].content[0]"
    assert _decode_error(b'\xff\xfe').code == "invalid_json"


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes(prompt, expected):
    req = proto.CompletionRequest(model="m", prompt=prompt)
    assert proto.completion_prompts(req) == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[]], [True], [[1], "a"], [1.0]])
def test_bad_prompt_shapes(prompt):
    with pytest.raises(OpenAIError) as e:
        proto.completion_prompts(proto.CompletionRequest(model="m", prompt=prompt))
    assert e.value.param == "prompt"


def test_chat_messages_and_params():
    req = proto.decode_request(
        b'{"model":"m","messages":[{"role":"developer","content":"be brief"},'
        b'{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},'
        b'{"role":"assistant","content":null}],"max_completion_tokens":5,"top_k":3,"seed":7}',
        proto.ChatCompletionRequest)
    assert proto.chat_messages(req) == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "ab"},
                                        {"role": "assistant", "content": ""}]
    params = proto.sampling_params(req, 5)
    assert (params.top_k, params.seed, params.max_tokens, params.temperature) == (3, 7, 5, 1.0)


async def test_long_prompts_are_tokenized_off_the_event_loop(tiny_model):
    """Prompts past OFFLOAD_CHARS (completions and chat) are tokenized on the tokenizer
    thread, short ones on the loop; errors come back through the await as OpenAIError."""
    import threading
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from phalanx.server.handlers import OFFLOAD_CHARS, GenerationHandlers
    from phalanx.server.metrics import ServerMetrics

    real = AutoTokenizer.from_pretrained(tiny_model)
    threads: list[str] = []

    class Recording:
        def encode(self, text, **kwargs):
            threads.append(threading.current_thread().name)
            return real.encode(text, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    backend = SimpleNamespace(tokenizer=Recording(), max_model_len=1 << 20, eos_token_ids=())
    handlers = GenerationHandlers(backend, ServerMetrics(), "m")
    long_text = "red green blue " * (OFFLOAD_CHARS // 15 + 1)
    try:
        for prompt in ("a short prompt", long_text):
            req = proto.CompletionRequest(model="m", prompt=prompt)
            plan = await handlers.plan(req)
            assert plan.prompts == [real.encode(prompt, add_special_tokens=False)]
        chat = proto.ChatCompletionRequest(model="m", messages=[
            proto.ChatMessageIn(role="user", content=long_text)])
        await handlers.plan(chat)
        loop_thread = threading.current_thread().name
        assert threads[0] == loop_thread
        assert all(t.startswith("phalanx-tokenize") for t in threads[1:]), threads
        backend.max_model_len = 64
        with pytest.raises(OpenAIError) as err:
            await handlers.plan(proto.CompletionRequest(model="m", prompt=long_text))
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    finally:
        handlers.close()
