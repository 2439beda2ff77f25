"""The serving cluster, one room per job: ``server`` (gRPC gateway), ``client`` (Python clients), ``runtime``
(engine-core actors, replicas and the router over them, on Ray) and ``entrypoints`` (the CLI, serve, demo)."""
