"""Request lifecycle and placement: the single source of truth for every request's
emitted tokens, and prefix-aware routing over DP groups and prefill instances.

Pure logic: imports the standard library and `phalanx.policies` only (no torch, no Ray).
"""

from __future__ import annotations

from .pool import NoTargetError, PlacementPool, PoolStats
from .prefix_tree import PrefixTree, page_hashes
from .request import (RequestRecord, RequestState, RequestStateError, TokenGapError)
from .request_table import DuplicateRequestError, RequestTable
from .router import Router

__all__ = ["DuplicateRequestError", "NoTargetError", "PlacementPool", "PoolStats", "PrefixTree",
           "RequestRecord", "RequestState", "RequestStateError", "RequestTable", "Router",
           "TokenGapError", "page_hashes"]
