"""Paged attention over an HND paged KV cache (torch reference).

Cache layout (per layer, one pool for K and one for V)::

    k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim]

i.e. HND per page: kv heads leading, a page's tokens contiguous per head.
A token slot is ``slot = page_id * page_size + offset``; a sequence's pages
are listed in order in its row of ``block_tables``, so KV position ``p`` of
sequence ``s`` lives in page ``block_tables[s, p // page_size]`` at offset
``p % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import use_triton
from .batch_invariant import batch_invariant_on

__all__ = [
    "AttentionMetadata",
    "write_kv",
    "write_kv_ref",
    "prefill_attention",
    "prefill_attention_ref",
    "decode_attention",
    "decode_attention_ref",
]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch description for paged attention (S sequences, T new tokens).

    Fields:
        query_start_loc: int32 [S+1], cumulative new-token counts, ``[0] == 0``;
            sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]``.
        seq_lens: int32 [S], KV length after this step (cached prefix + new tokens).
        block_tables: int32 [S, max_pages_per_seq], page ids in order; entries past
            ``ceil(seq_lens[s] / page_size)`` are padding and are never read.
        slot_mapping: int64 [T], cache slot of each new token (``-1`` = skip).
        max_query_len: max new tokens of any sequence.
        max_seq_len: max of ``seq_lens``.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        """Number of sequences S."""
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        """True iff every sequence has exactly one new token (sequences never have zero,
        so the host-side `max_query_len` decides it without a device sync)."""
        return self.max_query_len == 1


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference in-place scatter of new K/V into the paged cache.

    Args:
        k, v: [T, num_kv_heads, head_dim].
        k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim].
        slot_mapping: int64 [T]; token ``t`` goes to page ``slot // page_size``,
            offset ``slot % page_size``. Negative slots are skipped (padding).
    """
    page_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    pages = slots // page_size
    offsets = slots % page_size
    # Advanced indices split by a slice: the indexed view is [n, num_kv_heads, head_dim].
    k_cache[pages, :, offsets] = k[valid].to(k_cache.dtype)
    v_cache[pages, :, offsets] = v[valid].to(v_cache.dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V into the paged cache. See :func:`write_kv_ref`.

    Runs the Triton kernel when :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(k):
        from .gpu.kv_write import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Gather one sequence's first ``seq_len`` tokens into contiguous [kvh, seq_len, hd]."""
    num_kv_heads, page_size, head_dim = cache.shape[1:]
    num_pages = -(-seq_len // page_size)
    if num_pages > block_table.shape[0]:
        raise ValueError(f"seq_len {seq_len} needs {num_pages} pages, block table has {block_table.shape[0]}")
    pages = block_table[:num_pages].long()
    kv = cache[pages].permute(1, 0, 2, 3).reshape(num_kv_heads, num_pages * page_size, head_dim)
    return kv[:, :seq_len]


def _per_query_head(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[kvh, L, hd] -> float32 [H, L, hd], contiguous: query head h reads kv head
    h // (H // kvh)."""
    num_kv_heads = kv.shape[0]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    return kv.float().repeat_interleave(num_heads // num_kv_heads, dim=0)


def _attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, expanded: bool = False
) -> torch.Tensor:
    """Causal attention of one sequence's trailing queries over its full KV.

    q: [q_len, H, hd]; k, v: [kvh, L, hd] with L >= q_len (``expanded``: already
    `_per_query_head`'s [H, L, hd] float32, contiguous). Query ``j`` sits at position
    ``L - q_len + j`` and sees KV positions ``0..L - q_len + j``. Everything in float32;
    returns [q_len, H, hd] in ``q.dtype``.
    """
    q_len, num_heads, _ = q.shape
    seq_len = k.shape[1]
    if q_len > seq_len:
        raise ValueError(f"query length {q_len} exceeds seq_len {seq_len}")
    kf = k if expanded else _per_query_head(k, num_heads)
    vf = v if expanded else _per_query_head(v, num_heads)
    qf = q.float().transpose(0, 1)  # [H, q_len, hd]
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, q_len, L]
    if q_len > 1:  # one query (every caller here) sees every position: nothing to mask
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # [H, q_len, hd]
    return out.transpose(0, 1).to(q.dtype)


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Reference varlen causal attention with cached prefixes, over the paged cache.

    Args:
        q: [T, num_heads, head_dim] new-token queries (rope applied), rows grouped
           by sequence per ``meta.query_start_loc``.
        k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim]; this
           step's K/V must already be written (:func:`write_kv`).
        meta: :class:`AttentionMetadata`.
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        [T, num_heads, head_dim] in ``q.dtype``. New token ``j`` of sequence ``s``
        (``q_len_s`` new tokens) is at position ``seq_lens[s] - q_len_s + j`` and
        attends to KV positions ``0..`` that position inclusive. GQA: query head
        ``h`` uses kv head ``h // (num_heads // num_kv_heads)``. Scores, softmax
        and the P@V product are float32. Rows not owned by any sequence are 0.
        Each row is computed as :func:`decode_attention_ref` computes a sequence's
        query at that position, so a token's attention has the same bits whether it
        was prefilled or decoded (a re-prefill of emitted tokens after a KV loss
        reproduces them: ARCHITECTURE §5), and whatever else shares the step.
    """
    out = torch.zeros_like(q)
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    heads = q.shape[1]
    for s, seq_len in enumerate(seq_lens):
        start, end = qsl[s], qsl[s + 1]
        if start == end:
            continue
        # The sequence's K/V gathered once; each row takes a contiguous copy of its
        # prefix, the operands decode's gather of that length gives (the same bits).
        kf = _per_query_head(_gather_kv(k_cache, meta.block_tables[s], seq_len), heads)
        vf = _per_query_head(_gather_kv(v_cache, meta.block_tables[s], seq_len), heads)
        for row, length in zip(range(start, end), range(seq_len - (end - start) + 1, seq_len + 1)):
            out[row:row + 1] = _attend_one(q[row:row + 1], kf[:, :length].contiguous(),
                                           vf[:, :length].contiguous(), scale, expanded=True)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention. See :func:`prefill_attention_ref`.

    ``k_new`` / ``v_new`` ([T, num_kv_heads, head_dim], optional): this step's K/V rows,
    row ``i`` for query row ``i``, equal to what was written to the cache. The Triton
    kernel reads them instead of the cache for each sequence's new positions (contiguous
    rows, no page lookups); the result is the same. Runs the Triton kernel when
    :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(q):
        if batch_invariant_on():
            from .gpu.invariant_prefill import INVARIANT_MAX_LEN, invariant_prefill_triton

            if 0 < meta.max_seq_len <= INVARIANT_MAX_LEN:
                return invariant_prefill_triton(q, k_cache, v_cache, meta, scale)
            return _rows_as_decode(q, k_cache, v_cache, meta, scale)
        from .gpu.prefill_attention import prefill_attention_triton

        return prefill_attention_triton(q, k_cache, v_cache, meta, scale, k_new, v_new)
    return prefill_attention_ref(q, k_cache, v_cache, meta, scale)


def _rows_as_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Prefill attention in the batch-invariant mode past kernels/gpu/invariant_prefill.py's
    lengths: each query row is a decode query of its own, over its sequence's block
    table cut at the row's position (`row_lengths`), so it gets the bits
    :func:`decode_attention` gives that position when decoded. Rows owned by no sequence
    (a graph's padding) are 0. Tensor ops only (no host sync)."""
    from .gpu.invariant_prefill import row_lengths

    seq, owned, lens = row_lengths(meta, q.shape[0])
    width = meta.block_tables.shape[1]
    if meta.max_seq_len > 0:  # the pages any row reads: a [rows, width] table stays small
        width = min(width, -(-meta.max_seq_len // k_cache.shape[2]))
    out = decode_attention(q, k_cache, v_cache, lens, meta.block_tables[seq, :width], scale)
    return out.where(owned[:, None, None], 0)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference single-query paged attention.

    Args:
        q: [S, num_heads, head_dim], one query per sequence, at position
           ``seq_lens[s] - 1`` (its K/V already written).
        k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim].
        seq_lens: int32 [S], KV length including the new token (>= 1).
        block_tables: int32 [S, max_pages_per_seq].
        scale: softmax scale.

    Returns:
        [S, num_heads, head_dim] in ``q.dtype``; row ``s`` attends to all
        ``seq_lens[s]`` tokens. Same math as :func:`prefill_attention_ref` with one
        query per sequence; each sequence computed independently.
    """
    out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        k = _gather_kv(k_cache, block_tables[s], seq_len)
        v = _gather_kv(v_cache, block_tables[s], seq_len)
        out[s : s + 1] = _attend_one(q[s : s + 1], k, v, scale)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-query paged attention. See :func:`decode_attention_ref`.

    Runs the Triton split-K kernel when :func:`~phalanx.kernels.backend.use_triton` says so.
    """
    if use_triton(q):
        from .gpu.attention import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, seq_lens, block_tables, scale)
    return decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale)
