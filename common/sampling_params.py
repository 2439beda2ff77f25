"""Sampling parameters, named and meant as in vLLM."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Every new token is matched against every stop string (on the gateway's event loop): bounded, so that one request
# cannot stall the others.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class StructuredOutputsParams:
    """Constrain a completion, as vLLM's ``StructuredOutputsParams``: exactly one of a JSON schema (``json``, a dict
    or its JSON text), any JSON object (``json_object``), a regular expression, a list of choices, or a Lark/EBNF
    ``grammar``. The completion ends with finish reason "stop" once the constraint is complete."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON kinds: no whitespace beyond the compact form (vLLM's option; a small model may otherwise loop on it).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice or grammar, "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k))


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Streamed: an output per this many new tokens, raising the server's --stream-interval (the first and last
    # outputs go out at once).
    stream_interval: int | None = None
    # Filled by the engine: eos ids from generation_config.json, unless ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        self.verify()

    def verify(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}")

        for name in _FLOAT_FIELDS:  # NaN passes every comparison below, and inf breaks the sampler
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            bad("best_of", f"must be greater than or equal to n ({self.n}), got {self.best_of}")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"must have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.max_stop_str_len > MAX_STOP_STRING_CHARS:
            bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters, got {self.max_stop_str_len}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if self.stream_interval is not None and (not isinstance(self.stream_interval, int)
                                                 or isinstance(self.stream_interval, bool) or self.stream_interval < 1):
            bad("stream_interval", f"must be at least 1, got {self.stream_interval!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.is_greedy and self.best_of > 1:
            bad("best_of", "must be 1 when using greedy sampling (temperature 0)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


@dataclass
class BeamSearchParams:
    """Beam search, as vLLM's ``BeamSearchParams``, with HF's ``early_stopping`` (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError("beam search is deterministic: temperature must be 0")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
