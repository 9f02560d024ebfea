"""The responses a router keeps for the Responses API (`store`, true unless a request says false):
what `GET /v1/responses/{id}` answers, and the conversation a later request continues with
`previous_response_id`. As vLLM keeps its own: in the router's memory, per replica (a gateway
sends a request naming a response to the replica that keeps it, gateway/response_homes.py), lost
when the router stops, and bounded: the RESPONSES most recently stored or used, the oldest
dropped first. A tenant reads only the responses it stored.

A response keeps its whole conversation (the earlier turns' items, its input's, its output's),
so a conversation continues from any response kept, whatever was dropped before it; the items
are shared with the response it continued, not copied.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

RESPONSES = 1024


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as its answer had it
    conversation: list[dict]  # the items a request continuing it starts from


class ResponseStore:
    def __init__(self, size: int = RESPONSES):
        self.size = size
        self._kept: OrderedDict[tuple[str, str], Stored] = OrderedDict()  # (tenant, id), oldest first

    def put(self, tenant: str, stored: Stored) -> None:
        key = tenant, stored.response["id"]
        self._kept[key] = stored
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        stored = self._kept.get((tenant, response_id))
        if stored is not None:
            self._kept.move_to_end((tenant, response_id))
        return stored

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._kept.pop((tenant, response_id), None) is not None
