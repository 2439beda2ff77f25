"""The client room: gRPC clients and request building. Imports neither torch nor Ray (an import-linter contract
holds this), so a client host needs only grpcio and protobuf."""
from pagedserve.cluster.client.client import AsyncClient, Client
from pagedserve.cluster.client.request import Completion, Delta, GenerateResult, accumulate, build_request

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "GenerateResult", "accumulate", "build_request"]
