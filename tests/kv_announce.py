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
    from phalanx.kv_transfer.planning.copy_table import layer_batches
    from phalanx.kv_transfer.transport.receiver import KVReceiver
    from phalanx.kv_transfer.transport.sender import KVSender

    dst = _on(zero_pools(CASE, 0), device)
    rx = KVReceiver(dst, rank=0, epoch=1, gated=True, timeout_s=timeout_s)
    addr = await rx.start()
    tx = KVSender(_on(side_pools(CASE, "src", 0, "noise"), device), rank=0, epoch=1,
                  timeout_s=timeout_s)
    await tx.connect(addr)
    lives = _Lives(rx, tx, addr, dst, _on(side_pools(CASE, "dst", 0, "zero"), device),
                   layer_batches(case_batches(CASE)[(0, 0)]), timeout_s)
    for life in (lives.sent, lives.withdrawn, lives.expired, lives.fenced, lives.unanswered):
        await life()
    await tx.close()
    await rx.close()
    return lives.out


class _Lives:
    """One receiver and sender over loopback; each method is one life of an announced
    message (in this order: the counts they wait for add up), its findings in `out`."""

    def __init__(self, rx, tx, addr, dst: list, want: list, layers: dict,
                 timeout_s: float) -> None:
        self.rx, self.tx, self.addr, self.dst, self.want = rx, tx, addr, dst, want
        self.layers, self.timeout_s, self.out = layers, timeout_s, {}
        self.tokens = CASES[CASE].tokens

    def exact(self) -> bool:
        return all(torch.equal(self.want[l][k], self.dst[l][k])
                   for l in range(LAYERS) for k in range(2))

    def untouched(self) -> bool:
        return not any(t.any() for pair in self.dst for t in pair)

    def clear(self) -> None:
        for pair in self.dst:
            for t in pair:
                t.zero_()
        if self.dst[0][0].device.type == "cuda":  # before UCX writes them
            torch.cuda.synchronize(self.dst[0][0].device)

    async def until(self, what: str, n: int) -> None:
        """Until the receiver's count `what` reaches n."""
        end = time.monotonic() + CALL_TIMEOUT_S / 3
        while self.rx.stats[what] < n:
            assert time.monotonic() < end, (what, n, self.rx.stats)
            await asyncio.sleep(0.002)

    def announce(self, request_id: str, layer: int, **kw) -> int:
        """Prepare one layer's batch: the receiver's announced count once it is read."""
        self.tx.prepare(self.addr, request_id, self.layers[layer], **kw)
        prepared = self.tx._conns[self.addr].prepared[(request_id, id(self.layers[layer]))]
        return self.rx.stats["announced"] + len(prepared.announced)

    async def send_all(self, request_id: str) -> None:
        for layer in (0, 1):
            await self.tx.send_layer(self.addr, request_id, self.layers[layer])
        await self.rx.wait_request(request_id, self.tokens)

    async def sent(self) -> None:
        """Layer 0 announced: its receives wait posted before anything is sent; layer 1,
        sent unprepared meanwhile, is written and acked without waiting for layer 0."""
        rx, out = self.rx, self.out
        rx.expect("a")
        await self.until("announced", self.announce("a", 0))
        out["a_waiting"] = rx.stats["messages"] == 0 and self.untouched()
        await asyncio.wait_for(self.tx.send_layer(self.addr, "a", self.layers[1]),
                               self.timeout_s)
        out["a_layer1_first"] = sorted(rx.landed("a"))
        await self.tx.send_layer(self.addr, "a", self.layers[0])
        await rx.wait_request("a", self.tokens)
        out["a_exact"] = self.exact()
        await rx.release("a")
        self.clear()

    async def withdrawn(self) -> None:
        """Withdrawn: release returns at once (not at a deadline), nothing is written."""
        self.rx.expect("b")
        await self.until("announced", self.announce("b", 0))
        self.out["b_withdrawn"] = self.tx.withdraw("b")
        await asyncio.wait_for(self.rx.release("b"), self.timeout_s / 2)
        await self.until("withdrawn", 1)
        self.out["b_untouched"] = self.untouched() and self.rx.landed("b") == {}

    async def expired(self) -> None:
        """Not sent within its wait: withdrawn by the sender; sent later unannounced."""
        self.rx.expect("c")
        await self.until("announced", self.announce("c", 0, wait_s=0.05))
        await self.until("withdrawn", 2)
        self.out["c_untouched"] = self.untouched()
        await self.send_all("c")
        self.out["c_exact"] = self.exact()
        await self.rx.release("c")

    async def fenced(self) -> None:
        """An epoch change between prepare and send: withdrawn, then sent afresh under
        the new epoch."""
        self.rx.expect("d")
        self.announce("d", 0)
        await self.until("announced", self.announce("d", 1))
        self.tx.set_epoch(2)
        self.rx.set_epoch(2)
        await self.until("withdrawn", 4)
        await self.send_all("d")
        self.out["d_exact"] = self.exact()
        await self.rx.release("d")
        self.out["lost_before_e"] = self.rx.stats["conn_lost"]
        self.clear()

    async def unanswered(self) -> None:
        """A sender that neither sends nor withdraws: the receiver's bound (the announced
        wait plus its timeout) breaks the connection; release returns, nothing written."""
        self.rx.expect("e")
        self.tx._expire = lambda *args: None
        await self.until("announced", self.announce("e", 0, wait_s=0.05))
        await asyncio.wait_for(self.rx.release("e"), 3 * self.timeout_s)
        self.out["e_lost"] = self.rx.stats["conn_lost"]
        self.out["e_untouched"] = self.untouched()
