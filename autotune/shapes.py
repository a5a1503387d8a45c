"""The attention shape to tune for, read from an HF ``config.json`` (nothing downloaded, no transformers)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    head_dim: int
    group: int
    """query heads per kv head"""
    num_kv_heads: int


def shape_from_hf_config(path) -> AttentionShape:
    """From a ``config.json`` or a directory holding one; multimodal configs nest it under ``text_config``."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--model {path}: no HF config.json there")
    cfg = json.loads(file.read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        q_heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or q_heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // q_heads
    except KeyError as e:
        raise ValueError(f"{file}: no {e.args[0]!r}, so the attention shape is unknown; give --head-dim and --gqa") from None
    if q_heads % kv_heads:
        raise ValueError(f"{file}: {q_heads} query heads are not a multiple of {kv_heads} kv heads")
    return AttentionShape(head_dim, q_heads // kv_heads, kv_heads)
