"""The plain data every layer shares: configs, sampling parameters, outputs and the typed errors."""
if "." not in __name__:  # imported as a top-level name (the checkout root on sys.path): see pagedserve/__init__.py
    from pagedserve import _yield_top_level_name

    _yield_top_level_name(__name__)
