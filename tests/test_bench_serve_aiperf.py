"""bench/aiperf_client.py and bench/serve_aiperf.py without AIPerf: the command lines a
scenario makes, the answers read back from AIPerf's raw records, and the table's ratios
(tests/test_server_aiperf.py runs AIPerf itself)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from aiperf_client import Run, Scenario, response_text, response_usage  # noqa: E402
from serve_aiperf import level_row, table  # noqa: E402


def _flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_scenario_command_lines():
    closed = Scenario("c4", "completions", streaming=True, requests=8, concurrency=4, isl=16, osl=5)
    args = closed.args()
    assert _flag(args, "--concurrency") == ["4"] and "--request-rate" not in args
    assert _flag(args, "--request-count") == ["8"] and "--streaming" in args
    assert _flag(args, "--synthetic-input-tokens-stddev") == ["0"]
    assert _flag(args, "--extra-inputs") == ["ignore_eos:true", "temperature:0"]
    assert "--use-server-token-count" in args

    sessions = Scenario("s", "chat", streaming=False, conversations=3, turns=2, concurrency=0,
                        rate=5.0, server_token_count=False)
    args = sessions.args()
    assert sessions.expected_requests == 6 and _flag(args, "--request-count") == ["6"]
    assert _flag(args, "--request-rate") == ["5.0"] and "--concurrency" not in args
    assert _flag(args, "--conversation-turn-mean") == ["2"] and "--streaming" not in args
    assert "--use-server-token-count" not in args


@pytest.mark.parametrize("kwargs, match", [
    (dict(endpoint="embeddings"), "endpoint"),
    (dict(osl=0), "osl"),
    (dict(concurrency=0), "concurrency or a rate"),
    (dict(concurrency=2, rate=3.0), "concurrency or a rate"),
    (dict(endpoint="completions", conversations=2), "chat sessions"),
])
def test_scenario_refuses_what_aiperf_cannot_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scenario("x", **kwargs)


def _packet(body) -> dict:
    return {"name": "data", "value": body if isinstance(body, str) else json.dumps(body)}


def test_answers_from_streamed_and_whole_records():
    chunk = lambda delta, usage=None: {"choices": [{"index": 0, "delta": delta}], "usage": usage}  # noqa: E731
    streamed = {"responses": [
        {"packets": [{"name": "id", "value": "s/0"}, _packet(chunk({"role": "assistant", "content": ""}))]},
        {"packets": [_packet(chunk({"content": "Hel"}))]},
        {"packets": [_packet(chunk({"content": "lo"}))]},
        {"packets": [_packet({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})]},
        {"packets": [_packet("[DONE]")]},
    ]}
    assert response_text(streamed) == "Hello"
    assert response_usage(streamed) == {"prompt_tokens": 4, "completion_tokens": 2}

    whole = {"responses": [{"text": json.dumps({"choices": [{"text": " world"}],
                                                 "usage": {"completion_tokens": 1}})}]}
    assert response_text(whole) == " world" and response_usage(whole) == {"completion_tokens": 1}
    chat = {"responses": [{"text": json.dumps({"choices": [{"message": {"content": "hi"}}]})}]}
    assert response_text(chat) == "hi" and response_usage(chat) is None


def test_level_row_sets_aiperf_beside_the_servers_histograms():
    summary = {"request_count": {"avg": 8.0}, "error_summary": [],
               "output_token_throughput": {"avg": 120.0},
               "time_to_first_token": {"avg": 66.0, "p50": 60.0, "p99": 90.0},
               "inter_token_latency": {"avg": 12.0, "p50": 11.5}}
    server = {"phalanx:time_to_first_token_seconds": {"series": [{"stats": {"count": 8, "avg": 0.060}}]},
              "phalanx:inter_token_latency_seconds": {"series": [{"stats": {"count": 248, "avg": 0.0125}}]}}
    row = level_row(Run(Scenario("c4"), summary, [], server))
    assert row["ttft_vs_server"] == pytest.approx(1.1)
    assert row["itl_vs_server"] == pytest.approx(0.96)
    assert row["errors"] == 0 and row["requests"] == 8

    unscraped = level_row(Run(Scenario("c1"), summary, [], {}))
    assert unscraped["server_itl_avg_ms"] is None and unscraped["itl_vs_server"] is None
    lines = table([row, unscraped])
    assert lines[2].startswith("| c4 | 8 | 0 | 120.0 |") and "= 0.960 |" in lines[2]
    assert lines[3].endswith("12.00 / - = - |")
