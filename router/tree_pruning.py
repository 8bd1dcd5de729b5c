"""How a `PrefixTree` loses pages: LRU eviction past a group's capacity, dropping what a
group reports it no longer holds (`refresh`, `forget`), removing a group, and deleting
pages no group lists any more. A mixin of `PrefixTree` (prefix_tree.py), split off to keep
each file to one concern; it uses the tree's `_roots`, `_groups` and `_nodes`.

Eviction follows the lazy LRU order of page_runs.py: the group's least recent leaf goes
first, and the pages above it on its path go with it in one step for as long as each,
once bare, is the least recent leaf again (its stored tick is not above the evicted one),
which inside one run is a slice, not a loop.
"""

from __future__ import annotations

import heapq
from itertools import repeat
from typing import Collection, Hashable, Optional

from .page_runs import GroupRuns, PageRun, cut_ticks, raise_tick, stored_tick


class TreePruning:
    """Mixin: everything that unlists pages (module docstring)."""

    _roots: dict[int, PageRun]
    _groups: dict[Hashable, GroupRuns]
    _nodes: int

    # ---- eviction ------------------------------------------------------------------

    def _evict_pages(self, gr: GroupRuns, count: int) -> None:
        """Unlists the group's `count` least recent pages."""
        bit, heap, pop = gr.bit, gr.heap, heapq.heappop
        while count > 0:
            assert heap, "a group over capacity has leaves to evict"
            tick, depth, _, r = pop(heap)
            pos = depth - r.depth0
            if pos >= len(r.hashes):  # the page moved to a run cut off this one, or left
                r = r.holding(depth)
                if r is None:
                    continue
                pos = depth - r.depth0
            # stale unless the page is still the group's leaf, at this tick
            if r.held.get(bit, 0) != pos + 1 or (pos + 1 == len(r.hashes) and r.nkids.get(bit)):
                continue
            entries = r.ticks.get(bit)
            if not entries or entries[-1] != (pos, tick):
                continue
            count = self._evict_chain(gr, r, pos, tick, count)

    def _evict_chain(self, gr: GroupRuns, r: PageRun, end: int, tick: int, count: int) -> int:
        """Evicts from leaf `end` of `r` (least recent, at `tick`) up its path while each
        page is the least recent leaf once bare; returns how many pages are still owed."""
        bit = gr.bit
        while True:
            entries = r.ticks.setdefault(bit, [])
            stop = -1  # the deepest page above `end` with a stored tick past `tick` stays
            while entries:
                if entries[-1][1] > tick:
                    stop = entries[-1][0]
                    break
                entries.pop()
            take = min(count, end - stop)
            keep = end + 1 - take
            count -= take
            gr.pages -= take
            if keep:
                r.held[bit] = keep
                self._trim(r)
                last = entries[-1][1] if stop == keep - 1 else raise_tick(entries, keep - 1, tick)
                gr.push_leaf(r, keep - 1, last)
                return count
            par = self._unlist_run(gr, r)
            if par is None:
                return count
            nk = self._drop_kid(par, bit)
            pe = len(par.hashes) - 1
            if count and not nk and stored_tick(par.ticks.get(bit), pe) <= tick:
                r, end = par, pe  # the parent is the least recent leaf now: it goes too
                continue
            top = raise_tick(par.ticks.setdefault(bit, []), pe, tick)
            if not nk:
                gr.push_leaf(par, pe, top)
            return count

    # ---- dropping reported pages -----------------------------------------------------

    def refresh(self, group: Hashable, held: Collection[int], as_of: Optional[int] = None) -> int:
        """Reconciles `group` with the page hashes it reports holding: every listed page
        not in `held` is dropped with its subtree of the group, except pages touched after
        tick `as_of` (routed after the report was taken; None: no exception). Pages in
        `held` that the tree never listed are not added (their chain is unknown).
        Returns the number of pages dropped."""
        gr = self._groups.get(group)
        if not gr or not gr.pages:
            return 0
        held = held if isinstance(held, (set, frozenset, dict)) else set(held)
        bit = gr.bit
        recent = self._recent_prefixes(gr, as_of) if as_of is not None else {}
        stale = []  # per run, its first listed page that is neither held nor recent
        for r in gr.runs:
            start, c = recent.get(r, 0), r.held[bit]
            if start < c:
                found = list(map(held.__contains__, r.hashes[start:c]))
                if not all(found):
                    stale.append((r, start + found.index(False)))
        return sum(self._drop(gr, r, pos) for r, pos in stale)

    def forget(self, group: Hashable, evicted: Collection[int], as_of: Optional[int] = None) -> int:
        """Drops the pages `group` reports it evicted (with their subtrees of the group),
        except pages touched after tick `as_of` (as in `refresh`). Returns the number
        of pages dropped: the incremental form of `refresh`."""
        gr = self._groups.get(group)
        if not gr or not gr.pages:
            return 0
        bit, where = gr.bit, None
        dropped = 0
        for h in evicted:
            if where is None:  # the group's pages -> (run, position); dropping moves none
                where = {}
                for r in gr.runs:
                    c = r.held[bit]
                    where.update(zip(r.hashes[:c], zip(repeat(r), range(c))))
            r, pos = where.get(h, (None, 0))
            if r is not None and pos < r.held.get(bit, 0) \
                    and (as_of is None or not _touched_after(bit, r, pos, as_of)):
                dropped += self._drop(gr, r, pos)
        return dropped

    def _recent_prefixes(self, gr: GroupRuns, as_of: int) -> dict[PageRun, int]:
        """Per run, how many of its first pages have a tick > `as_of` for the group: the
        pages with such a stored tick, and their ancestors."""
        bit, out = gr.bit, {}
        for r in gr.runs:
            q = max((p for p, t in r.ticks.get(bit, ()) if t > as_of), default=-1)
            if q < 0 or out.get(r, 0) > q:
                continue
            out[r] = q + 1
            a = r.parent
            while a is not None and out.get(a, 0) < len(a.hashes):
                out[a] = len(a.hashes)
                a = a.parent
        return out

    def _drop(self, gr: GroupRuns, r: PageRun, pos: int) -> int:
        """Unlists page `pos` of `r` and its listed descendants for the group; the largest
        tick among them goes to the parent page, now a leaf. Returns how many."""
        bit = gr.bit
        c = r.held.get(bit, 0)
        if pos >= c:
            return 0
        entries = r.ticks.setdefault(bit, [])
        dropped, top = c - pos, cut_ticks(entries, pos)
        if r.nkids.get(bit):
            for kid in [k for k in r.kids.values() if bit in k.held]:
                n, t = self._drop_run(gr, kid)
                dropped, top = dropped + n, max(top, t)
            del r.nkids[bit]
        gr.pages -= dropped
        if pos:
            r.held[bit] = pos
            self._trim(r)
            gr.push_leaf(r, pos - 1, raise_tick(entries, pos - 1, top))
            return dropped
        par = self._unlist_run(gr, r)
        if par is not None:
            nk = self._drop_kid(par, bit)
            pe = len(par.hashes) - 1
            t = raise_tick(par.ticks.setdefault(bit, []), pe, top)
            if not nk:
                gr.push_leaf(par, pe, t)
        return dropped

    def _drop_run(self, gr: GroupRuns, root: PageRun) -> tuple[int, int]:
        """Unlists all of `root` and its listed descendants for the group (children
        first; no recursion: a path may hold many runs); returns (pages, largest stored
        tick among them)."""
        bit = gr.bit
        order, stack = [], [root]
        while stack:
            r = stack.pop()
            order.append(r)
            if r.nkids.get(bit):
                stack.extend(k for k in r.kids.values() if bit in k.held)
        n = top = 0
        for r in reversed(order):
            n += r.held.pop(bit)
            top = max(top, max((t for _, t in r.ticks.pop(bit, ())), default=0))
            r.nkids.pop(bit, None)
            del gr.runs[r]
            self._trim(r)
        return n, top

    # ---- removing pages nobody lists -------------------------------------------------

    def _unlist_run(self, gr: GroupRuns, r: PageRun) -> Optional[PageRun]:
        """The group lists no page of `r` any more; returns `r`'s parent run."""
        bit = gr.bit
        del r.held[bit]
        r.ticks.pop(bit, None)
        del gr.runs[r]
        self._trim(r)
        return r.parent

    @staticmethod
    def _drop_kid(par: PageRun, bit: int) -> int:
        """One child run of `par` left the group of `bit`; returns how many it still lists."""
        nk = par.nkids[bit] - 1
        if nk:
            par.nkids[bit] = nk
        else:
            del par.nkids[bit]
        return nk

    def _trim(self, r: PageRun) -> None:
        """Deletes the pages of `r` that no group lists (a suffix, by prefix closure, with
        every child run), and `r` itself when none is left."""
        hs = r.hashes
        top = max(r.held.values()) if r.held else 0
        if top == len(hs):
            return
        for kid in r.kids.values():
            self._delete_run(kid)
        r.kids = {}
        first = hs[0]
        self._nodes -= len(hs) - top
        del hs[top:]
        if not top:
            (self._roots if r.parent is None else r.parent.kids).pop(first)

    def _delete_run(self, root: PageRun) -> None:
        """Deletes `root` and its subtree (all unlisted: never reached, by prefix
        closure)."""
        stack = [root]
        while stack:
            r = stack.pop()
            assert not r.held, "a run some group lists is under a page nobody lists"
            self._nodes -= len(r.hashes)
            r.hashes.clear()  # a heap entry may still name `r`: it finds no page there
            stack.extend(r.kids.values())

    def _remove_runs(self, gr: GroupRuns) -> None:
        """Unlists every page of the group (its runs deepest first, so children go
        before their parents)."""
        bit = gr.bit
        runs = sorted(gr.runs, key=lambda r: -r.depth0)
        for r in runs:
            del r.held[bit]
            r.ticks.pop(bit, None)
            r.nkids.pop(bit, None)
        for r in runs:
            self._trim(r)


def _touched_after(bit: int, r: PageRun, pos: int, as_of: int) -> bool:
    """Whether page `pos` of `r` has a tick > `as_of` for the group of `bit`: a stored
    tick that high at or below it, on `r` or in a child run the group lists."""
    if any(t > as_of for p, t in r.ticks.get(bit, ()) if p >= pos):
        return True
    stack = [k for k in r.kids.values() if bit in k.held] if r.nkids.get(bit) else []
    while stack:
        x = stack.pop()
        if any(t > as_of for _, t in x.ticks.get(bit, ())):
            return True
        if x.nkids.get(bit):
            stack.extend(k for k in x.kids.values() if bit in k.held)
    return False


__all__ = ["TreePruning"]
