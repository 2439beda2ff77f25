"""``pagedserve.client``: the gRPC clients (the client room, ``pagedserve.cluster.client``)."""
from pagedserve.cluster.client import AsyncClient, Client, Completion, Delta, GenerateResult, build_request

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "GenerateResult", "build_request"]
