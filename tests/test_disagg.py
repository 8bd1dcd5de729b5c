"""The disaggregated layout end to end on CPU (local Ray, gloo, ucxx over tcp/shm).

Prefill TP instances stream each prompt's KV, layer by layer, to decode DP×EP ranks,
re-cut between the two shardings (and page sizes); greedy tokens equal transformers' and
the colocated layout's. A prefill rank killed in the middle of a transfer: the request
is prefilled again on a re-formed instance and completes with the same tokens.
"""

from __future__ import annotations

import time

import pytest
import ray

from phalanx import LLM, SamplingParams

from indexed_outputs import assert_same_reports, generate_reported, sampled_cases
from test_hf_oracle import hf_greedy, make_prompts

MAX_NEW = 8
KW = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=160, collective_timeout_s=20)


@pytest.fixture(scope="module", autouse=True)
def _ray(local_ray):
    """Every test of this module runs on the module's local Ray (conftest)."""


@pytest.fixture(scope="module")
def oracle(tiny_model):
    prompts = make_prompts(2048, seed=7)[:10]
    return prompts, hf_greedy(tiny_model, prompts, MAX_NEW)


def _generate(llm, prompts, **fields):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **fields)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                           sampling_params=params)]


@pytest.fixture(scope="module")
def sampled(tiny_model, oracle):
    """Requests with every sampling field and the single engine's answers to them."""
    prompts, params = sampled_cases(oracle[0][4:], 2 * MAX_NEW)
    llm = LLM(tiny_model, max_num_seqs=8, num_pages=200)
    return prompts, params, generate_reported(llm, prompts, params)


def _generate_with_sampled(llm, prompts, sampled):
    """Greedy tokens of `prompts`; the sampled requests beside them must equal the single
    engine's (tokens, logprobs, prompt logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    extra_prompts, extra_params, want = sampled
    got = generate_reported(llm, list(prompts) + extra_prompts,
                            [params] * len(prompts) + extra_params)
    assert_same_reports(got[len(prompts):], want, extra_params)
    return [tokens for tokens, _, _ in got[:len(prompts)]]


@pytest.mark.parametrize("layout", [
    dict(prefill_tp=2, decode_dp=2, page_size=4),
    dict(prefill_tp=4, decode_dp=2, page_size=4),  # 4 > 2 KV heads: replicated on prefill
    dict(prefill_tp=1, prefill_instances=2, decode_dp=2, decode_tp=2, page_size=4),
    dict(prefill_tp=2, decode_dp=2, page_size=8, prefill_page_size=4),
], ids=["p2-d2", "p4-d2", "2xp1-d2x2", "p2-d2-pages4to8"])
def test_disaggregated_matches_transformers(tiny_model, oracle, layout):
    prompts, expected = oracle
    llm = LLM(tiny_model, **layout, **KW)
    try:
        got = _generate(llm, prompts)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a == b, f"prompt {i} ({len(prompts[i])} tokens)"
        stats = llm.cluster.stats()
        assert stats["recoveries"] == 0
        assert all(not s["failed"] for s in stats["decode"])
    finally:
        llm.close()


def test_prefill_rank_killed_mid_transfer(tiny_model, oracle, sampled):
    prompts, expected = oracle
    llm = LLM(tiny_model, prefill_tp=2, decode_dp=2, page_size=4, **KW)
    try:
        victim = llm.cluster.prefill[0].actors[1]
        ray.get(victim.arm_fault.remote("kv_send", 30))  # dies after 30 layer batches
        got = _generate_with_sampled(llm, prompts, sampled)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a == b, f"prompt {i}"
        stats = llm.cluster.stats()
        assert stats["recoveries"] == 1 and stats["prefill_epochs"] == [2], stats
    finally:
        llm.close()


def test_prefill_rank_killed_without_recovery_budget_fails_fast(tiny_model, oracle):
    """max_recoveries=0: a prefill rank's death is final, the caller gets GroupFailure
    naming the dead rank (not a hang, not a re-formed instance)."""
    from phalanx.actors.supervisor import GroupFailure

    prompts, _ = oracle
    llm = LLM(tiny_model, prefill_tp=2, decode_dp=2, page_size=4, max_recoveries=0, **KW)
    try:
        ray.get(llm.cluster.prefill[0].actors[1].arm_fault.remote("kv_send", 10))
        with pytest.raises(GroupFailure) as info:
            _generate(llm, prompts)
        assert 1 in info.value.dead_ranks, info.value
        assert llm.cluster.recoveries == 0
    finally:
        llm.close()


def test_cli_disaggregated_layout(tiny_model, capsys):
    """`phalanx generate --prefill-tp 1 --decode-dp 2` gives the single-rank tokens."""
    import json

    from phalanx.cli import main

    base = ["generate", "Hello there", "--max-tokens", "6", "--json", "--model", tiny_model,
            "--collective-timeout", "20", "--page-size", "8"]
    assert main(base) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(base + ["--prefill-tp", "1", "--decode-dp", "2", "--prefill-page-size", "4"]) == 0
    disagg = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert disagg["token_ids"] == single["token_ids"] and len(single["token_ids"]) == 6


def test_decode_rank_killed_mid_all_to_all(tiny_model, oracle, sampled):
    """The decode group loses a rank inside an MoE all-to-all: it is re-formed (epoch 2)
    and every request resumes from prompt + the tokens already delivered: the caller gets
    each token once and the same tokens as without the fault (requests using every
    sampling field: the single engine's tokens and logprobs)."""
    prompts, expected = oracle
    llm = LLM(tiny_model, prefill_tp=1, decode_dp=2, page_size=4, **KW)
    try:
        victim = llm.cluster.decode.actors[1]
        ray.get(victim.arm_fault.remote("moe_dispatch", 25))  # a few decode steps in
        got = _generate_with_sampled(llm, prompts, sampled)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert a == b, f"prompt {i}"
        stats = llm.cluster.stats()
        assert stats["decode_recoveries"] == 1 and stats["decode_epoch"] == 2, stats
        assert stats["recoveries"] == 0
    finally:
        llm.close()


def test_prefill_tp2_keeps_the_single_engines_bits_through_a_decode_kill(tiny_model, oracle):
    """The layout's row-parallel sums are cut at its widest TP (2; models/row_parallel.py),
    so a request prefilled by the TP2 instance and decoded at TP1, or prefilled again from
    its emitted tokens after a decode rank dies mid all-to-all, has the bits of a single
    engine of that width: every logprob equal, not only the tokens."""
    prompts, _ = oracle
    cases, params = sampled_cases(prompts[4:], 2 * MAX_NEW)
    want = generate_reported(LLM(tiny_model, max_num_seqs=8, num_pages=200, tp_invariant_width=2),
                             cases, params)
    llm = LLM(tiny_model, prefill_tp=2, decode_dp=2, page_size=4, **KW)
    try:
        ray.get(llm.cluster.decode.actors[1].arm_fault.remote("moe_dispatch", 25))
        got = generate_reported(llm, cases, params)
        assert llm.cluster.stats()["decode_recoveries"] == 1
    finally:
        llm.close()
    for (tokens, logprobs, prompt), (w_tokens, w_logprobs, w_prompt), p in zip(got, want, params):
        assert tokens == w_tokens, p
        assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in w_logprobs], p
        if p.prompt_logprobs is not None:
            assert [lp.logprob for lp in prompt[1:]] == [lp.logprob for lp in w_prompt[1:]], p


def _check_in_place_transfers(llm, prompts, expected) -> None:
    """With an in-place threshold of one page (the tiny model's pages are 512 B per layer
    and kind), prefill TP 1 -> decode DP 2 moves each step's whole pages pool to pool:
    the prefill ranks announce them when the step starts (the decode ranks post their
    receives before the layers are computed) and send each layer when it is done. The
    tokens equal transformers'; nothing announced was withdrawn."""
    got = _generate(llm, prompts)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a == b, f"prompt {i} ({len(prompts[i])} tokens)"
    kv = [ray.get(a.kv_stats.remote()) for a in llm.cluster.decode.actors]
    assert all(s["announced"] > 0 and s["direct"] > 0 and s["withdrawn"] == 0
               and s["rejected"] == 0 for s in kv), kv


def _wait_until_no_page_is_held(client) -> None:
    """Poll `client` until every decode DP leader and prefill instance leader holds no KV
    page (releases are asynchronous); fails after 30 s."""
    leaders = [*client.decode.leaders, *(g.leaders[0] for g in client.prefill)]
    deadline = time.monotonic() + 30
    while any(usage := [ray.get(a.stats.remote())["kv_usage"] for a in leaders]):
        assert time.monotonic() < deadline, f"pages still held after the abort: {usage}"
        client.poll()


def _run_aborting(client, victims, prompts, params, when: str, tag: str):
    """Submit `victims` then `prompts` (ids `tag`v0.., `tag`p0..) and abort the victims
    while they prefill (`when` "prefill": right after the poll that starts them) or once
    each has its first token ("decode": handed over to its decode rank, or about to be);
    every prompt's tokens once they have all finished, after checking that the victims
    got no token after their abort and never finished (they may run 64 tokens)."""
    ids = [f"{tag}v{i}" for i in range(len(victims))] + [f"{tag}p{i}" for i in range(len(prompts))]
    got, finished = {rid: [] for rid in ids}, set()
    long_run = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for rid, p in zip(ids, victims + prompts):
        client.submit(rid, p, long_run if rid.startswith(f"{tag}v") else params)

    def take(outputs) -> None:
        for o in outputs:
            got[o.request_id].extend(o.new_token_ids)
            finished.update([o.request_id] if o.finished else [])

    def abort() -> dict[str, int]:  # victim -> its tokens when aborted
        for rid in ids[:len(victims)]:
            client.abort(rid)
        return {rid: len(got[rid]) for rid in ids[:len(victims)]}

    take(client.poll())  # the poll starts every queued request
    cut = abort() if when == "prefill" else None
    deadline = time.monotonic() + 120
    while len(finished) < len(prompts) or cut is None:
        assert time.monotonic() < deadline, f"finished only {sorted(finished)}"
        take(client.poll())
        if cut is None and all(got[rid] for rid in ids[:len(victims)]):
            cut = abort()
    take(client.poll() + client.poll())  # a late token of a victim would show here
    assert all(len(got[rid]) == n and rid not in finished for rid, n in cut.items()), cut
    return [got[rid] for rid in ids[len(victims):]]


def test_in_place_transfers_match_and_aborts_mid_flight_leave_nothing_behind(tiny_model,
                                                                             oracle):
    """First, on the fresh layout, `_check_in_place_transfers` (in-place announced
    transfers give transformers' tokens, nothing withdrawn; one layout serves both
    checks). Then two long prompts (several chunked prefill steps each; their KV streamed
    layer by layer, pool to pool, announced when a step starts) aborted while prefilling, then
    again while decoding, among the oracle's prompts (prefill TP 1 -> decode DP 2): the
    aborted ones get no token after the abort, every page is freed on both sides, no
    transport connection breaks, the others' tokens equal transformers', and all of
    them run again afterwards with the same tokens. (Whether an abort lands between a
    step's announcement and its sends is up to timing here; the next test stalls a
    step in that window.)"""
    prompts, expected = oracle
    long = make_prompts(2048, seed=7)[10:12]  # 200 and 255 tokens
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(tiny_model, prefill_tp=1, decode_dp=2, page_size=4, kv_in_place_min_bytes=512,
              **KW)
    try:
        client = llm.cluster
        _check_in_place_transfers(llm, prompts, expected)
        for tag, when in (("a", "prefill"), ("b", "decode")):
            assert _run_aborting(client, long, prompts, params, when, tag) == expected
        _wait_until_no_page_is_held(client)
        kv = [ray.get(a.kv_stats.remote()) for a in client.decode.actors]
        assert all(s["conn_lost"] == 0 for s in kv), kv
        assert _generate(llm, long + prompts)[2:] == expected
    finally:
        llm.close()


def test_abort_between_a_steps_announcement_and_its_sends_withdraws_them(tiny_model, oracle):
    """The prefill rank stalls inside the first step of a long prompt, after the step
    announced its pool-to-pool messages (at its start) and before it sent any layer; the
    request is aborted meanwhile. Its prefill rank forgets it first, so every announced
    message is withdrawn (the decode rank's posted receives complete empty) and closing
    the decode gate does not wait for the stalled step; nothing of it lands, both sides
    free every page, no connection breaks, and the oracle's prompts then run with the
    same tokens. The abort itself waits on no rank: the polls take the attempt apart."""
    prompts, expected = oracle
    long = make_prompts(2048, seed=7)[11]  # 255 tokens: several prefill steps
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(tiny_model, prefill_tp=1, decode_dp=1, page_size=4, kv_in_place_min_bytes=512,
              **KW)
    try:
        client, rank = llm.cluster, llm.cluster.prefill[0].actors[0]
        receiver = client.decode.actors[0]
        ray.get(rank.arm_fault.remote("kv_send", 0, stall_s=3.0))  # before its first send
        client.submit("long", long, params)
        deadline = time.monotonic() + 20
        while (kv := ray.get(receiver.kv_stats.remote()))["announced"] == 0:
            assert time.monotonic() < deadline, "the step announced nothing"
            client.poll()  # the first starts the prefill
        client.abort("long")
        # abort() waited on no rank: the decode pages stay reserved, and the id taken,
        # until the polls have closed the gate (once the prefill rank forgot the stream)
        assert ray.get(client.decode.leaders[0].stats.remote())["kv_usage"] > 0
        assert client.leader_stats()["aborting"] == 1
        with pytest.raises(ValueError, match="still being aborted"):
            client.submit("long", long, params)
        deadline = time.monotonic() + 20  # the decode rank counts them as they come
        while (kv := ray.get(receiver.kv_stats.remote()))["withdrawn"] < kv["announced"]:
            assert time.monotonic() < deadline and kv["messages"] == 0, kv
            time.sleep(0.05)
        assert kv["messages"] == 0, kv  # nothing of the stalled step was sent
        announced = kv["announced"]
        _wait_until_no_page_is_held(client)  # once the stalled step has ended
        deadline = time.monotonic() + 20
        while client.leader_stats()["aborting"]:  # the polls see its last stage return
            assert time.monotonic() < deadline, "the abort's cleanup never ended"
            client.poll()
        assert _generate(llm, prompts) == expected
        kv = ray.get(receiver.kv_stats.remote())
        assert kv["conn_lost"] == 0 and kv["withdrawn"] == announced, kv
    finally:
        llm.close()


def test_second_turn_streams_only_what_decode_does_not_cache(tiny_model):
    """A follow-up prompt (the first turn's prompt + its answer + more) on the same decode
    group: the decode pool still caches the first turn's pages, so only the tail of the
    new prompt is streamed; the tokens still equal transformers'. The same prompt with a
    `cache_salt` finds none of them."""
    first = make_prompts(2048, seed=11)[9][:60]
    [answer] = hf_greedy(tiny_model, [first], MAX_NEW)
    second = first + answer + [5, 6, 7, 8, 9]
    [expected] = hf_greedy(tiny_model, [second], MAX_NEW)
    llm = LLM(tiny_model, prefill_tp=1, decode_dp=1, page_size=4, **KW)
    try:
        receiver = llm.cluster.decode.actors[0]
        assert _generate(llm, [first]) == [answer]
        bytes_first = ray.get(receiver.kv_stats.remote())["bytes"]
        assert _generate(llm, [second]) == [expected]
        bytes_second = ray.get(receiver.kv_stats.remote())["bytes"] - bytes_first
        per_token = bytes_first / len(first)
        # cached: the full pages of first + answer (minus the answer's last token, whose
        # KV the decode side computes only when it samples the next one)
        assert bytes_second <= per_token * (len(second) - (len(first) + len(answer) - 1) // 4 * 4)
        assert bytes_second < per_token * len(second) / 3
        # a salted request meets none of those pages: its whole prompt is streamed
        assert _generate(llm, [second], cache_salt="tenant") == [expected]
        bytes_salted = ray.get(receiver.kv_stats.remote())["bytes"] - bytes_first - bytes_second
        assert bytes_salted >= per_token * (len(second) - 1)
    finally:
        llm.close()
