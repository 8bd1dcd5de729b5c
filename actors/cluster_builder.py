"""The one function that forms a layout for whoever drives it (the server's driver thread,
the offline `LLM`): a :class:`~phalanx.actors.cluster.ClusterClient`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import DisaggConfig, EngineConfig
from .cluster import ClusterClient
from .disagg_client import DisaggClient
from .ep_calibration import calibrate
from .group_client import GroupClient
from ..models.row_parallel import layout_width

__all__ = ["build_cluster"]


def build_cluster(config: EngineConfig, disagg: Optional[DisaggConfig] = None,
                  ray_address: Optional[str] = None) -> ClusterClient:
    """The layout `config.parallel` (colocated: tp × dp ranks) or `disagg` (prefill
    instances → decode group; the decode side takes `config`, the prefill side the same
    with its own page size) describes, formed on Ray (started locally unless
    `ray_address`); blocks until every rank has loaded its shard, and for the
    `cost_model` EP-width policy without a cost-table file, until the tables are
    measured on its ranks (`ep_calibration`)."""
    if config.tp_invariant_width == 0:  # auto: every group's sums as the widest group's
        widths = (config.parallel.tp,) if disagg is None else (disagg.prefill_tp, disagg.decode_tp)
        config = dataclasses.replace(config, tp_invariant_width=layout_width(config.model, widths))
    deadline = config.parallel.collective_timeout_s
    groups, dp = config.parallel.ep_width.groups, (config.parallel.dp if disagg is None
                                                    else disagg.decode_dp)
    if dp % groups:
        raise ValueError(f"ep_groups: {groups} groups do not split {dp} DP ranks evenly")
    if disagg is None:
        client = GroupClient(config, config.parallel.tp, config.parallel.dp, deadline,
                             ray_address)
    else:
        cache = dataclasses.replace(config.cache,
                                    page_size=disagg.prefill_page_size or config.cache.page_size)
        client = DisaggClient(dataclasses.replace(config, cache=cache), config, disagg,
                              deadline, ray_address)
    if client.ep.needs_tables:  # cost_model without --ep-costs: measured on these ranks
        try:
            client.ep.use_tables(calibrate(client))
        except BaseException:
            client.close()
            raise
    return client
