"""Tool calls through the server with the official `openai` client: a forced call whose
arguments validate against the tool's schema, the call and its result sent back for the
next turn, streamed calls equal to whole ones, and the 400s of bad tool fields."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError

from phalanx.server import EngineBackend
from app_server import serving

MODEL = "tiny-test"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def backend(tiny_model):
    return EngineBackend.from_model_dir(tiny_model, model_name=MODEL, num_pages=512)


@pytest.fixture(scope="module")
def server(backend):
    with serving(backend, stream_resume_s=0) as srv:
        yield srv


async def test_a_named_call_round_trip(client, backend):
    out = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # The call and its result go back for the next turn (the template renders both).
    follow = ASK + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = await client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS,
                                                 max_tokens=5, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = backend.tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert again.usage.prompt_tokens == len(backend.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("seed", [2, 3, 4])
async def test_required_calls_streamed_equal_whole(client, seed):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
              temperature=1.0, seed=seed)
    whole = (await client.chat.completions.create(**kw)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, reason = {}, None
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                calls[d.index] = (d.function.name, d.function.arguments)
            reason = c.finish_reason or reason
    assert reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


async def test_tool_choice_none_renders_no_tools(client):
    with_none = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                     tool_choice="none", max_tokens=3, temperature=0)
    without = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                                   temperature=0)
    auto = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=3, temperature=0)
    assert with_none.usage.prompt_tokens == without.usage.prompt_tokens < auto.usage.prompt_tokens
    assert with_none.choices[0].message.content == without.choices[0].message.content


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools[0].type"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "response_format"),
    (dict(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                "function": {"name": "f",
                                                                             "arguments": "{x"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
])
async def test_bad_tool_fields_are_400(client, kw, param):
    with pytest.raises(BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, **{"messages": ASK, **kw}, max_tokens=3)
    assert e.value.body["param"] == param, e.value.body
