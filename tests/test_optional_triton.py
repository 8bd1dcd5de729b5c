"""Triton is an optional dependency (`gpu` and `test` extras): every CPU serving path,
the KV transport included, imports and moves pages without it."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked for this check)")
sys.meta_path.insert(0, Block())
import torch
import phalanx.actors.rank_actor, phalanx.actors.disagg_client
import phalanx.server.launch, phalanx.llm, phalanx.engine.model_runner
from phalanx.kv_transfer.planning import messages as m
from phalanx.kv_transfer.transport.staging import KVPools
buf = torch.randn(2, 2, 4, 2, 4, 8)
src = KVPools([(buf[i, 0], buf[i, 1]) for i in range(2)])
dst_buf = torch.zeros_like(buf)
dst = KVPools([(dst_buf[i, 0], dst_buf[i, 1]) for i in range(2)])
import numpy as np
# one copy (messages.COPY_FIELDS order): layer 0, K, heads 0-1, src page 1 -> dst page 1
table = np.array([[0, 0, 0, 0, 2, 1, 0, 1, 0, 4]], dtype=np.int32)
for (tmpl, blocks) in m.templates_of(table):
    tx, rx = src.template(tmpl, "src"), dst.template(tmpl, "dst")
    payload = torch.empty(tx.nbytes(blocks), dtype=torch.uint8)
    src.gather(tx, blocks, payload)
    dst.scatter(rx, blocks, payload)
assert torch.equal(dst_buf[0, 0, 1], buf[0, 0, 1]) and dst_buf[0, 0, 0].abs().sum() == 0
assert "triton" not in sys.modules
print("ok")
"""


def test_cpu_paths_need_no_triton():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
