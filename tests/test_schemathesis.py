"""The OpenAI spec subset (`../shared/openai/openapi-subset.json`) fuzzed with
schemathesis against a real server: whatever it sends, the answer is never a 5xx.

The spec's `model` is pinned to the served name so requests get past the model check
into the generation code; the server's context is short (64 tokens) so a request without
`max_tokens` stays quick.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from phalanx.server import EngineBackend  # noqa: E402
from app_server import serving  # noqa: E402

MODEL = "tiny-test"
SPEC = Path(__file__).resolve().parents[2] / "shared" / "openai" / "openapi-subset.json"

pytestmark = pytest.mark.skipif(not SPEC.is_file(), reason=f"no spec at {SPEC}")


@pytest.fixture(scope="module")
def server(tiny_model):
    backend = EngineBackend.from_model_dir(tiny_model, model_name=MODEL, num_pages=256,
                                           max_model_len=64)
    with serving(backend, stream_resume_s=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    spec = json.loads(SPEC.read_text())
    schemas = spec["components"]["schemas"]
    schemas["CreateCompletionRequest"]["properties"]["model"] = {"const": MODEL}
    schemas["CreateChatCompletionRequest"]["allOf"][1]["properties"]["model"] = {"const": MODEL}
    spec["servers"] = [{"url": server.url + "/v1"}]
    return schemathesis.openapi.from_dict(spec)


@pytest.mark.parametrize("path, method", [("/completions", "POST"),
                                          ("/chat/completions", "POST"), ("/models", "GET")])
def test_no_request_gets_a_server_error(api_schema, path, method):
    operation = api_schema[path][method]
    base_url = api_schema.raw_schema["servers"][0]["url"]

    @given(case=operation.as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, derandomize=True)
    def check(case):
        response = case.call(base_url=base_url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])

    check()
