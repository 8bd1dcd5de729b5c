"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client:
whole and streamed answers equal the offline `LLM.chat` of the same conversation,
usage and status as the client reads them, a JSON-schema `text.format`, and 400s
naming the Responses field for what phalanx does not run."""

from __future__ import annotations

import json

import openai
import pytest

from phalanx import LLM, SamplingParams
from app_server import served_engine

MODEL = "tiny-responses"
ASK = "Name three colors."


@pytest.fixture(scope="module")
def server(tiny_model):
    with served_engine(tiny_model, MODEL, max_num_seqs=4, num_pages=256) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, max_num_seqs=4, num_pages=256)


def _chat(offline, messages, max_tokens):
    (out,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    return out


async def test_a_response_equals_the_offline_chat(client, offline):
    got = await client.responses.create(model=MODEL, input=ASK, max_output_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
    want = _chat(offline, [{"role": "user", "content": ASK}], 8)
    assert got.output_text == want.outputs[0].text and got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.output[0].type == "message" and got.output[0].role == "assistant"
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert got.usage.output_tokens == 8 and got.usage.total_tokens == got.usage.input_tokens + 8
    assert got.id.startswith("resp_") and got.model == MODEL
    # instructions are a system message; input items are the turns; EOS may end it early
    turns = [{"role": "user", "content": ASK},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Red, blue"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And two more?"}]}]
    got = await client.responses.create(model=MODEL, input=turns, instructions="Be brief.",
                                        max_output_tokens=12, temperature=0)
    (want,) = offline.chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": ASK},
                            {"role": "assistant", "content": "Red, blue"},
                            {"role": "user", "content": "And two more?"}],
                           SamplingParams(temperature=0, max_tokens=12))
    assert got.output_text == want.outputs[0].text
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert got.status == ("incomplete" if want.outputs[0].finish_reason == "length" else "completed")


async def test_a_streamed_response_is_the_same_in_openais_events(client, offline):
    stream = await client.responses.create(model=MODEL, input=ASK, max_output_tokens=10,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    want = _chat(offline, [{"role": "user", "content": ASK}], 10)
    assert text == want.outputs[0].text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10
    assert final.usage.input_tokens == len(want.prompt_token_ids)


async def test_a_json_schema_text_format_constrains_the_output(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 8}},
              "required": ["color"], "additionalProperties": False}
    got = await client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                         "strict": True}})
    assert got.status == "completed" and set(json.loads(got.output_text)) == {"color"}
    assert got.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3.0}, "temperature"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
])
async def test_what_it_does_not_run_is_a_400_naming_the_field(client, fields, param):
    body = {"input": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model=MODEL, **{k: v for k, v in body.items()
                                                      if k in ("input", "max_output_tokens",
                                                               "temperature", "truncation",
                                                               "tools", "previous_response_id")},
                                      extra_body={k: v for k, v in body.items()
                                                  if k == "frobnicate"})
    assert err.value.body["param"] == param
