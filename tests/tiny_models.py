"""Tiny random-weight HF models built from configs: no downloads."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from minference_fx.config import ModelIdentity, SemanticConfig, default_config, model_identity_from_hf
from minference_fx.plan import Pattern

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_hidden_layers=2)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 24}),
}


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_cls(**{**_COMMON, **extra, **overrides}, attn_implementation=attn)
    return model_cls(cfg).eval()


def covering_config(model, pattern=Pattern.VERTICAL_SLASH) -> SemanticConfig:
    """Budgets that cover every key (and sparse from length 0): must equal dense attention."""
    budgets = {Pattern.VERTICAL_SLASH: (1 << 20, 1 << 20), Pattern.A_SHAPE: (0, 1 << 20), Pattern.BLOCK_SPARSE: (1 << 20, 0), Pattern.DENSE: (0, 0)}[pattern]
    return default_config(model_identity_from_hf(model.config), pattern=pattern, budgets=budgets, min_sparse_len=0)


def small_budget_config(model) -> SemanticConfig:
    """A-shape with a 1-token sink and 1-token window: far from dense."""
    return default_config(model_identity_from_hf(model.config), pattern=Pattern.A_SHAPE, budgets=(1, 1), min_sparse_len=0)


def wrong_config() -> SemanticConfig:
    return default_config(ModelIdentity(num_layers=32, num_q_heads=8, num_kv_heads=2, head_dim=16), min_sparse_len=0)
