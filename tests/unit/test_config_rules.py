"""The rules every layer shares, each written once in ``common/config.py``: a text's UTF-8 size against
``max_prompt_bytes`` (the engine, the chat route and both tokenize routes ask it), and a model's attention heads as
Hugging Face configs give them (the models, the TP check and the preflight's KV sizing)."""
from __future__ import annotations

from types import SimpleNamespace

from pagedserve.common.config import AttentionShape, utf8_size_over


def test_utf8_size_over_counts_bytes_not_characters():
    assert utf8_size_over("a" * 10, 10) is None
    assert utf8_size_over("a" * 11, 10) == 11
    assert utf8_size_over("é" * 5, 10) is None and utf8_size_over("é" * 6, 10) == 12  # 2 bytes each
    assert utf8_size_over("🚀" * 3, 11) == 12
    assert utf8_size_over("\ud800" * 4, 11) == 12  # a lone surrogate, as JSON can carry: 3 bytes, no error
    assert utf8_size_over("", 0) is None


def test_attention_shape_defaults_follow_hugging_face():
    plain = AttentionShape.of(SimpleNamespace(num_attention_heads=8, hidden_size=256))
    assert plain == AttentionShape(num_heads=8, num_kv_heads=8, head_size=32)
    gqa = AttentionShape.of(SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=80,
                                            hidden_size=256))
    assert gqa == AttentionShape(num_heads=8, num_kv_heads=2, head_size=80)
    assert AttentionShape.of(SimpleNamespace(num_attention_heads=4, num_key_value_heads=None, head_dim=None,
                                             hidden_size=64)).head_size == 16


def test_kv_heads_per_rank_split_or_replicated():
    shape = AttentionShape(num_heads=8, num_kv_heads=2, head_size=16)
    assert [shape.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert AttentionShape(8, 8, 16).kv_heads_per_rank(4) == 2
