"""What the gateway's APIs accept and show, from ``serve``'s flags."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.cluster.net import is_loopback


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


def api_keys(api_key: str | None) -> list[str]:
    """The keys an ``api_key`` setting holds: one, or a comma-separated list (``--api-key`` given several times or as
    a comma list, ``--api-key-file``); a request must present one of them."""
    return [k.strip() for k in (api_key or "").split(",") if k.strip()]


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn about serving on ``host`` without a key: None on loopback or with a key."""
    if api_keys(api_key) or is_loopback(host):
        return None
    return (f"serving on {host} with no API key: anyone who can reach it can use the model and abort requests "
            "(--api-key or --api-key-file)")
