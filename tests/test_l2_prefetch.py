"""The L2 prefetch hint's host-side gates (kernels/gpu/l2_prefetch.py, moe_decode's
DOWN_AHEAD): which tensors the bulk prefetch may take, and that the switch is checked.
The prefetch itself is sm_90 inline assembly: compiled offline by
bench/probes/kernel_resources.py's harness and measured by bench/decode_gpu.py
--baselines moeahead (bench/NOTES.md)."""

import pytest
import torch

from phalanx.kernels.gpu import moe_decode
from phalanx.kernels.gpu.l2_prefetch import bulk_rows_ok


def test_bulk_rows_need_16_byte_rows_strides_and_base():
    w2 = torch.empty(4, 64, 48, dtype=torch.bfloat16)  # rows of 96 bytes
    assert bulk_rows_ok(w2, 48 * 2)
    assert not bulk_rows_ok(w2, 40)  # not a multiple of 16
    assert not bulk_rows_ok(torch.empty(4, 64, 44, dtype=torch.bfloat16), 88)  # row stride of 88 bytes
    assert not bulk_rows_ok(w2.view(-1)[1:1 + 4 * 64 * 40].view(4, 64, 40), 80)  # base off by 2 bytes
    assert bulk_rows_ok(w2[1:], 96)  # a slice of whole experts keeps the alignment


def test_down_ahead_is_checked_and_stays_off_without_pdl(monkeypatch):
    w2 = torch.empty(2, 32, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(moe_decode, "DOWN_AHEAD", "sometimes")
    with pytest.raises(ValueError, match="DOWN_AHEAD"):
        moe_decode._ahead(w2, w2.device)
    for value in ("normal", "last", None):
        monkeypatch.setattr(moe_decode, "DOWN_AHEAD", value)
        assert moe_decode._ahead(w2, w2.device) == 0  # CPU: no PDL wait to run ahead of
    monkeypatch.setattr(moe_decode, "pdl_enabled", lambda device, kernel="gemv": True)
    for value, want in (("normal", 1), ("last", 2), (None, 0)):
        monkeypatch.setattr(moe_decode, "DOWN_AHEAD", value)
        assert moe_decode._ahead(w2, w2.device) == want
    assert moe_decode._ahead(torch.empty(2, 32, 12, dtype=torch.bfloat16), w2.device) == 0  # 24-byte rows
