"""`GroupGraphs`: CUDA graphs of a DP×EP group's decode steps (ranks over the peer
exchange, so no step waits on the host; tp 1, on GPU).

Invariant: in a step every rank launches the same exchanges with the same capacity. So a
step replays only if every rank's batch is decode-only (or empty) and the largest fits a
graph; every rank then replays the size the ranks agreed on (the exchanges' capacity is
that size times top-k, captured), an idle rank with padding rows only. Otherwise every
rank runs eager. Graphs are captured without peers: the warm-up forwards run with the
dispatcher's stand-in exchanges (`EPDispatcher.rehearsal`), so ranks capture
independently and no kernel is first loaded while a peer's wait spins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ...comm.dispatch import EPDispatcher
from ...comm.peer_exchange import PeerExchange
from ...engine.cuda_graphs import DecodeGraphs
from ...engine.llm_engine import LLMEngine
from ...log import get_logger

log = get_logger(__name__)


class GroupGraphs:
    """The captured decode steps of one rank of a DP×EP group."""

    def __init__(self, engine: LLMEngine, dispatcher: EPDispatcher,
                 exchanges: Sequence[PeerExchange], fault_point: Callable[[str], None]) -> None:
        """exchanges: the peer channels, (dispatch, combine) per lane; with two lanes
        (the runner's `lanes`) the split graphs are captured too."""
        cfg = engine.config
        runner = engine.runner
        self._runner, self._exchanges, self._fault_point = runner, tuple(exchanges), fault_point
        self.graphs = DecodeGraphs(engine.model, runner.caches,
                                   min(cfg.cuda_graph_max_batch, cfg.scheduler.max_num_seqs),
                                   cfg.max_model_len, cfg.cache.page_size, runner.device,
                                   lanes=runner.lanes)

        def sized(size: int) -> None:
            dispatcher.step_tokens = size

        self.graphs.capture(dispatcher.rehearsal, sized)
        runner.graphs, runner.auto_graphs = self.graphs, False  # the group decides
        self.moe_layers = cfg.model.num_moe_layers
        self.replays = 0
        self.split_replays = 0

    @staticmethod
    def wanted(config, tp: int, exchanges: Sequence[PeerExchange]) -> bool:
        """Whether a rank of this config captures its group's steps (`config`: the one
        the user gave, before multi-rank steps were made eager)."""
        return (bool(exchanges) and tp == 1 and config.device.startswith("cuda")
                and not config.enforce_eager and config.cuda_graph_max_batch > 0)

    def size(self, tokens: int, eager: int) -> Optional[int]:
        """The size this step replays on every rank, given the largest batch of the
        group (`tokens`) and whether any rank's step must run eager; None: eager."""
        if eager or not self.graphs.fits(tokens):
            return None
        return self.graphs.size_for(max(tokens, 1))

    def can_split(self, size: int) -> bool:
        """Whether `size` has a two-micro-batch graph."""
        return self.graphs.can_split(size)

    def replay(self, inputs, size: int, split: bool = False) -> Optional[torch.Tensor]:
        """Replay `size` (split: as two micro-batches) for this rank's decode batch
        (`inputs`; None: idle) and bound its exchanges like eager ones (settle them
        before reading the logits); the logits, or None when idle. The chaos drills'
        dispatch fault point is passed once per MoE layer and micro-batch, before the
        replay."""
        lanes = 2 if split else 1
        for _ in range(self.moe_layers * lanes):
            self._fault_point("moe_dispatch")
        if inputs is None:
            self.graphs.run_idle(size, split)
            logits = None
        else:
            logits = self._runner.forward(inputs, graph_size=size,
                                          microbatches=lanes)
        for ex in self._exchanges[:2 * lanes]:  # (dispatch, combine) of each lane used
            ex.graph_replayed(self.moe_layers)
        self.replays += 1
        self.split_replays += split
        return logits
