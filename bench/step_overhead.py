"""Per-step control overhead of the actor layer on CPU: time per decode step with the
model compute stubbed to zero, multi-rank groups (Ray actors) vs. the single-rank engine.

    python bench/step_overhead.py [--layouts single,tp2,tp4,dp2,dp4,dp2tp2]
                                  [--batches 1,32] [--steps 200] [--warmup 20]

The stub replaces only the model compute: `ModelRunner.forward` returns a ready logits
tensor `[num_logits, vocab]` (zeros, argmax = a fixed non-EOS token) and
`model.dummy_forward` does nothing. Everything else stays real: admission, the
scheduler, input building, the plan broadcast to TP followers (gloo), the DP world
agreement (gloo all-reduce), sampling, scheduler update, output publishing, and the
caller's polling of the leaders over Ray. (The collectives inside the model, TP
all-reduces and EP all-to-alls, go with the compute.)

Per layout (one group formed per layout, reused for every batch size, one Ray instance
for the whole run) and batch size (decode requests with a ~16-token prompt, greedy,
ignore_eos, max_tokens far past the window), after `--warmup` tokens per request:
- caller ms/step: wall time for `--steps` tokens per request to arrive through
  `LLM._poll` (GroupClient.poll over Ray, or LLMEngine.step for the single rank);
- leader ms/step: wall time over Lockstep.steps of DP rank 0's leader (`stats()`);
- a breakdown of the leader's loop (schedule, prepare, plan broadcast, world
  all-reduce, finish = sample + scheduler update + publish, idle iterations), and the
  same for every other rank (JSON);
- leader ms/step once more while the caller sleeps instead of polling (no-poll), which
  separates the cost of the Ray polling traffic from the collectives themselves.
Ratios are to the single-rank engine (LLMEngine.step in the caller's thread, same stub).
Run it as a script: the stub actor class is then shipped to the workers by value.
Prints a table last and writes JSON to $OUT/step_overhead.json (or ./step_overhead.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import time

import ray
import torch

from phalanx.actors.rank_actor import RankActor
from phalanx.actors.rank import plan as planmod
from phalanx.engine.sampling_params import SamplingParams
from phalanx.llm import LLM
from phalanx.models.tiny import default_model_dir

STUB_TOKEN = 7  # argmax of every stub logits row; not an EOS token of the tiny model
LAYOUTS = {"single": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "dp2": (1, 2), "dp4": (1, 4),
           "dp2tp2": (2, 2)}  # name -> (tp, dp)


class Timers:
    """Cumulative seconds and call counts of wrapped callables (read from any thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)
        self.seconds[key], self.calls[key] = 0.0, 0
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += clock() - t
                self.calls[key] += 1

        setattr(obj, attr, timed)

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


def install_stub(engine) -> None:
    """Zero-cost model compute on `engine` (an LLMEngine); every control path stays."""
    rows = max(engine.config.scheduler.max_num_seqs, 1)
    logits = torch.zeros(rows, engine.config.model.vocab_size)
    assert STUB_TOKEN not in engine.config.model.eos_token_ids
    logits[:, STUB_TOKEN] = 1.0

    def forward(inputs, layer_done=None):
        return logits[:inputs.num_logits]

    engine.runner.forward = forward
    engine.model.dummy_forward = lambda: None


class StubRankActor(RankActor):
    """A rank whose model compute is stubbed after `start()`, with its loop's phases timed.

    No request can reach the loop before `start()` returns (the supervisor waits for it),
    so no real forward runs."""

    def start(self) -> dict:
        info = super().start()
        rank, lockstep = self.rank, self.rank.lockstep
        install_stub(rank.engine)
        self._timers = t = Timers()
        self._statuses = {planmod.IDLE: 0, planmod.WORK: 0, planmod.STOP: 0}
        t.wrap(rank, "_drain_inbox", "drain_inbox")
        t.wrap(rank.engine.scheduler, "schedule", "schedule")
        t.wrap(rank.engine.runner, "prepare", "prepare")
        t.wrap(lockstep, "share_plan", "share_plan")
        t.wrap(lockstep.comm, "all_reduce_world_max", "world_all_reduce")
        t.wrap(rank.engine.runner, "forward", "forward_stub")
        t.wrap(lockstep, "finish", "finish")
        step = rank._step

        def counted_step():
            status = step()
            self._statuses[status] = self._statuses.get(status, 0) + 1
            return status

        rank._step = counted_step
        t.wrap(rank, "_step", "step")
        return info

    def timers(self) -> dict:
        snap = self._timers.snapshot()
        snap["statuses"] = dict(self._statuses)
        snap["steps"] = self.rank.lockstep.steps
        snap["time"] = time.perf_counter()
        return snap


RemoteStubRank = ray.remote(StubRankActor)


@contextlib.contextmanager
def stub_group_client():
    """`LLM(tp=, dp=)` builds its GroupClient with the stub rank actor class."""
    from phalanx.actors import group_client as gc
    orig = gc.GroupClient

    class StubGroupClient(orig):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, actor_cls=RemoteStubRank, **kwargs)

    gc.GroupClient = StubGroupClient
    try:
        yield
    finally:
        gc.GroupClient = orig


class SingleProbe:
    """Leader view of the single-rank engine (caller and loop are one thread)."""

    def __init__(self, llm: LLM) -> None:
        install_stub(llm.engine)
        self.t = Timers()
        eng = llm.engine
        self.t.wrap(eng.scheduler, "schedule", "schedule")
        self.t.wrap(eng.runner, "prepare", "prepare")
        self.t.wrap(eng.runner, "forward", "forward_stub")
        self.t.wrap(eng.runner, "sample", "sample")
        self.t.wrap(eng, "step_outputs", "step_outputs")
        self.t.wrap(eng, "step", "step")

    def read(self) -> dict:
        snap = self.t.snapshot()
        snap["steps"] = snap["calls"]["forward_stub"]
        snap["time"] = time.perf_counter()
        return snap


class GroupProbe:
    def __init__(self, llm: LLM) -> None:
        self.actors = llm.cluster.supervisor.actors
        self.leader = self.actors[0]

    def read(self) -> dict:
        t0 = time.perf_counter()
        stats = ray.get(self.leader.stats.remote())
        snaps = ray.get([a.timers.remote() for a in self.actors])
        snap = snaps[0]
        snap["steps"] = stats["steps"]  # Lockstep.steps through the public stats()
        snap["time"] = (t0 + time.perf_counter()) / 2
        snap["others"] = snaps[1:]
        return snap

    def rtt_ms(self, n: int = 50) -> float:
        """Round trip of a trivial actor call to the leader (the floor under one poll)."""
        ray.get(self.leader.ping.remote())
        t = time.perf_counter()
        for _ in range(n):
            ray.get(self.leader.ping.remote())
        return (time.perf_counter() - t) / n * 1e3


def delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a.get(k, 0) for k in b}


def _quiet_ms(probe, lead0: dict, lead1: dict, quiet_steps: int):
    """Leader ms/step while the caller does not poll, within the tokens left (the loop has
    run ahead of the caller by at most a poll's worth); None for the single rank."""
    if not isinstance(probe, GroupProbe) or quiet_steps < 20:
        return None
    est = (lead1["time"] - lead0["time"]) / max(1, lead1["steps"] - lead0["steps"])
    q0 = probe.read()
    time.sleep(min(2.0, max(0.02, quiet_steps * est)))
    q1 = probe.read()
    n = q1["steps"] - q0["steps"]
    return (q1["time"] - q0["time"]) / n * 1e3 if n > 0 else None


def _window(batch: int, lead0: dict, lead1: dict, n0: int, n1: int, t0: float, t1: float,
            window_polls: list[float], quiet) -> dict:
    """One point's figures from the leader snapshots and the caller's window."""
    caller_steps = (n1 - n0) / batch
    lead_steps = lead1["steps"] - lead0["steps"]
    lead_dt = lead1["time"] - lead0["time"]
    secs, calls = delta(lead0["seconds"], lead1["seconds"]), delta(lead0["calls"], lead1["calls"])
    out = dict(
        batch=batch, caller_steps=caller_steps, caller_s=t1 - t0,
        caller_ms=(t1 - t0) / caller_steps * 1e3,
        leader_steps=lead_steps, leader_s=lead_dt,
        leader_ms=lead_dt / lead_steps * 1e3 if lead_steps else float("nan"),
        leader_ms_no_polling=quiet,
        polls=len(window_polls),
        poll_ms_mean=statistics.fmean(window_polls) * 1e3 if window_polls else 0.0,
        tokens_per_poll=(n1 - n0) / max(1, len(window_polls)),
        # leader loop phases, ms per leader step (forward step) over its window
        leader_phase_ms={k: v / lead_steps * 1e3 for k, v in secs.items()} if lead_steps else {},
        leader_calls=calls,
    )
    if "statuses" in lead1:
        out["leader_statuses"] = delta(lead0["statuses"], lead1["statuses"])
        # every other rank over the same window, ms per leader step: a follower's
        # share_plan and everyone's world_all_reduce are mostly waiting for the slowest
        out["other_ranks"] = [dict(
            rank=r, forward_steps=b["steps"] - a["steps"],
            statuses=delta(a["statuses"], b["statuses"]),
            phase_ms={k: v / lead_steps * 1e3 for k, v in delta(a["seconds"], b["seconds"]).items()
                      if v > 0} if lead_steps else {})
            for r, (a, b) in enumerate(zip(lead0["others"], lead1["others"]), start=1)]
    return out


def measure(llm: LLM, probe, batch: int, steps: int, warmup: int, prompt_len: int,
            max_tokens: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, vocab - 8) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = llm._submit(prompts, [params] * batch)
    got = {rid: 0 for rid in rids}
    poll_s: list[float] = []

    def pump() -> None:
        t = time.perf_counter()
        outs = llm._poll()
        poll_s.append(time.perf_counter() - t)
        for o in outs:
            if o.request_id in got:
                got[o.request_id] += len(o.new_token_ids)
                assert not o.finished, "a request finished inside the window: raise max_tokens"

    try:
        while min(got.values()) < warmup:
            pump()
        lead0 = probe.read()
        n0, p0, t0 = sum(got.values()), len(poll_s), time.perf_counter()
        while sum(got.values()) - n0 < steps * batch:
            pump()
        t1, n1 = time.perf_counter(), sum(got.values())
        lead1 = probe.read()
        quiet = _quiet_ms(probe, lead0, lead1, min(steps, max_tokens - warmup - steps - 100))
    finally:
        for rid in rids:
            llm._abort(rid)
    return _window(batch, lead0, lead1, n0, n1, t0, t1, poll_s[p0:], quiet)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=30.0)
    ap.add_argument("--single-threads", type=int, default=1,
                    help="torch intra-op threads of the single-rank engine (0: torch's default). "
                         "Ranks run with max(1, threads // world) (1 on a 2-core box); with 2 "
                         "threads on a loaded 2-core box the stub's [32, vocab] argmax alone "
                         "swings from 0.05 to 8 ms (OpenMP wake-ups)")
    return ap.parse_args()


def _build(name: str, model: str, llm_kw: dict, single_threads: int):
    """The LLM of one layout and its probe; the rank actors run the stubbed model."""
    tp, dp = LAYOUTS[name]
    if tp * dp == 1:
        if single_threads > 0:
            torch.set_num_threads(single_threads)
        llm = LLM(model, **llm_kw)
        return llm, SingleProbe(llm), None
    with stub_group_client():
        llm = LLM(model, tp=tp, dp=dp, **llm_kw)
    probe = GroupProbe(llm)
    return llm, probe, probe.rtt_ms()


def _run_layouts(args, layouts, batches, model, llm_kw, max_tokens, vocab) -> list[dict]:
    default_threads = torch.get_num_threads()
    rows = []
    for name in layouts:
        tp, dp = LAYOUTS[name]
        t_form = time.perf_counter()
        llm, probe, rtt = _build(name, model, llm_kw, args.single_threads)
        form_s = time.perf_counter() - t_form
        try:
            for b in batches:
                r = measure(llm, probe, b, args.steps, args.warmup, args.prompt_len, max_tokens,
                            vocab, seed=1000 * tp + 100 * dp + b)
                r.update(layout=name, tp=tp, dp=dp, form_s=form_s, ping_rtt_ms=rtt)
                rows.append(r)
                print(f"{name:7} batch {b:3d}: caller {r['caller_ms']:.3f} ms/step, leader "
                      f"{r['leader_ms']:.3f} ms/step, {r['polls']} polls of "
                      f"{r['poll_ms_mean']:.2f} ms, phases (ms/step): "
                      + ", ".join(f"{k}={v:.3f}" for k, v in r["leader_phase_ms"].items()),
                      flush=True)
        finally:
            llm.close()
            torch.set_num_threads(default_threads)
    return rows


def _print_table(rows: list[dict], args, total_s: float, out: str) -> None:
    print(f"\n{args.steps} decode steps per point after {args.warmup} warm-up tokens, "
          f"{os.cpu_count()} CPUs, total {total_s:.0f} s; JSON: {out}")
    print("caller: wall time per step of tokens arriving through LLM's polling; leader: "
          "Lockstep.steps of DP rank 0 over wall time; poll: mean time of one LLM._poll "
          "(tokens arrive at most once per poll); plan+agree: leader's time per step in the "
          "TP plan broadcast and the DP all-reduce; no-poll: leader ms/step while the caller "
          "sleeps")
    print(f"{'layout':8} {'batch':>5} {'caller ms/step':>15} {'leader ms/step':>15} "
          f"{'x single':>9} {'x single':>9} {'poll ms':>8} {'plan+agree':>11} {'no-poll':>8}")
    print(f"{'':8} {'':>5} {'':>15} {'':>15} {'(caller)':>9} {'(leader)':>9} {'':>8} "
          f"{'ms/step':>11} {'ms/step':>8}")
    for r in rows:
        xs = (f"{r['x_single_caller']:9.1f} {r['x_single_leader']:9.1f}"
              if r["x_single_caller"] is not None else f"{'-':>9} {'-':>9}")
        ph = r["leader_phase_ms"]
        comm = ph.get("share_plan", 0.0) + ph.get("world_all_reduce", 0.0)
        quiet = r["leader_ms_no_polling"]
        quiet = f"{quiet:8.3f}" if quiet is not None else f"{'-':>8}"
        print(f"{r['layout']:8} {r['batch']:5d} {r['caller_ms']:15.3f} {r['leader_ms']:15.3f} {xs} "
              f"{r['poll_ms_mean']:8.2f} {comm:11.3f} {quiet}")


def main() -> None:
    args = _parse_args()
    layouts = args.layouts.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    model = str(default_model_dir())
    from phalanx.models.loader import read_model_config
    mcfg = read_model_config(model)
    max_tokens = min(mcfg.max_position_embeddings - args.prompt_len - 1,
                     args.warmup + args.steps + 4 * max(args.steps, 100))
    pages_per_seq = -(-(args.prompt_len + max_tokens) // 16)
    num_pages = 2 * max(batches) * pages_per_seq + 16  # room for aborted pages in flight
    llm_kw = dict(max_num_seqs=max(64, max(batches)), page_size=16, num_pages=num_pages,
                  enable_prefix_caching=False, collective_timeout_s=args.deadline_s)
    if any(LAYOUTS[name] != (1, 1) for name in layouts):
        from phalanx.actors.supervisor import ensure_ray
        ensure_ray(num_cpus=max(8, 2 * max(tp * dp for tp, dp in LAYOUTS.values())))
    t_start = time.perf_counter()
    rows = _run_layouts(args, layouts, batches, model, llm_kw, max_tokens, mcfg.vocab_size)
    total_s = time.perf_counter() - t_start
    base = {r["batch"]: r for r in rows if r["layout"] == "single"}
    for r in rows:
        b = base.get(r["batch"])
        r["x_single_caller"] = r["caller_ms"] / b["caller_ms"] if b else None
        r["x_single_leader"] = r["leader_ms"] / b["leader_ms"] if b else None
    result = dict(rows=rows, steps=args.steps, warmup=args.warmup, prompt_len=args.prompt_len,
                  max_tokens=max_tokens, num_pages=num_pages, total_s=total_s,
                  single_threads=args.single_threads or torch.get_num_threads(),
                  cpus=os.cpu_count(), torch=torch.__version__, ray=ray.__version__,
                  python=platform.python_version(),
                  poll_s=__import__("phalanx.actors.group_client", fromlist=["POLL_S"]).POLL_S)
    out = os.path.join(os.environ.get("OUT", "."), "step_overhead.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    if ray.is_initialized():
        ray.shutdown()
    _print_table(rows, args, total_s, out)


if __name__ == "__main__":
    main()
