"""The fleet's error replies as Python exceptions."""

from __future__ import annotations

from typing import Any, Dict, Optional


class GenfleetError(Exception):
    """An error reply of the fleet (`{"error": {"code", "message", "detail"}}`).

    `code` is one of the codes of docs/protocol.md (`NOT_FOUND`, `NO_SLOT_AVAILABLE`,
    `INVALID_REQUEST`, ...), or one of the client's own: `TIMEOUT` (no answer in time),
    `NO_RESPONDERS` (:class:`NoWorker`), `CONNECT_FAILED` (no NATS server took the
    connection); `detail` is the reply's detail object (empty when absent).
    """

    def __init__(self, code: str, message: str, detail: Optional[Dict[str, Any]] = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.detail: Dict[str, Any] = detail or {}

    @classmethod
    def from_reply(cls, reply: Any) -> Optional["GenfleetError"]:
        """The error a reply carries, or None when it is not an error reply."""
        if not isinstance(reply, dict) or not isinstance(reply.get("error"), dict):
            return None
        error = reply["error"]
        return cls(
            str(error.get("code", "INTERNAL")),
            str(error.get("message", "")),
            error.get("detail") if isinstance(error.get("detail"), dict) else None,
        )


class NoWorker(GenfleetError):
    """No worker answered: none runs for the pool, or NATS lost the request."""

    def __init__(self, subject: str):
        super().__init__(
            "NO_RESPONDERS",
            f"no worker answers on {subject}: is a genfleet worker connected?",
        )
