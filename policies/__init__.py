"""Pluggable decisions behind narrow interfaces, looked up by name in a registry.

- `registry` — kind → name → policy (`register`, `get`, `names`); `checks` validates
  the policies' frozen configs.
- `routing` — which DP group or prefill instance gets a request (kind "routing").
- `ep_width` — how many ranks each DP×EP group spans (kind "ep_width"), over the
  measured cost model `ep_cost` (fitted from measured steps in `ep_fit`).
- `microbatch` — one batch or two overlapped micro-batches per DP×EP step (kind
  "microbatch").

Pure logic: imports nothing but the standard library (no torch, no Ray).
"""

from __future__ import annotations

from . import registry
from .ep_width import (EPLayout, EPWidthPolicy, ep_width_policy_names,
                       make_ep_width_policy)
from .microbatch import MicrobatchPolicy, make_microbatch_policy, microbatch_policy_names
from .routing import (DEFAULT_POLICY, Candidate, GroupLoad, LeastLoadedConfig, load_tokens,
                      LeastLoadedPolicy, NoConfig, PrefixAwareConfig, PrefixAwarePolicy,
                      RoundRobinPolicy, RoutingPolicy, make_routing_policy,
                      routing_policy_names)

__all__ = ["Candidate", "DEFAULT_POLICY", "EPLayout", "EPWidthPolicy", "GroupLoad", "LeastLoadedConfig", "LeastLoadedPolicy",
           "MicrobatchPolicy", "NoConfig", "PrefixAwareConfig", "PrefixAwarePolicy", "RoundRobinPolicy",
           "RoutingPolicy", "ep_width_policy_names", "load_tokens", "make_ep_width_policy",
           "make_microbatch_policy", "make_routing_policy", "microbatch_policy_names", "registry",
           "routing_policy_names"]
