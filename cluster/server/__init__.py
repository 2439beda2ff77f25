"""The server room: what a client talks to. The gRPC servicer, API-key authentication, proto conversion and the
gateway's metrics, all coded against the engine layer's ``EngineClient``, never against Ray."""
