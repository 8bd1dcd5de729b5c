"""`DPGroups`: the DP ranks of one side of a layout (the colocated ranks, or the decode
side of the disaggregated layout) split evenly into DP×EP groups, each a supervisor and
a key of the reconciler.

The side has `dp` DP ranks of `tp` ranks each in every layout; the EP-width policy only
changes how many groups they form (`EPLayout`: `groups` groups of `width` ranks). Global
DP rank g (the router's index) lives in group `g // (dp / groups)`, at that group's DP
rank `g % (dp / groups)` (wrapping around a group serving narrower than desired, after
a rank it could not replace). Keys `{prefix}0 .. {prefix}{dp-1}` cover every layout;
those past `groups` are retired (no actors) until a layout needs them.
"""

from __future__ import annotations

from collections.abc import Callable

from ..policies.ep_width import EPLayout
from .supervisor import GroupSupervisor

__all__ = ["DPGroups"]


class DPGroups:
    """The groups of one side; `supervisors` of the layout in global DP order."""

    def __init__(self, make: Callable[[int], GroupSupervisor], dp: int, tp: int, groups: int,
                 prefix: str) -> None:
        """`make(dp)`: a supervisor of a group of `dp` DP ranks (not formed yet)."""
        if groups < 1 or dp % groups:
            raise ValueError(f"ep_groups: {groups} groups do not split {dp} DP ranks evenly")
        self.dp, self.tp, self.groups = dp, tp, groups
        self.keys = [f"{prefix}{i}" for i in range(dp)]
        self.by_key = {k: make(dp // groups if i < groups else 1) for i, k in enumerate(self.keys)}

    # -- the layout ------------------------------------------------------------------
    @property
    def layout(self) -> EPLayout:
        return EPLayout(self.tp * self.dp // self.groups, self.groups)

    def active(self) -> list[str]:
        """Keys of the layout's groups, in global DP order."""
        return self.keys[:self.groups]

    @property
    def supervisors(self) -> list[GroupSupervisor]:
        return [self.by_key[k] for k in self.active()]

    def retired(self) -> tuple[str, ...]:
        return tuple(self.keys[self.groups:])

    def form(self) -> None:
        """Form the layout's groups (at start)."""
        for sup in self.supervisors:
            sup.form()

    def target(self, dp_rank: int) -> tuple[str, int]:
        """The group a global DP rank lives in, and its DP rank there."""
        per = self.dp // self.groups
        g = dp_rank % self.dp
        key = self.keys[g // per]
        return key, (g % per) % max(1, self.by_key[key].dp)

    def base(self, key: str) -> int:
        """The global DP rank of `key`'s first DP rank."""
        return self.keys.index(key) * (self.dp // self.groups)

    def reshape(self, layout: EPLayout) -> dict[str, int]:
        """Take `layout` as the desired one; each key's DP ranks in it (0: retired), for
        the reconciler. ValueError for a layout that does not split the side evenly."""
        if layout.width % self.tp or layout.width * layout.groups != self.tp * self.dp:
            raise ValueError(f"layout {layout} does not split {self.tp * self.dp} ranks of "
                             f"tp {self.tp} evenly")
        self.groups = layout.groups
        per = layout.width // self.tp
        return {k: per if i < layout.groups else 0 for i, k in enumerate(self.keys)}

    def fewest_pages(self, serving: Callable[[str], bool], default: int) -> int:
        """The fewest KV pages of a serving DP leader of the layout."""
        pages = [i["num_pages"] for k in self.active() if serving(k)
                 for i in self.by_key[k].start_info[::self.tp]]
        return min(pages, default=default)

    def close(self) -> None:
        for sup in self.by_key.values():
            if sup.actors:
                sup.shutdown()
