"""The gRPC API (``pagedserve.v1.GenerationService``, health, reflection) on the shared serving state."""
