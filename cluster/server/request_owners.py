"""Which API key started each running generation request, over both protocols, so that an Abort made with one key
cannot end a request made with another. A key is known by its index in the configured list (``api_keys``); None
when the server has no keys."""
from __future__ import annotations


class RequestOwners:
    def __init__(self) -> None:
        self._owner: dict[str, int | None] = {}  # engine request id -> key index; event loop only

    def add(self, request_id: str, owner: int | None) -> None:
        """Before the request reaches the engine, so that an Abort never finds it there unowned."""
        self._owner[request_id] = owner

    def discard(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def owned_by(self, request_id: str, owner: int | None) -> bool:
        return request_id in self._owner and self._owner[request_id] == owner

    def __len__(self) -> int:
        return len(self._owner)
