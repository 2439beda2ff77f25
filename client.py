"""``pagedserve.client``: the gRPC clients (implemented in ``pagedserve.cluster.client``)."""
from pagedserve.cluster.client import AsyncClient, Client, Completion, Delta, GenerateResult, build_request

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "GenerateResult", "build_request"]
