"""What the gateway's APIs accept and show, from ``serve``'s flags."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.server.api_keys import KeyTable
from pagedserve.cluster.shared import is_loopback


@dataclass(frozen=True)
class ApiOptions:
    strict_request_fields: bool = False  # HTTP: unknown request fields are a 400 rather than ignored with a warning
    disable_docs: bool = False  # HTTP: no /docs, /redoc or /openapi.json
    # Usage reports the prompt tokens served from the prefix cache (HTTP prompt_tokens_details.cached_tokens, gRPC
    # cached_prompt_tokens). Off by default, as vLLM: it tells one tenant what another has cached.
    prompt_tokens_details: bool = False
    # Chat tool calling: with tool_choice "auto" the model's text is parsed for calls by this parser (vLLM's names,
    # see openai/tool_parsers); without it "auto" is refused, as vLLM does.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


def exposure_warning(host: str, keys: KeyTable) -> str | None:
    """What to warn about serving on ``host`` without a key: None on loopback or with a key."""
    if keys or is_loopback(host):
        return None
    return (f"serving on {host} with no API key: anyone who can reach it can use the model and abort requests "
            "(--api-key, --api-key-file or the tenants' keys in --tenants-file)")
