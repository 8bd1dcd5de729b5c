"""The report of `bench/multi_gpu.py`: the ranks' and the single process's results
summarised against each other and the floors (the JSON), and the printed tables."""

from __future__ import annotations

import statistics

import multi_gpu_model as mm


# ----------------------------------------------------------------------- summary

def compare_tokens(ranks: dict, single: dict, opts: dict) -> dict:
    """Per dtype: the DPN x EPN tokens (every rank's share) vs the single-GPU ones."""
    report = {}
    for dtype in opts["check_dtypes"]:
        ref = {int(i): t for i, t in single.get("check", {}).get("tokens", {}).get(dtype, {}).items()}
        dp: dict[int, list[int]] = {}
        errors = {f"single {k}": v for k, v in single.get("check", {}).get("errors", {}).items()}
        kernels = {"single": single.get("check", {}).get("kernels", {}).get(dtype)}
        for r, res in sorted(ranks.items()):
            c = res.get("check", {})
            dp.update({int(i): t for i, t in c.get("tokens", {}).get(dtype, {}).items()})
            errors.update({f"rank{r} {k}": v for k, v in c.get("errors", {}).items() if k.startswith(dtype)})
            kernels[f"rank{r}"] = c.get("kernels", {}).get(dtype)
        errors = {k: v for k, v in errors.items() if k.split()[-1].startswith(dtype)}
        prompts = []
        for i in sorted(ref):
            a, b = ref[i], dp.get(i)
            same = 0
            if b is not None:
                while same < min(len(a), len(b)) and a[same] == b[same]:
                    same += 1
            prompts.append(dict(prompt=i, single=a, ranks=b, equal=b == a, leading_equal=same))
        complete = bool(ref) and len(dp) == len(ref) == opts["check_prompts"]
        report[dtype] = dict(equal=complete and all(p["equal"] for p in prompts), complete=complete,
                             prompts=prompts, kernels=kernels, errors=errors)
    return report


def _decode_rows(opts: dict, cfg, ranks: dict, single: dict, bw) -> list[dict]:
    by_b = lambda rows: {r["batch"]: r for r in rows or []}  # noqa: E731
    eager, graphs = by_b(single.get("decode_eager")), by_b(single.get("decode_graphs"))
    decode_rows = []
    rank_decode = [by_b(ranks[r].get("decode")) for r in sorted(ranks)]
    for b in opts["batches"]:
        per = [d[b] for d in rank_decode if b in d]
        if not per:
            continue
        tok = statistics.mean(p["tok_s"] for p in per)
        ctx = opts["ctx"] + opts["warm"] + opts["steps"] // 2
        row = dict(batch_per_rank=b, tok_s_per_gpu=tok, tok_s_total=sum(p["tok_s"] for p in per),
                   step_ms=max(p["step_ms"] for p in per), per_rank=per,
                   graphed=all(p.get("graphed_steps", 0) == p["steps"] for p in per))
        if bw:
            floor = b / (mm.decode_bytes_per_gpu(cfg, b, ctx, opts["world"]) / bw)
            row.update(floor_tok_s_per_gpu=floor, of_floor=tok / floor,
                       single_floor_tok_s=b / (mm.decode_bytes_per_gpu(cfg, b, ctx, 1) / bw))
        if b in eager:
            row.update(single_eager_tok_s=eager[b]["tok_s"], vs_single_eager=tok / eager[b]["tok_s"])
        if b in graphs:
            row.update(single_graphs_tok_s=graphs[b]["tok_s"], vs_single_graphs=tok / graphs[b]["tok_s"])
        decode_rows.append(row)
    return decode_rows


def _prefill_rows(cfg, tp: int, ranks: dict, single: dict, mm_rate) -> list[dict]:
    prefill_rows = []
    single_pf = {(r["num_seqs"], r["length"]): r for r in single.get("prefill") or []}
    for r in (ranks.get(0, {}).get("prefill") or []):
        key = (r["num_seqs"], r["length"])
        row = dict(shape=f"{key[0]}x{key[1]}", tok_s=r["tok_s"], tok_s_per_gpu=r["tok_s"] / tp)
        if mm_rate:
            floor = key[0] * key[1] / (mm.prefill_flops(cfg, *key) / tp / mm_rate)
            row.update(floor_tok_s=floor, of_floor=r["tok_s"] / floor)
        if key in single_pf:
            row.update(single_tok_s=single_pf[key]["tok_s"], vs_single=r["tok_s"] / single_pf[key]["tok_s"])
        prefill_rows.append(row)
    return prefill_rows


def _moe_rows(opts: dict, cfg, ranks: dict, decode_rows: list[dict]) -> list[dict]:
    moe_rows = []
    rank_moe = [ranks[r].get("moe") or [] for r in sorted(ranks)]
    for i, b in enumerate(opts["batches"]):
        per = [m[i] for m in rank_moe if i < len(m)]
        if not per:
            continue
        keys = [k for k in per[0] if k.endswith("_us")]
        row = {"batch_per_rank": b, **{k: statistics.mean(p[k] for p in per) for k in keys},
               "bytes_sent_per_rank": statistics.mean(p["bytes_sent"] for p in per),
               "bytes_to_peers_per_rank": statistics.mean(p["bytes_to_peers"] for p in per),
               "bytes_to_peer_max_per_rank": statistics.mean(max(p["bytes_to_peer"]) for p in per)}
        row["groupcomm_vs_nccl"] = row["a2a_groupcomm_us"] / row["a2a_nccl_us"]
        step = next((d["step_ms"] for d in decode_rows if d["batch_per_rank"] == b), None)
        if step:
            row["dispatch_combine_share_of_step"] = (row["dispatch_combine_us"] * cfg.num_moe_layers
                                                     / (step * 1e3))
        moe_rows.append(row)
    return moe_rows


def layout_summary(cfg, world: int, tp: int) -> dict:
    """The decode and prefill layouts: ranks, experts per rank, KV-head replication."""
    from phalanx.comm.dispatch import make_expert_placement
    experts = [len(e) for e in make_expert_placement(cfg.num_experts, world)[2]]
    return dict(world=world, decode=f"DP{world}xEP{world}", experts_per_rank=experts,
                prefill=f"TP{tp}", prefill_tp=tp,
                prefill_experts_per_rank=[len(e) for e in make_expert_placement(cfg.num_experts, tp)[2]],
                prefill_kv_head_copies=max(1, tp // cfg.num_key_value_heads))


def summarize(args, opts, ranks, single, errors, walls) -> dict:
    cfg = mm.model_config(opts["tiny"], opts["layers"], "bfloat16")
    ceil = single.get("ceilings")
    bw = ceil["copy_bytes_per_s"] if ceil else None
    mm_rate = ceil["matmul_flops_per_s"] if ceil else None
    decode_rows = _decode_rows(opts, cfg, ranks, single, bw)
    prefill_rows = _prefill_rows(cfg, opts["prefill_tp"], ranks, single, mm_rate)
    moe_rows = _moe_rows(opts, cfg, ranks, decode_rows)
    return dict(args=vars(args), model=dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                                            experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                                            kv_heads=cfg.num_key_value_heads),
                layout=layout_summary(cfg, opts["world"], opts["prefill_tp"]),
                device=single.get("device_name") or opts["device"], ceilings=ceil,
                check=compare_tokens(ranks, single, opts) if "check" in opts["phases"] else None,
                decode=decode_rows, prefill=prefill_rows, moe=moe_rows,
                graph_capture_s=single.get("graph_capture_s"), errors=errors, wall_s=walls,
                raw=dict(ranks=ranks, single=single))


# ----------------------------------------------------------------------- tables

def _f(v, fmt: str, width: int) -> str:
    return format(v, fmt).rjust(width) if v is not None else "-".rjust(width)


def _experts(counts: list[int]) -> str:
    lo, hi = min(counts), max(counts)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _print_decode(rows: list[dict], lay: dict) -> None:
    mode = "CUDA graphs" if rows and all(r["graphed"] for r in rows) else "eager"
    print(f"\ndecode {lay['decode']} ({mode}, per GPU, {_experts(lay['experts_per_rank'])} experts per "
          f"rank) vs one GPU with the same weights at the same per-GPU batch")
    print(f"{'batch/rank':>10} {'tok/s/GPU':>10} {'total':>8} {'step ms':>8} {'floor':>8} {'of fl':>6} "
          f"{'1GPU eager':>10} {'x':>5} {'1GPU graph':>10} {'x':>5} {'1GPU floor':>10}")
    for r in rows:
        print(f"{r['batch_per_rank']:10d} {r['tok_s_per_gpu']:10.0f} {r['tok_s_total']:8.0f} "
              f"{r['step_ms']:8.2f} {_f(r.get('floor_tok_s_per_gpu'), '.0f', 8)} "
              f"{_f(r.get('of_floor'), '.2f', 6)} {_f(r.get('single_eager_tok_s'), '.0f', 10)} "
              f"{_f(r.get('vs_single_eager'), '.2f', 5)} {_f(r.get('single_graphs_tok_s'), '.0f', 10)} "
              f"{_f(r.get('vs_single_graphs'), '.2f', 5)} {_f(r.get('single_floor_tok_s'), '.0f', 10)}")
    print(f"x: {lay['decode']} tok/s per GPU / one GPU's; floors: bytes per GPU / copy bandwidth "
          "(all-to-all traffic not counted)")


def _print_moe(rows: list[dict], world: int) -> None:
    many = world > 2  # one more column: the busiest peer
    print(f"\nMoE layer per rank, {world} ranks, us (medians; 4 a2a = counts, rows, metadata, return rows)")
    print(f"{'batch':>5} {'MoE':>7} {'disp+comb':>9} {'experts':>7} {'4a2a ours':>9} {'4a2a nccl':>9} "
          f"{'nccl+sync':>9} {'nccl strm':>9} {'ours/nccl':>9} {'KiB wire':>8} "
          + (f"{'max/peer':>8} " if many else "") + f"{'d+c share':>9}")
    for r in rows:
        peer = f"{r['bytes_to_peer_max_per_rank'] / 1024:8.0f} " if many else ""
        print(f"{r['batch_per_rank']:5d} {r['moe_us']:7.0f} {r['dispatch_combine_us']:9.0f} "
              f"{r['experts_us']:7.0f} {r['a2a_groupcomm_us']:9.0f} {r['a2a_nccl_us']:9.0f} "
              f"{r['a2a_nccl_sync_each_us']:9.0f} {r['a2a_nccl_stream_us']:9.0f} "
              f"{r['groupcomm_vs_nccl']:9.2f} {r['bytes_to_peers_per_rank'] / 1024:8.0f} {peer}"
              f"{_f(r.get('dispatch_combine_share_of_step'), '.2f', 9)}")
    wire = (f"KiB wire: sent to the {world - 1} peers (rows + metadata, returned rows, counts); "
            "max/peer: to the busiest one" if many else
            "KiB wire: sent to the peer (rows + metadata, returned rows, counts)")
    print("ours: GroupComm (deadline poll, so a host sync, per a2a); nccl: dist.all_to_all_single, "
          f"one sync per call; +sync: after each a2a; strm: back-to-back; {wire}; "
          "d+c share: disp+comb x MoE layers / decode step")


def _print_prefill(rows: list[dict], lay: dict, kv_heads: int) -> None:
    tp, notes = lay["prefill_tp"], ""
    if lay["prefill_kv_head_copies"] > 1:
        notes += f"; {kv_heads} KV heads, each replicated on {lay['prefill_kv_head_copies']} ranks"
    if tp < lay["world"]:
        notes += f"; ranks {tp}-{lay['world'] - 1} idle"
    print(f"\nprefill {lay['prefill']} (experts split, all-reduce) vs one GPU{notes}")
    print(f"{'shape':>8} {'tok/s':>9} {'per GPU':>9} {'floor':>9} {'of fl':>6} {'1GPU':>9} {'x':>5}")
    for r in rows:
        print(f"{r['shape']:>8} {r['tok_s']:9.0f} {r['tok_s_per_gpu']:9.0f} "
              f"{_f(r.get('floor_tok_s'), '.0f', 9)} {_f(r.get('of_floor'), '.2f', 6)} "
              f"{_f(r.get('single_tok_s'), '.0f', 9)} {_f(r.get('vs_single'), '.2f', 5)}")


def _print_check(res: dict) -> bool:
    """The check's verdict per dtype; False when the PASS dtype's tokens differ."""
    print()
    strict = res["args"]["check_pass_dtype"]
    for dtype, c in res["check"].items():
        lead = [p["leading_equal"] for p in c["prompts"]]
        verdict = ("PASS" if c["equal"] else "FAIL") if dtype == strict else \
            ("equal" if c["equal"] else "differ (informational)")
        kern = ", ".join(f"{k} {v}" for k, v in c["kernels"].items())
        print(f"check {dtype}: greedy tokens {res['layout']['decode']} vs single GPU, "
              f"{res['args']['check_prompts']} prompts x {res['args']['max_new']} tokens: {verdict}; leading equal tokens per "
              f"prompt {lead}; kernels: {kern}")
        for who, err in c["errors"].items():
            print(f"  error {who}: {err.strip().splitlines()[-1][:300]}")
    return bool(res["check"].get(strict, {}).get("equal"))


def print_report(res: dict) -> bool:
    ok = True
    ceil = res["ceilings"]
    if ceil:
        print(f"device {res['device']}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    m = res["model"]
    print(f"model: {m['layers']} layers, hidden {m['hidden']}, {m['experts']} experts top-{m['top_k']}; "
          f"wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in res["wall_s"].items()))
    for name, err in res["errors"].items():
        ok = False
        print(f"ERROR {name}: {err.strip().splitlines()[-1] if err.strip() else err}")
    lay = res["layout"]
    if res["decode"]:
        _print_decode(res["decode"], lay)
    if res["moe"]:
        _print_moe(res["moe"], lay["world"])
    if res["prefill"]:
        _print_prefill(res["prefill"], lay, m["kv_heads"])
    if res["check"] is not None and not _print_check(res):
        ok = False
    return ok
