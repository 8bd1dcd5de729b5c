"""Pluggable decisions behind narrow interfaces, looked up by name in a registry.

Pure logic: imports nothing but the standard library (no torch, no Ray).
"""

from __future__ import annotations

from . import registry
from .routing import (DEFAULT_POLICY, Candidate, GroupLoad, LeastLoadedConfig, load_tokens,
                      LeastLoadedPolicy, NoConfig, PrefixAwareConfig, PrefixAwarePolicy,
                      RoundRobinPolicy, RoutingPolicy, make_routing_policy,
                      routing_policy_names)

__all__ = ["Candidate", "DEFAULT_POLICY", "GroupLoad", "LeastLoadedConfig", "LeastLoadedPolicy",
           "NoConfig", "PrefixAwareConfig", "PrefixAwarePolicy", "RoundRobinPolicy",
           "RoutingPolicy", "load_tokens", "make_routing_policy", "registry",
           "routing_policy_names"]
