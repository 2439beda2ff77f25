"""The online engine API: text in, ``RequestOutput`` out, driven one ``step()`` at a time."""
from __future__ import annotations

import itertools

from pagedserve.config import EngineArgs, EngineConfig
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def tokenize_prompt(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as text, token ids or a dict with either."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown:
            raise ValueError(f"unknown prompt fields {sorted(unknown)}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list):
        return None, list(prompt)
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this engine runs with skip_tokenizer_init")
    return prompt, tokenizer.encode(prompt) if prompt else []


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: str | None = None, executor_cls=None,
                 skip_tokenizer_init: bool = False) -> None:
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or config.model_config.model)
        self.core = EngineCore(config, executor_cls)
        self.processor = OutputProcessor(self.tokenizer, self.core.stop_sequence)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, executor_cls=None) -> "LLMEngine":
        return cls(args.create_engine_config(), args.tokenizer, executor_cls, args.skip_tokenizer_init)

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def validate(self, prompt: PromptType, params: SamplingParams | BeamSearchParams | None):
        """Tokenize and check a request without queueing it: (prompt text, token ids, params)."""
        text, ids = self.tokenize_prompt(prompt)
        params = self.core.check_request(ids, params)
        if isinstance(params, SamplingParams) and params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        return text, ids, params

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None, stream: bool = False) -> str:
        """Queue a request. ``stream`` detokenizes every step (for streaming) rather than at the end.
        With ``BeamSearchParams`` it is a beam search, whose single output is a ``BeamSearchOutput``."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.processor.states:
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids, params = self.validate(prompt, params)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        self.core.add_request(request_id, ids, params, cache_salt=salt)
        self.processor.add_request(request_id, text, ids, params, stream)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort_request(rid)
            self.processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.scheduler.num_unfinished

    def step(self) -> list[RequestOutput | BeamSearchOutput]:
        return self.processor.process(self.core.step())
