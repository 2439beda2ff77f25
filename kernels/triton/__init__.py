"""The Triton kernels (GPU; in its interpreter on CPU for tests): paged attention and the KV-cache ops."""
