"""One intake path. Every request, from the offline API and from every server protocol, is tokenized, validated and
turned into engine parameters here, once, before anything is allocated for it."""
from __future__ import annotations

import copy

from pagedserve.common.config import utf8_size_over
from pagedserve.common.errors import InvalidRequestError
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.core_types import EngineCoreRequest, EngineInfo
from pagedserve.engine.grammar_check import GrammarCheck
from pagedserve.engine.tokenizer import guidance_tokenizer
from pagedserve.scheduler.request import DEFAULT_TENANT, Tenant

# Text, token ids, or a dict with "prompt" or "prompt_token_ids" (and optionally "cache_salt"), as in vLLM.
PromptType = str | list[int] | dict
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


class InputProcessor:
    """``tokenizer`` may be None (``skip_tokenizer_init``): then prompts must be token ids and stop strings are
    refused. ``info`` is the engine's (the smallest KV pool among replicas, for a server)."""

    def __init__(self, tokenizer, info: EngineInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self._grammar_check: GrammarCheck | None = None  # built on the first constrained request

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of a prompt given as text, token ids or a dict with either."""
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise InvalidRequestError(f"unknown prompt fields {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, list(prompt), salt
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init")
        limit = self.info.limits.max_prompt_bytes
        size = utf8_size_over(prompt, limit)
        if size is not None:
            raise InvalidRequestError(f"prompt is {size} bytes; the limit is {limit} (max_prompt_bytes)")
        try:
            return prompt, self.tokenizer.encode(prompt) if prompt else [], salt
        except UnicodeEncodeError:  # lone surrogates, as JSON can carry
            raise InvalidRequestError("prompt is not valid Unicode text (unpaired surrogates)") from None

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams | None = None,
                cache_salt: str | None = None, priority: int = 0, tenant: Tenant = DEFAULT_TENANT
                ) -> tuple[str | None, EngineCoreRequest]:
        """(prompt text, the request as the engine core queues it); raises InvalidRequestError naming the field."""
        self._check_priority(priority)
        text, ids, salt = self.tokenize(prompt)
        max_seqs = self.info.limits.max_seqs
        if isinstance(params, BeamSearchParams):
            if params.beam_width > max_seqs:
                raise InvalidRequestError(f"beam_width must be at most {max_seqs} (max_num_seqs), "
                                          f"got {params.beam_width}")
            step = self.beam_step_params(params)
            self._check(ids, step, params.beam_width)
            return text, EngineCoreRequest(request_id, ids, step, params, cache_salt or salt, priority=priority,
                                           tenant=tenant)
        params = self._prepare(params)
        if params.structured_outputs is not None:
            self._check_structured(params)
        if params.best_of > max_seqs:
            name = "best_of" if params.best_of > params.n else "n"
            raise InvalidRequestError(f"{name} must be at most {max_seqs} (max_num_seqs), got {params.best_of}")
        max_logprobs = self.info.limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_logprobs:
                raise InvalidRequestError(f"{name} must be at most {max_logprobs} (max_logprobs), got {k}")
        self._check(ids, params, params.best_of)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        return text, EngineCoreRequest(request_id, ids, params, None, cache_salt or salt, priority=priority,
                                       tenant=tenant)

    def _check_priority(self, priority: int) -> None:
        """As vLLM: an integer, and other than 0 only under the priority policy (it would be silently ignored)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.info.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority {priority} needs --scheduling-policy priority; this engine "
                                      f"schedules {self.info.scheduling_policy}")

    def _check_structured(self, params: SamplingParams) -> None:
        """Compile-check the constraint here, before anything is allocated: a bad schema or regex is refused with
        what is wrong with it (when its check is quick: see ``GrammarCheck``)."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer; this engine runs with skip_tokenizer_init")
        if self._grammar_check is None:
            self._grammar_check = GrammarCheck(
                guidance_tokenizer(self.tokenizer, self.info.vocab_size, list(self.info.eos_token_ids)))
        error = self._grammar_check.error(params.structured_outputs)
        if error is not None:
            raise InvalidRequestError(error)

    def _prepare(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy with the model's EOS ids as stop tokens (unless ignore_eos)."""
        params = copy.copy(params) if params is not None else SamplingParams()
        try:
            params.verify()
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        params.all_stop_token_ids = set() if params.ignore_eos else set(self.info.eos_token_ids)
        return params

    def beam_step_params(self, bp: BeamSearchParams) -> SamplingParams:
        """Each beam's step: greedy, returning enough top logprobs to rank all continuations."""
        eos = 0 if bp.ignore_eos else len(self.info.eos_token_ids)
        k = min(max(2, 1 + eos) * bp.beam_width, self.info.vocab_size)
        return SamplingParams(temperature=0.0, max_tokens=bp.max_tokens, logprobs=k, ignore_eos=True)

    def _check(self, ids: list[int], params: SamplingParams, num_seqs: int) -> None:
        info = self.info
        n, vocab, max_len = len(ids), info.vocab_size, info.max_model_len
        if n == 0:
            raise InvalidRequestError("prompt must not be empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if params.max_tokens is None:
            if n >= max_len:
                raise InvalidRequestError(f"prompt of {n} tokens leaves no room within max_model_len {max_len}")
        elif n + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
                f"max_model_len {max_len}")
        total = n + (params.max_tokens if params.max_tokens is not None else max_len - n)
        need = -(-total // info.block_size) * num_seqs
        if need > info.num_kv_blocks:
            raise InvalidRequestError(f"request needs up to {need} KV blocks but the cache holds only "
                                      f"{info.num_kv_blocks}; lower max_tokens or raise kv_cache_memory")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids outside the vocabulary: {bad_stop}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequestError(f"logprobs must be at most the vocabulary size {vocab}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise InvalidRequestError(f"prompt_logprobs must be at most the vocabulary size {vocab}")
