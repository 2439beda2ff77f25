"""The ``pagedserve.v1.GenerationService`` implementation: parses requests, runs them through the engine client
and streams the responses back, mapping each error type to its status code."""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc

from pagedserve.cluster.server.grpc_api.auth import caller, metadata_value
from pagedserve.cluster.server.grpc_api.protocol import ResponseBuilder, params_from_proto
from pagedserve.cluster.server.internal_errors import report
from pagedserve.cluster.server.metrics import RequestTimer
from pagedserve.cluster.server.request_ids import server_request_id
from pagedserve.cluster.server.state import RETRY_AFTER_S, ServingState
from pagedserve.cluster.server.tenants import TenantTicket
from pagedserve.common.config import utf8_size_over
from pagedserve.common.errors import EngineUnavailableError, InvalidRequestError, OverloadedError
from pagedserve.proto.fields import FINISH_NAMES
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.proto.v1 import generation_pb2_grpc as pb_grpc

INLINE_TOKENIZE_CHARS = 16_384  # longer texts are tokenized off the event loop, which streams the other requests
INLINE_DETOKENIZE_IDS = 4096


def _session_id(context: grpc.aio.ServicerContext) -> str | None:
    """The ``x-session-id`` metadata: the session's requests stick to one replica (see the router)."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-session-id" and value:
            return value if isinstance(value, str) else value.decode()
    return None


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, state: ServingState) -> None:
        """With several API keys (the state's), an Abort reaches only the requests made with the key it presents."""
        self.state = state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        timer = self.state.metrics.request("grpc")
        admitted = finished = False
        code = None
        try:
            metadata = context.invocation_metadata()
            owner = caller(self.state.keys, metadata)
            header = self.state.tenants.header
            tenant = self.state.tenant_of(owner, metadata_value(metadata, header) if header else None)
            # The tenant's limits, then the server's, before anything is parsed or tokenized. aclosing: a cancelled
            # call closes the engine stream at once, which aborts the request and frees its blocks, rather than
            # whenever the abandoned generators are collected.
            with self.state.tenants.admit(tenant) as ticket, self.state.request_slot():
                timer.tenant(ticket.label)
                async with aclosing(self._generate(request, timer, _session_id(context), owner, ticket)) as responses:
                    async for resp in responses:
                        admitted = True
                        finished = resp.finished
                        yield resp
        except InvalidRequestError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(e))
        except OverloadedError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(e), trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))
        except EngineUnavailableError as e:
            code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, str(e))
        except Exception as e:  # a bug: an error id for the client, the detail in the log
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, report(e, "Generate"))
        finally:
            if code is not None:
                timer.error(code.name)
            if admitted and not finished:  # cancelled or deadline (abort), or failed (error)
                timer.finished("error" if code is not None else "abort")

    async def _generate(self, request: pb.GenerateRequest, timer: RequestTimer, session_id: str | None,
                        owner: int | None, ticket: TenantTicket):
        engine = self.state.ready_engine()
        parsed = params_from_proto(request)
        rid = server_request_id(request.request_id)
        prompt = parsed.prompt if parsed.prompt_token_ids is None else parsed.prompt_token_ids
        text, core_request = await engine.process(rid, prompt, parsed.params, request.cache_salt or None,
                                                  request.priority, ticket.tenant)
        num_prompt_tokens = len(core_request.prompt_token_ids)
        lp = getattr(parsed.params, "logprobs", None) or 0
        plp = getattr(parsed.params, "prompt_logprobs", None) or 0
        builder = ResponseBuilder(rid, num_prompt_tokens, lp, plp,
                                  cached_prompt_tokens=self.state.options.prompt_tokens_details)
        admitted = False
        self.state.owners.add(rid, owner)
        try:
            async with aclosing(engine.generate(text, core_request, parsed.stream, session_id,
                                                ticket.started)) as outputs:
                async for out in outputs:
                    if not admitted:
                        admitted = True
                        timer.admitted(num_prompt_tokens, core_request.sampling_params.max_tokens
                                       or engine.info.max_model_len - num_prompt_tokens)
                    resp = builder.build(out)
                    timer.tokens(sum(len(c.token_ids) for c in resp.completions))
                    if out.finished:
                        timer.finished(_finish_reason(resp))
                    yield resp
        finally:
            self.state.owners.discard(rid)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer, text, limit = self.state.tokenizer, request.text, self.state.max_prompt_bytes
        if utf8_size_over(text, limit) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"text exceeds {limit} bytes (max_prompt_bytes)")

        def run() -> pb.TokenizeResponse:
            ids = tokenizer.encode(text) if text else []
            return pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))

        return await asyncio.to_thread(run) if len(text) > INLINE_TOKENIZE_CHARS else run()

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        tokenizer = self.state.tokenizer
        vocab, limit, ids = len(tokenizer), self.state.max_token_ids, list(request.token_ids)
        if len(ids) > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: {len(ids)} ids, more than max_model_len ({limit})")
        bad = [t for t in ids if t >= vocab]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True

        def run() -> pb.DetokenizeResponse:
            return pb.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=skip))

        return await asyncio.to_thread(run) if len(ids) > INLINE_DETOKENIZE_IDS else run()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        try:
            engine = self.state.ready_engine()
        except EngineUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        m, info = self.state.model, self.state.model.info
        stats = await engine.get_stats()
        total = sum(s.kv_blocks_total for s in stats)
        free = sum(s.kv_blocks_free for s in stats)
        return pb.GetModelInfoResponse(
            model_name=m.name, architecture=info.architecture, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, tensor_parallel_size=info.tensor_parallel_size,
            data_parallel_size=engine.num_replicas, block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
            num_free_kv_blocks=free, kv_cache_usage=1.0 - free / total if total else 0.0,
            num_running_requests=sum(s.num_running for s in stats),
            num_waiting_requests=sum(s.num_waiting for s in stats),
            eos_token_ids=list(info.eos_token_ids), dtype=info.dtype)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """``request_id``: the server's id (the responses'). With API keys, a request made with another key is not
        found, exactly as an unknown id."""
        engine, rid = self.state.engine, request.request_id
        keys = self.state.keys
        if keys and not self.state.owners.owned_by(rid, caller(keys, context.invocation_metadata())):
            return pb.AbortResponse(found=False)
        found = engine is not None and await engine.abort(rid)
        return pb.AbortResponse(found=found)


def _finish_reason(resp: pb.GenerateResponse) -> str:
    reasons = [FINISH_NAMES[c.finish_reason] for c in resp.completions if c.finish_reason]
    return reasons[0] if reasons else "stop"
