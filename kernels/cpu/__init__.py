"""The C++ CPU kernels (``csrc/``, built at first use by ``extension.py``) and the Python side of each."""
