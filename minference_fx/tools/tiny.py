"""Tiny random-weight HF causal LMs of known architectures, built from configs (nothing is downloaded).

What ``minference-fx inspect --model <family>``, the tests and ``scripts/survey_architectures.py`` build:
two layers of 4 query heads (2 kv heads where the family has GQA), head dim 16, vocabulary 128.
"""
from __future__ import annotations

import dataclasses

import torch

COMMON_FIELDS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=128, num_hidden_layers=2)


@dataclasses.dataclass(frozen=True)
class TinyFamily:
    config: str
    """transformers config class"""
    model: str
    """transformers causal-LM class"""
    fields: dict = dataclasses.field(default_factory=dict)
    """over the common sizes: what this family spells its own way, or needs to fit the tiny vocabulary"""
    drop: tuple = ()
    """common fields this family's config has no use for (left out, so nothing reads a stray value)"""


FAMILIES = {
    "llama": TinyFamily("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": TinyFamily("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": TinyFamily("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 24}),
    "gemma3": TinyFamily("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 24}),
    "phi": TinyFamily("PhiConfig", "PhiForCausalLM"),
    "phi3": TinyFamily("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": None}),
    "olmo": TinyFamily("OlmoConfig", "OlmoForCausalLM"),
    "olmo2": TinyFamily("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": TinyFamily("GraniteConfig", "GraniteForCausalLM"),
    "stablelm": TinyFamily("StableLmConfig", "StableLmForCausalLM"),
    "starcoder2": TinyFamily("Starcoder2Config", "Starcoder2ForCausalLM"),
    "cohere": TinyFamily("CohereConfig", "CohereForCausalLM"),
    "smollm3": TinyFamily("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": None}),
    "glm": TinyFamily("GlmConfig", "GlmForCausalLM", {"head_dim": 16, "pad_token_id": None}),
    "helium": TinyFamily("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "exaone4": TinyFamily("Exaone4Config", "Exaone4ForCausalLM"),
    "gpt_neox": TinyFamily("GPTNeoXConfig", "GPTNeoXForCausalLM", drop=("num_key_value_heads",)),
    "falcon": TinyFamily("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True, "num_kv_heads": 2},
                         drop=("num_key_value_heads",)),
    "gpt2": TinyFamily("GPT2Config", "GPT2LMHeadModel", drop=("num_key_value_heads",)),  # sizes via attribute_map
    # GPT-2's eager path with its scores upcast, from baddbmm on [B·H, S, D] views (the Stanford CRFM models)
    "gpt2_upcast": TinyFamily("GPT2Config", "GPT2LMHeadModel", {"reorder_and_upcast_attn": True},
                              drop=("num_key_value_heads",)),
    "gpt_neox_japanese": TinyFamily("GPTNeoXJapaneseConfig", "GPTNeoXJapaneseForCausalLM",
                                    {"intermediate_multiple_size": 2}, drop=("num_key_value_heads", "intermediate_size")),
}


def _family(name: str) -> TinyFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"no tiny family {name!r}; known: {', '.join(FAMILIES)}") from None


def tiny_config(name: str, attn: str = "sdpa", **overrides):
    """The family's config at the tiny sizes, ``overrides`` last."""
    import transformers  # optional: the [transformers] extra (FAMILIES is readable without it)

    family = _family(name)
    fields = {k: v for k, v in COMMON_FIELDS.items() if k not in family.drop}
    return getattr(transformers, family.config)(**{**fields, **family.fields, **overrides}, attn_implementation=attn)


def tiny_model(name: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """The family's causal LM with random weights from ``seed``, in eval mode."""
    import transformers  # optional: the [transformers] extra

    config = tiny_config(name, attn, **overrides)
    torch.manual_seed(seed)
    return getattr(transformers, _family(name).model)(config).eval()
