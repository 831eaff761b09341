"""Per-request hooks both front doors call (tracing plugs in here); no-ops by default."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams


@dataclass(frozen=True, slots=True)
class CallInfo:
    protocol: str  # grpc | grpc-vllm (vLLM's engine contract) | http
    method: str  # the RPC (Generate) or the HTTP route (/v1/chat/completions)
    operation: str  # GenAI operation: chat | text_completion
    carrier: Mapping[str, str] = field(default_factory=dict)  # metadata / headers (W3C traceparent)
    num_choices: int = 1


class RequestObserver:
    def start(self, request_id: str, engine_id: str, call: CallInfo, params: SamplingParams | None) -> Any:
        """request_id: the client's; engine_id: the engine's (StepStats name requests by it);
        params: the request's validated sampling parameters, None when they were invalid."""
        return None

    def finish(self, handle: Any, final: Any, error_type: str | None, message: str = "",
               attributes: Mapping[str, Any] | None = None) -> None:
        """error_type: None on success, else the status (gRPC code name or HTTP status);
        attributes: protocol-specific ones (rpc.grpc.status_code, http.response.status_code)."""
        return None
