"""Which replica keeps a stored response of OpenAI's Responses API.

A router keeps the responses it answered in its own memory, so a request that names one
(`previous_response_id`, or `GET` / `DELETE /v1/responses/{id}`) must reach that replica. The
gateway learns each response's home from the answer it relays (the id is in its first bytes,
streamed or not) and remembers the most recent HOMES of them. A request naming a response is
sent to its home first; one whose home it does not know (the gateway restarted, or another
gateway relayed the answer) is tried on each replica in turn until one does not answer 404.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

HOMES = 1 << 16  # ids remembered; a router's own store is smaller (it keeps the responses too)
HEAD = 4096  # bytes of an answer read for its id
_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]+)"')


def named_response(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request (its path below /v1) names, if any."""
    if path.startswith("responses/"):
        return path.split("/")[1] or None
    if method == "POST" and path == "responses":
        try:
            named = json.loads(body).get("previous_response_id")
        except (ValueError, AttributeError):
            return None
        return named if isinstance(named, str) and named else None
    return None


def answered_id(head: bytes) -> str | None:
    """The id of the response whose answer begins with `head`."""
    m = _ID.search(head[:HEAD])
    return m[1].decode() if m else None


class ResponseHomes:
    def __init__(self, size: int = HOMES):
        self.size = size
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> replica address, oldest first

    def learn(self, response_id: str, address: str) -> None:
        self._homes[response_id] = address
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.size:
            self._homes.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)

    def first(self, order: list, response_id: str, address_of) -> list:
        """`order` with the response's home (where known) first; `address_of(item)` names an item's replica."""
        home = self._homes.get(response_id)
        return sorted(order, key=lambda item: address_of(item) != home)
