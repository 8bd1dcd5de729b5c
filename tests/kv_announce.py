"""Announced direct messages over real ucxx (`test_kv_transport`): a sender and a gated
receiver on one actor's transport loop, connected over loopback, through the lives an
announced message can have: sent (in any order with the others), withdrawn, expired,
fenced by an epoch change, and never answered (the receiver's bound). Runs in a
`kv_actors` actor (spawn imports this module there)."""

from __future__ import annotations

import asyncio
import time

import torch
from kv_actors import CALL_TIMEOUT_S
from kv_cases import CASES, LAYERS, case_batches, side_pools, zero_pools

CASE = "tp1_to_tp1_runs"  # consecutive pages: each layer's whole pages go in place


def announce_lives(state, timeout_s: float, device: str = "cpu") -> dict:
    """Every scenario in order on this actor's loop, pools on `device`; what each
    observed (`check_lives` says what must hold)."""
    return state["thread"].call(_lives(timeout_s, torch.device(device)), CALL_TIMEOUT_S)


def check_lives(got: dict) -> None:
    assert got["a_waiting"] and got["a_layer1_first"] == [1] and got["a_exact"], got
    assert got["b_withdrawn"] == 1 and got["b_untouched"], got
    assert got["c_untouched"] and got["c_exact"] and got["d_exact"], got
    assert got["lost_before_e"] == 0, got
    assert got["e_lost"] == 1 and got["e_untouched"], got


def _on(pools: list, device: torch.device) -> list:
    return [tuple(t.to(device) for t in pair) for pair in pools]


async def _lives(timeout_s: float, device: torch.device) -> dict:
    from phalanx.kv_transfer.copy_table import layer_batches
    from phalanx.kv_transfer.receiver import KVReceiver
    from phalanx.kv_transfer.sender import KVSender

    dst, want = _on(zero_pools(CASE, 0), device), _on(side_pools(CASE, "dst", 0, "zero"), device)
    rx = KVReceiver(dst, rank=0, epoch=1, gated=True, timeout_s=timeout_s)
    addr = await rx.start()
    tx = KVSender(_on(side_pools(CASE, "src", 0, "noise"), device), rank=0, epoch=1,
                  timeout_s=timeout_s)
    await tx.connect(addr)
    layers = layer_batches(case_batches(CASE)[(0, 0)])
    tokens, out = CASES[CASE].tokens, {}

    def exact() -> bool:
        return all(torch.equal(want[l][k], dst[l][k]) for l in range(LAYERS) for k in range(2))

    def untouched() -> bool:
        return not any(t.any() for pair in dst for t in pair)

    def clear() -> None:
        for pair in dst:
            for t in pair:
                t.zero_()
        if device.type == "cuda":  # before UCX writes them
            torch.cuda.synchronize(device)

    async def until(what: str, n: int) -> None:  # the receiver's count reaches n
        end = time.monotonic() + CALL_TIMEOUT_S / 3
        while rx.stats[what] < n:
            assert time.monotonic() < end, (what, n, rx.stats)
            await asyncio.sleep(0.002)

    def announce(request_id: str, layer: int, **kw) -> int:
        tx.prepare(addr, request_id, layers[layer], **kw)
        return rx.stats["announced"] + len(tx._conns[addr].prepared[
            (request_id, id(layers[layer]))].announced)

    # Sent: layer 0 announced, its receives posted before anything is sent; layer 1 sent
    # unprepared meanwhile is written and acked without waiting for layer 0.
    rx.expect("a")
    await until("announced", announce("a", 0))
    out["a_waiting"] = rx.stats["messages"] == 0 and untouched()
    await asyncio.wait_for(tx.send_layer(addr, "a", layers[1]), timeout_s)
    out["a_layer1_first"] = sorted(rx.landed("a"))
    await tx.send_layer(addr, "a", layers[0])
    await rx.wait_request("a", tokens)
    out["a_exact"] = exact()
    await rx.release("a")
    clear()

    # Withdrawn: release returns at once (not at a deadline), nothing is written.
    rx.expect("b")
    await until("announced", announce("b", 0))
    out["b_withdrawn"] = tx.withdraw("b")
    await asyncio.wait_for(rx.release("b"), timeout_s / 2)
    await until("withdrawn", 1)
    out["b_untouched"] = untouched() and rx.landed("b") == {}

    # Expired: not sent within its wait, withdrawn by the sender; sent later unannounced.
    rx.expect("c")
    await until("announced", announce("c", 0, wait_s=0.05))
    await until("withdrawn", 2)
    out["c_untouched"] = untouched()
    for layer in (0, 1):
        await tx.send_layer(addr, "c", layers[layer])
    await rx.wait_request("c", tokens)
    out["c_exact"] = exact()
    await rx.release("c")

    # An epoch change between prepare and send: withdrawn, then sent under the new epoch.
    rx.expect("d")
    announce("d", 0)
    await until("announced", announce("d", 1))
    tx.set_epoch(2)
    rx.set_epoch(2)
    await until("withdrawn", 4)
    for layer in (0, 1):
        await tx.send_layer(addr, "d", layers[layer])
    await rx.wait_request("d", tokens)
    out["d_exact"] = exact()
    await rx.release("d")
    out["lost_before_e"] = rx.stats["conn_lost"]
    clear()

    # A sender that neither sends nor withdraws: the receiver's bound (the announced
    # wait plus its timeout) breaks the connection; release returns, nothing written.
    rx.expect("e")
    tx._expire = lambda *args: None
    await until("announced", announce("e", 0, wait_s=0.05))
    await asyncio.wait_for(rx.release("e"), 3 * timeout_s)
    out["e_lost"] = rx.stats["conn_lost"]
    out["e_untouched"] = untouched()
    await tx.close()
    await rx.close()
    return out
