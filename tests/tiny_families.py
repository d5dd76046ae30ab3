"""Tiny random-weight models of every family tc runs, written by transformers' own classes (fixed seed).

Each is a complete model directory (save_pretrained's config.json and safetensors, plus the byte tokenizer of
tiny_model.py), with several layers and grouped-query attention, and weights drawn large enough that logits differ
clearly between tokens (transformers' own init, std 0.02, leaves near-ties that rounding could flip).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from tiny_model import CHATML_TEMPLATE, byte_tokenizer

SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, eos_token_id=256,
              bos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
# Phi-3.5-mini's kind: a factor per frequency from one of two lists, and cos/sin scaled by an attention factor
SHORT_FACTORS = [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0]
LONG_FACTORS = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]
# Phi-4-mini's kind: three quarters of each head rotate (12 of 16 here, 96 of 128 there), tied embeddings
PHI4_MINI_ROPE = {"rope_type": "longrope", "short_factor": SHORT_FACTORS[:6], "long_factor": LONG_FACTORS[:6],
                  "factor": 4.0, "rope_theta": 10000.0}
MINISTRAL3_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "rope_theta": 1e6,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5}
PIXTRAL_TOWER = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
VISION_TOKENS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)

# name: (transformers config class, model class, config arguments beyond SHAPES)
FAMILIES = {
    "qwen2-own-head-dim": ("Qwen2Config", "Qwen2ForCausalLM", dict(head_dim=32)),
    "qwen2-linear-rope": ("Qwen2Config", "Qwen2ForCausalLM",
                          dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 1e6})),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict()),
    "llama-dynamic-rope": ("LlamaConfig", "LlamaForCausalLM",
                           dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM",
                         dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=6)),
    # the whole context inside the pre-training one (the short list) and an attention factor of its own; the long
    # list: test_families.py's longrope tests
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(original_max_position_embeddings=256,
                           rope_parameters={"rope_type": "longrope", "short_factor": SHORT_FACTORS,
                                            "long_factor": LONG_FACTORS, "factor": 4.0, "rope_theta": 10000.0})),
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM",
                  dict(original_max_position_embeddings=256, partial_rotary_factor=0.75, tie_word_embeddings=True,
                       rope_parameters=PHI4_MINI_ROPE)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                    final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=32, sliding_window=5, query_pre_attn_scalar=24, sliding_window_pattern=2,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Gemma 3's 4B-27B kind: the "gemma3" language model inside an image-text model, beside a vision tower tc never
    # reads (its tensors, and the language model's, under the names such checkpoints are published with)
    "gemma3-image-text": ("Gemma3Config", "Gemma3ForConditionalGeneration",
                          dict(text_config="gemma3", mm_tokens_per_image=4,
                               vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                  intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                                  image_size=28, patch_size=14))),
    # Mistral Small 3.1 / 3.2's kind: the Mistral language model beside a Pixtral tower tc never reads, untied
    "mistral3-image-text": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                            dict(text_config="mistral-window", tie_word_embeddings=False, image_token_index=300,
                                 vision_config=PIXTRAL_TOWER)),
    # Ministral 3's kind: yarn, and queries scaled by position once rotated past the original context (4 positions
    # here, so that every prompt reaches past it; 16384 in the published files); and its image-text checkpoints
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(head_dim=16, rope_parameters=MINISTRAL3_ROPE)),
    "mistral3-ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                            dict(text_config="ministral3", tie_word_embeddings=False, image_token_index=300,
                                 vision_config=PIXTRAL_TOWER)),
    # Ministral 3 3B's layout: tied at the top level, no lm_head of its own in the checkpoint
    "mistral3-ministral3-tied": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                                 dict(text_config="ministral3", tie_word_embeddings=True, image_token_index=300,
                                      vision_config=PIXTRAL_TOWER)),
    # Qwen's image-text kinds: Qwen2's or Qwen3's language model under MRoPE (the second interleaved), beside a
    # vision tower tc never reads; a text_config dict holds the language model's arguments beyond SHAPES
    "qwen2.5-vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(text_config=dict(rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                          "rope_theta": 1e6}),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                           out_hidden_size=SHAPES["hidden_size"], fullatt_block_indexes=[0]),
                        **VISION_TOKENS)),
    "qwen3-vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(text_config=dict(head_dim=32, rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5],
                                                                     "mrope_interleaved": True, "rope_theta": 5e5}),
                      vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                         out_hidden_size=SHAPES["hidden_size"], deepstack_visual_indexes=[0]),
                      **VISION_TOKENS)),
    # NoPE layers (0) on either side of a split after layer 2; SmolLM3-3B's own files slide nowhere
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0, 1, 0], rope_theta=10000.0)),
    # with a window, SmolLM3Config slides the NoPE layers
    "smollm3-window": ("SmolLM3Config", "SmolLM3ForCausalLM",
                       dict(no_rope_layers=[0, 1, 0, 1], use_sliding_window=True, sliding_window=5)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",  # multipliers of Granite 3.0's kind, none a power of two
                dict(embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.22, logits_scaling=3.0,
                     tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(attention_bias=True)),
    # EXAONE 4.0 32B's kind: sliding layers that rotate and full NoPE ones (every second here, by Exaone4Config's
    # rule; every fourth there), on either side of a split after layer 2
    "exaone4-hybrid": ("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=5, sliding_window_pattern=2,
                                                                    head_dim=32)),
    # EXAONE 4.0 1.2B's kind: no window, every layer rotating, llama3 rope, tied
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                dict(sliding_window=None, layer_types=["full_attention"] * 4, tie_word_embeddings=True,
                     rope_parameters=LLAMA3_ROPE)),
    # GLM-4's kind: half of each head (the config class's default factor) rotating in interleaved pairs, under yarn
    # here; GLM-4-0414's adds sandwich norms under names of its own
    "glm": ("GlmConfig", "GlmForCausalLM",
            dict(head_dim=32, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16)),
    # whole heads rotating in interleaved pairs: ERNIE 4.5's with biases everywhere, tied; Helium's with norms that
    # scale in fp32
    "ernie4.5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(head_dim=32, use_bias=True)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(head_dim=16, attention_bias=True)),
    "seed-oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=32)),
    # Cohere's parallel blocks under one layer norm, logits scaled; Cohere 2's sliding layers rotating and every
    # second one full and NoPE, on either side of a split after layer 2
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25, attention_bias=True)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=0.125, sliding_window=5,
                                                            layer_types=["sliding_attention", "full_attention"] * 2)),
    # sliding and global layers on either side of a split after layer 2, each type with a rotary base of its own
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(attention_bias=True, sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(**MOE, shared_expert_intermediate_size=48, mlp_only_layers=[2])),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**MOE, norm_topk_prob=True, head_dim=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
}


def hf_classes(name: str):
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    return getattr(transformers, config_cls), getattr(transformers, model_cls), extra


@torch.no_grad()
def write_family_model(path: Path, name: str, seed: int = 0, **changes) -> Path:
    """Write the tiny model `name` of FAMILIES to `path` (fp32 safetensors) and return the directory."""
    config_cls, model_cls, extra = hf_classes(name)
    if isinstance(extra.get("text_config"), str):  # an image-text model whose language model is that entry's
        text_cls, _, text_extra = hf_classes(extra["text_config"])
        config = config_cls(**{**extra, "text_config": text_cls(**{**SHAPES, **text_extra, **changes}).to_dict()})
    elif "text_config" in extra:  # an image-text model with its language model's arguments
        config = config_cls(**{**extra, "text_config": {**SHAPES, **extra["text_config"], **changes}})
    else:
        config = config_cls(**{**SHAPES, **extra, **changes})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    for pname, param in model.named_parameters():
        if param.dim() == 1:  # norms (around 1, or around 0 where the family adds the 1) and biases
            base = 0.0 if "norm" not in pname or name.startswith("gemma") else 1.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=g))
        else:
            scale = 1.0 if "embed_tokens" in pname else 0.08
            param.copy_(torch.randn(param.shape, generator=g) * scale)
    path = Path(path)
    model.save_pretrained(str(path))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
    }))
    return path


def hf_family_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the directory, by the class its config.json names (no Auto class takes them all)."""
    import transformers

    (architecture,) = json.loads((Path(path) / "config.json").read_text())["architectures"]
    model_cls = getattr(transformers, architecture)
    return model_cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").eval()


def edited_copy(model_dir: Path, path: Path, tensors: Callable[[dict[str, torch.Tensor]], dict] | None = None,
                config: Callable[[dict[str, Any]], dict] | None = None) -> Path:
    """A copy of the model directory `model_dir` (one model.safetensors) at `path`, whose tensors are
    tensors(those stored) and whose config.json is config(its dict), where given; returns `path`."""
    shutil.copytree(model_dir, path)
    if tensors is not None:
        save_file(tensors(load_file(model_dir / "model.safetensors")), path / "model.safetensors",
                  metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config(json.loads((model_dir / "config.json").read_text()))))
    return path
