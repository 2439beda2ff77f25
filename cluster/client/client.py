"""Python clients for a pagedserve gateway: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    with Client("localhost:50051") as c:
        for delta in c.generate_stream("def f(", max_tokens=32):
            print(delta.text, end="")
        print(c.generate("import os", max_tokens=16, temperature=0.0).text)
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cluster.client.request import Delta, GenerateResult, accumulate, build_request
from pagedserve.proto.v1 import generation_pb2 as pb
from pagedserve.proto.v1 import generation_pb2_grpc as pb_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024),
                   ("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000)]


def _credentials(api_key: str | None, tls: bool, root_certificates: bytes | None):
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else []
    creds = grpc.ssl_channel_credentials(root_certificates) if tls or root_certificates else None
    return metadata, creds


class Client:
    def __init__(self, target: str = "localhost:50051", api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None) -> None:
        self.metadata, creds = _credentials(api_key, tls, root_certificates)
        self.channel = (grpc.secure_channel(target, creds, CHANNEL_OPTIONS) if creds
                        else grpc.insecure_channel(target, CHANNEL_OPTIONS))
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[pb.GenerateResponse]:
        """The raw responses of a Generate call (kwargs as in ``build_request``)."""
        return self.stub.Generate(build_request(prompt, **kwargs), metadata=self.metadata, timeout=self.timeout)

    def generate_stream(self, prompt: str | list[int], **kwargs) -> Iterator[Delta]:
        result = GenerateResult("", [])
        for resp in self.stream(prompt, **kwargs):
            yield from accumulate(result, resp)

    def generate(self, prompt: str | list[int], **kwargs) -> GenerateResult:
        result = GenerateResult("", [])
        for resp in self.stream(prompt, **kwargs):
            result.request_id = resp.request_id
            accumulate(result, resp)
        return result

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata,
                                       timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids), metadata=self.metadata,
                                    timeout=self.timeout).text

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=self.timeout)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata,
                               timeout=self.timeout).found

    def health(self, service: str = "") -> str:
        """SERVING / NOT_SERVING / ... of the server (``service`` "" = the whole server)."""
        resp = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_for_health(self, want: str = "SERVING", timeout: float = 120.0, poll: float = 0.05,
                        check: Callable[[], None] | None = None) -> list[str]:
        """Poll health until it is ``want``; returns the distinct states seen, in order (an unreachable server
        counts as none). ``check`` runs before every poll and raises to give up early (e.g. the server died)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check is not None:
                check()
            try:
                status = self.health()
            except grpc.RpcError:
                status = None
            if status and (not seen or seen[-1] != status):
                seen.append(status)
            if status == want:
                return seen
            time.sleep(poll)
        raise TimeoutError(f"health never {want} after {timeout} s; saw {seen}")


class AsyncClient:
    def __init__(self, target: str = "localhost:50051", api_key: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, timeout: float | None = None) -> None:
        self.metadata, creds = _credentials(api_key, tls, root_certificates)
        self.channel = (grpc.aio.secure_channel(target, creds, CHANNEL_OPTIONS) if creds
                        else grpc.aio.insecure_channel(target, CHANNEL_OPTIONS))
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.timeout = timeout

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def stream(self, prompt: str | list[int], timeout: float | None = None, **kwargs):
        return self.stub.Generate(build_request(prompt, **kwargs), metadata=self.metadata,
                                  timeout=timeout or self.timeout)

    async def generate_stream(self, prompt: str | list[int], **kwargs) -> AsyncIterator[Delta]:
        result = GenerateResult("", [])
        async for resp in self.stream(prompt, **kwargs):
            for d in accumulate(result, resp):
                yield d

    async def generate(self, prompt: str | list[int], **kwargs) -> GenerateResult:
        result = GenerateResult("", [])
        async for resp in self.stream(prompt, **kwargs):
            result.request_id = resp.request_id
            accumulate(result, resp)
        return result

    async def tokenize(self, text: str) -> list[int]:
        resp = await self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata, timeout=self.timeout)
        return list(resp.token_ids)

    async def model_info(self) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=self.timeout)

    async def abort(self, request_id: str) -> bool:
        resp = await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata,
                                     timeout=self.timeout)
        return resp.found

    async def health(self, service: str = "") -> str:
        resp = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                     timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
