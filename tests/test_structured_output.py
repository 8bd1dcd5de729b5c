"""Structured output end to end: 20 random JSON schemas through the server with the
official `openai` client (every answer parses and validates), vLLM's constraint fields,
the same output in the engine after a resume, and clean 400s for bad constraints."""

from __future__ import annotations

import json
import random

import aiohttp
import jsonschema
import pytest
from openai import BadRequestError

from phalanx import LLM, SamplingParams
from phalanx.actors.resume import resume_from
from phalanx.engine.structured_output import StructuredOutput
from app_server import served_engine

MODEL = "tiny-test"


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of objects, arrays, enums, bounded strings, integers and booleans;
    every value is bounded so a random model finishes it (no "number": a schema cannot
    bound a fraction's digits, and random weights never stop writing them)."""
    kinds = ["string", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    props = {f"k{i}_{rng.choice('abcxyz')}": random_schema(rng, depth + 1)
             for i in range(rng.randint(1, 4))}
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model):
    with served_engine(tiny_model, MODEL, max_num_seqs=32, num_pages=512) as srv:
        yield srv


async def test_twenty_random_schemas_give_valid_json(client):
    import asyncio

    rng = random.Random(2026)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng, 1),
                                                 "more": random_schema(rng)},
                "required": ["answer", "more"], "additionalProperties": False}
               for _ in range(20)]

    async def ask(i: int, schema: dict):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Answer {i} in JSON."}],
            max_tokens=400, temperature=1.0, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})

    answers = await asyncio.gather(*(ask(i, s) for i, s in enumerate(schemas)))
    for schema, out in zip(schemas, answers):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


async def test_json_object_and_streaming(client):
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=300,
        temperature=0.8, seed=4, response_format={"type": "json_object"}, stream=True)
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert isinstance(json.loads(text), dict)


async def test_vllm_constraint_fields(server):
    cases = [
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
         lambda t: t in ("alpha", "beta", "gamma")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
         lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
        ({"guided_json": {"type": "object", "properties": {"x": {"type": "boolean"}},
                          "required": ["x"], "additionalProperties": False}},
         lambda t: isinstance(json.loads(t)["x"], bool)),
        ({"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")+ "d"'}},  # GBNF
         lambda t: t[0] == "a" and t[-1] == "d" and set(t[1:-1]) <= {"b", "c"}),
        ({"structured_outputs": {"grammar": 'start: "x" /[0-9]+/ "y"'}},  # Lark
         lambda t: t[0] == "x" and t[-1] == "y" and t[1:-1].isdigit()),
    ]
    async with aiohttp.ClientSession() as s:
        for extra, ok in cases:
            body = {"model": MODEL, "prompt": "Say:", "max_tokens": 40, "temperature": 1.0,
                    "seed": 3, **extra}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
            text = data["choices"][0]["text"]
            assert data["choices"][0]["finish_reason"] == "stop" and ok(text), (extra, text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                 "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json"),
])
async def test_bad_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(BadRequestError) as e:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_a_resumed_constrained_request_continues_alike(tiny_model):
    llm = LLM(tiny_model, num_pages=256)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"type": "array", "items": {"type": "integer",
                                                     "minimum": 0, "maximum": 99}, "maxItems": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=80,
                            structured=StructuredOutput.json_schema(schema))
    (full,) = llm.generate(["Data:"], params)
    ids = full.outputs[0].token_ids
    jsonschema.validate(json.loads(full.outputs[0].text), schema)
    prompt = llm.tokenizer.encode("Data:", add_special_tokens=False)
    for cut in (1, len(ids) // 2):
        tokens, resumed, _ = resume_from(prompt, params, ids[:cut])
        (rest,) = llm.generate(prompt_token_ids=[tokens], sampling_params=resumed)
        assert ids[:cut] + rest.outputs[0].token_ids == ids


def test_a_tokenizer_llguidance_cannot_read_fails_constrained_requests_clearly(tmp_path):
    """The background load logs one line (no thread traceback); a constrained request
    then gets a ValueError naming the cause, which admission turns into a 400."""
    import time

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from phalanx.engine.grammars import Grammars

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(50)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # a decoder llguidance does not know
    tok.save(str(tmp_path / "tokenizer.json"))
    grammars = Grammars(str(tmp_path), 50, [0])
    grammars.warm()
    time.sleep(0.5)
    with pytest.raises(ValueError, match="structured output: the model's tokenizer.json"):
        grammars.matcher(StructuredOutput("json_object"))
