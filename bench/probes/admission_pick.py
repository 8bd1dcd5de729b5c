"""What one pick among held requests costs (`router/admission.py`, issue 34).

    python bench/probes/admission_pick.py [--held 300] [--groups 4] [--picks 50]

A router of `--groups` DP groups (384 pages of 16 tokens each, 5 requests running on
every group), `--held` requests of conversations under 4 shared 1024-token system prompts
held at the router; times `Admission._pick` for a few sets of groups with room and
prints µs per pick and the request picked (so two versions of the code can be compared
for speed and for the same picks). Also the per-held-request parts: the record's page
hashes (kept on it) and the tree match.
"""

from __future__ import annotations

import argparse
import random
import time

from phalanx.engine.sampling_params import SamplingParams
from phalanx.router import RequestRecord, Router
from phalanx.router.admission import Admission, AdmissionConfig


def build(held: int, groups: int, seed: int = 0) -> tuple[Router, Admission]:
    rng = random.Random(seed)
    router = Router(page_size=16, groups=range(groups), capacity_pages=384)
    adm = Admission(router, AdmissionConfig(max_requests=5, max_queued_tokens=2048))
    systems = [[rng.randrange(150000) for _ in range(1024)] for _ in range(4)]
    convs = [systems[i % 4] + [rng.randrange(150000) for _ in range(rng.randrange(100, 2000))]
             for i in range(200)]
    for g in range(groups):  # 5 running on each group
        for j in range(5):
            r = RequestRecord(f"run{g}-{j}", convs[(g * 5 + j) % 200], SamplingParams(max_tokens=4))
            router.prepare(r)
            router.route(r, exclude=[x for x in range(groups) if x != g])
    for i in range(held):
        tail = [rng.randrange(150000) for _ in range(50)]
        r = RequestRecord(f"h{i}", convs[rng.randrange(200)] + tail, SamplingParams(max_tokens=4))
        router.prepare(r)
        adm.hold(r)
    return router, adm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held", type=int, default=300)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--picks", type=int, default=50)
    args = ap.parse_args()
    router, adm = build(args.held, args.groups)
    pool = router.decode
    rooms = [[0], [1], list(range(2, args.groups)), list(range(args.groups))]
    for room in rooms:
        t = time.perf_counter()
        for _ in range(args.picks):
            rid = adm._pick(pool, room)
        print(f"room {room}: {(time.perf_counter() - t) / args.picks * 1e6:.0f} µs a pick, picked {rid}")
    recs = [rec for rec, _ in adm._held.values()]
    hashes = [router.page_hashes(r, pool) for r in recs]
    t = time.perf_counter()
    for h in hashes:
        pool.tree.match_pages(h)
    print(f"tree match per held request: {(time.perf_counter() - t) / len(recs) * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
