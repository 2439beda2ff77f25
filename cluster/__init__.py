"""The serving cluster, one room per job: ``server`` (gRPC gateway), ``client`` (Python clients), ``runtime``
(engine-core actors, replicas and the router over them, on Ray) and ``entrypoints`` (the CLI, serve, demo)."""
if "." not in __name__:  # imported as a top-level name (the checkout root on sys.path): see pagedserve/__init__.py
    from pagedserve import _yield_top_level_name

    _yield_top_level_name(__name__)
