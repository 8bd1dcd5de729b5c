"""vLLM's chat-rendering fields on `/v1/chat/completions` and `/tokenize`:
`chat_template_kwargs` (Qwen3's `{"enable_thinking": false}`, the one Qwen3 users send
most), `add_generation_prompt` and `continue_final_message`, through the official `openai`
client's `extra_body`. The model is the tiny one with Qwen3's generation-prompt ending in
its template (an empty think block when `enable_thinking` is false); every answer is
compared with the offline `LLM.chat` given the same fields."""

from __future__ import annotations

import json
import shutil

import aiohttp
import openai
import pytest

from phalanx import LLM, SamplingParams
from app_server import served_engine

MODEL = "tiny-template"
PLAIN_END = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
QWEN3_END = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
             "{%- if enable_thinking is defined and enable_thinking is false %}"
             "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
ASK = [{"role": "user", "content": "Name three colors."}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_template") / "model"
    shutil.copytree(tiny_model, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["chat_template"].endswith(PLAIN_END)
    cfg["chat_template"] = cfg["chat_template"][:-len(PLAIN_END)] + QWEN3_END
    cfg_path.write_text(json.dumps(cfg))
    return str(folder)


@pytest.fixture(scope="module")
def server(model_dir):
    with served_engine(model_dir, MODEL, max_num_seqs=4, num_pages=256) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, max_num_seqs=4, num_pages=256)


async def _chat(client, messages, **extra):
    return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True, **extra})


async def test_enable_thinking_false_reaches_the_template(client, offline):
    off = await _chat(client, ASK, chat_template_kwargs={"enable_thinking": False})
    on = await _chat(client, ASK)
    (want,) = offline.chat(ASK, PARAMS, chat_template_kwargs={"enable_thinking": False})
    (plain,) = offline.chat(ASK, PARAMS)
    think = offline.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert want.prompt_token_ids == plain.prompt_token_ids + think
    assert off.usage.prompt_tokens == len(want.prompt_token_ids)
    assert on.usage.prompt_tokens == len(plain.prompt_token_ids)
    assert off.choices[0].message.content == want.outputs[0].text
    assert on.choices[0].message.content == plain.outputs[0].text


async def test_continue_final_message_extends_the_assistant_turn(client, offline):
    convo = ASK + [{"role": "assistant", "content": "Red, green"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=convo, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "add_generation_prompt": False,
                    "continue_final_message": True})
    text, usage = "", None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    (want,) = offline.chat(convo, PARAMS, add_generation_prompt=False, continue_final_message=True)
    assert offline.tokenizer.decode(want.prompt_token_ids).endswith("Red, green")
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert text == want.outputs[0].text


async def test_tokenize_renders_messages_as_the_chat_route(server, client):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/tokenize", json={"messages": ASK, **kwargs}) as r:
            assert r.status == 200
            count = (await r.json())["count"]
    assert count == (await _chat(client, ASK, **kwargs)).usage.prompt_tokens


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default header
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
])
async def test_bad_template_fields_are_400_naming_the_field(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        await _chat(client, ASK, **extra)
    assert err.value.body["param"] == param
    if "chat_template_kwargs" in extra or "continue_final_message" in extra:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/tokenize", json={"messages": ASK, **extra}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_echo_leads_with_the_assistants_last_message(client, offline):
    """vLLM's chat `echo`: the final assistant message's text comes first in each choice,
    whole and streamed alike; after a user's message there is nothing to echo."""
    convo = ASK + [{"role": "assistant", "content": "Red, green"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    (want,) = offline.chat(convo, PARAMS, add_generation_prompt=False, continue_final_message=True)
    whole = await _chat(client, convo, **extra)
    assert whole.choices[0].message.content == "Red, green" + want.outputs[0].text
    stream = await client.chat.completions.create(
        model=MODEL, messages=convo, max_tokens=6, temperature=0, stream=True, n=2,
        extra_body={"ignore_eos": True, **extra})
    texts = ["", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [whole.choices[0].message.content] * 2
    (plain,) = offline.chat(ASK, PARAMS)
    assert (await _chat(client, ASK, echo=True)).choices[0].message.content == plain.outputs[0].text
