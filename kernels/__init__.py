"""The kernels: ``torch_ref`` (the executable spec of every op), the C++ CPU kernels and the Triton ones."""
if "." not in __name__:  # imported as a top-level name (the checkout root on sys.path): see pagedserve/__init__.py
    from pagedserve import _yield_top_level_name

    _yield_top_level_name(__name__)
