"""The runtime room: the engine on Ray. The engine-core actor that owns a replica's ``EngineCore``, the replicas
and their placement groups, and the router over them (the server's ``EngineClient``)."""
