"""The Responses API's store: responses kept in memory for previous_response_id and GET, the
least recently used dropped first once there are more than max_responses or their
conversations hold more than max_chars characters."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as returned
    conversation: list[dict[str, Any]]  # chat messages up to and including its answer (no instructions)
    num_chars: int = 0


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_chars: int = 64 * 1024 * 1024) -> None:
        if max_responses < 1:
            raise ValueError(f"max_stored_responses must be >= 1, got {max_responses}")
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        entry.num_chars = len(json.dumps(entry.conversation)) + len(json.dumps(entry.body))
        self.delete(response_id)
        self._entries[response_id] = entry
        self._num_chars += entry.num_chars
        while len(self._entries) > self.max_responses or (self._num_chars > self.max_chars and len(self._entries) > 1):
            _, dropped = self._entries.popitem(last=False)
            self._num_chars -= dropped.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._num_chars -= entry.num_chars
        return entry is not None
