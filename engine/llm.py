"""The offline API, as in vLLM: ``LLM(model).generate(prompts, sampling_params)``."""
from __future__ import annotations

import weakref
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedserve.common.outputs import BeamSearchOutput, RequestOutput
from pagedserve.common.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, tensor_parallel_size: int = 1,
                 dtype: str = "auto", seed: int = 0, **kwargs) -> None:
        known = EngineArgs.field_names()
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM arguments: {unknown}")
        args = EngineArgs(model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                          dtype=dtype, seed=seed, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        # Workers (Ray actors, placement group) go when the LLM does: on shutdown(), leaving a `with` block, the
        # last reference dropped, or interpreter exit, whichever comes first.
        self._release = weakref.finalize(self, self.llm_engine.core.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Release the workers now: Ray actors and their placement group for tensor parallelism, or the in-process
        weights and KV cache."""
        self._release()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.core.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """``priority``: one per prompt, lower first, with ``scheduling_policy="priority"`` (vLLM's)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params, priorities), use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt, run inside the engine; each output's ``sequences`` are best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(self._add_all(prompts, [params] * len(prompts), [0] * len(prompts)), use_tqdm)

    def _add_all(self, prompts: list[PromptType], params: list, priorities: list[int]) -> list[str]:
        """Process every request first, so a bad one leaves nothing half-queued; then queue them all."""
        if not self._release.alive:
            raise RuntimeError("this LLM was shut down; build a new one")
        engine = self.llm_engine
        processed = []
        for i, (p, sp, prio) in enumerate(zip(prompts, params, priorities)):
            try:
                processed.append(engine.process_request(None, p, sp, prio))
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}") from None
        return [engine.add_processed_request(text, req) for text, req in processed]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in getattr(out, "outputs", []))
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]
