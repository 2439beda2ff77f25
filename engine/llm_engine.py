"""The online engine API: text in, ``RequestOutput`` out, driven one ``step()`` at a time."""
from __future__ import annotations

import itertools
from collections.abc import Callable

from pagedserve.common.config import EngineConfig
from pagedserve.common.errors import InvalidRequestError
from pagedserve.common.outputs import BeamSearchOutput, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_types import EngineCoreRequest
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.executor import Executor, create_executor
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: str | None = None, skip_tokenizer_init: bool = False,
                 executor_factory: Callable[[EngineConfig], Executor] = create_executor) -> None:
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or config.model_config.model)
        self.core = EngineCore(config, executor_factory)
        try:
            self.input_processor = InputProcessor(self.tokenizer, self.core.get_info())
            self.output_processor = OutputProcessor(self.tokenizer, self.core.stop_sequence,
                                                    config.scheduler_config.stream_interval)
        except BaseException:
            self.core.shutdown()
            raise
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         executor_factory: Callable[[EngineConfig], Executor] = create_executor) -> LLMEngine:
        return cls(args.create_engine_config(), args.tokenizer, args.skip_tokenizer_init, executor_factory)

    def process_request(self, request_id: str | None, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, priority: int = 0
                        ) -> tuple[str | None, EngineCoreRequest]:
        """Tokenize and validate a request without queueing it (raises InvalidRequestError)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.states:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        return self.input_processor.process(request_id, prompt, params, priority=priority)

    def add_processed_request(self, prompt: str | None, request: EngineCoreRequest, stream: bool = False) -> str:
        """Queue a request made by ``process_request``. ``stream`` detokenizes every step (for streaming) rather
        than at the end."""
        self.core.add_request(request)
        self.output_processor.add_request(request.request_id, prompt, request.prompt_token_ids, request.params,
                                          stream)
        return request.request_id

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None, stream: bool = False,
                    priority: int = 0) -> str:
        """Queue a request. With ``BeamSearchParams`` it is a beam search, whose single output is a
        ``BeamSearchOutput``. ``priority``: lower first, under ``scheduling_policy="priority"`` (vLLM's)."""
        return self.add_processed_request(*self.process_request(request_id, prompt, params, priority), stream)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.core.abort_request(rid)
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput | BeamSearchOutput]:
        return self.output_processor.process(self.core.step())
