"""Stop strings, matched in the streamed text at a cost per character that does not depend on
how much text came before or how many stop strings there are.

An Aho-Corasick automaton over the stop strings is fed each new character. Its state is the
longest suffix of the text that is a prefix of some stop string: exactly the text that must be
withheld, because it may still turn into a stop string. Text before it is safe to send. Only the
withheld text is kept, so memory is bounded by the longest stop string.

When stop strings overlap, the output ends where the earliest-starting match begins, as if the
whole text had been searched for every stop string at once.
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    def __init__(self, stops: list[str]):
        # The trie: per node its children, the depth (length of the prefix it spells), the
        # failure link (longest proper suffix that is also a trie node) and the length of the
        # longest stop string ending at it (directly or along failure links), 0 if none.
        self._next: list[dict[str, int]] = [{}]
        self._depth, self._fail, self._match = [0], [0], [0]
        for stop in stops:
            node = 0
            for ch in stop:
                child = self._next[node].get(ch)
                if child is None:
                    child = len(self._next)
                    self._next[node][ch] = child
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._fail.append(0)
                    self._match.append(0)
                node = child
            self._match[node] = len(stop)
        queue = deque(self._next[0].values())
        while queue:  # breadth first, so every failure link points at a finished node
            node = queue.popleft()
            for ch, child in self._next[node].items():
                f = self._fail[node]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                self._fail[child] = self._next[f].get(ch, 0)
                self._match[child] = self._match[child] or self._match[self._fail[child]]
                queue.append(child)
        self._node = 0
        self._pending = ""  # text received but not yet sent: the withheld tail
        self._cut: int | None = None  # where a found match starts, as an index into _pending
        self._cut_len = 0  # and how long it is
        self.stopped = False
        self.matched: str | None = None  # the stop string the output ended at

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string matched). After a match the
        matcher sends nothing more."""
        if self.stopped:
            return "", True
        if not self._next[0]:  # no stop strings
            return delta, False
        text, node, cut, cut_len = self._pending + delta, self._node, self._cut, self._cut_len
        for end in range(len(self._pending) + 1, len(text) + 1):
            ch = text[end - 1]
            while node and ch not in self._next[node]:
                node = self._fail[node]
            node = self._next[node].get(ch, 0)
            if self._match[node]:
                start = end - self._match[node]
                if cut is None or start < cut:
                    cut, cut_len = start, self._match[node]
            if cut is not None and end - self._depth[node] >= cut:
                # No partial match that could start before the cut is still alive: stop there.
                return self._stop(text[:cut], text[cut : cut + cut_len])
        safe = len(text) - self._depth[node]  # cut, if any, lies in the withheld tail
        self._node, self._pending = node, text[safe:]
        self._cut, self._cut_len = None if cut is None else cut - safe, cut_len
        return text[:safe], False

    def _stop(self, out: str, matched: str) -> tuple[str, bool]:
        self._pending, self.stopped, self.matched = "", True, matched
        return out, True

    def flush(self) -> tuple[str, bool]:
        """At the end of generation: the withheld text, cut at a match found but not yet final."""
        if self.stopped:
            return "", True
        if self._cut is not None:
            return self._stop(self._pending[: self._cut], self._pending[self._cut : self._cut + self._cut_len])
        out, self._pending = self._pending, ""
        return out, False
