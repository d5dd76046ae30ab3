"""The model families tc runs: one registry, keyed by config.json's `architectures` and `model_type`.

A family is a module here that maps its config.json onto a `ModelConfig` (norms, q/k/v biases, q/k norms,
rotary variant, sliding windows, MLP or experts, fused checkpoint tensors) and refuses what tc would not compute
as transformers does. Everything else follows from the ModelConfig: the layers tc builds (model/qwen2.py,
model/moe.py), the tensor names and shapes each layer holds and which ones the head owns (model/weights.py), the
bytes the planner splits by, and what quantization replaces. So adding a family is one module and one line in
FAMILIES below; the head, the worker, the protocol and the planner never name a family.

An architecture not listed is refused by `tc plan`, the head and every worker before anything loads, with the
list of those that are supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import ConfigError, ModelConfig
from . import (cohere, ernie, exaone4, gemma, glm, granite, helium, llama, mistral, moe, olmo2, olmo3, phi3, qwen2,
               qwen3, qwen_vl, seed_oss, smollm3)


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type, the key ASSIGNMENT carries
    architectures: tuple[str, ...]  # config.json's architectures this family runs (causal LMs only)
    parse: Callable[[dict[str, Any]], ModelConfig]  # config.json -> ModelConfig; raises ConfigError


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen2", ("Qwen2ForCausalLM",), qwen2.parse),
    Family("llama", ("LlamaForCausalLM",), llama.parse),
    Family("mistral", ("MistralForCausalLM",), mistral.parse),
    Family("ministral3", ("Ministral3ForCausalLM",), mistral.parse_ministral3),
    Family("mistral3", ("Mistral3ForConditionalGeneration",), mistral.parse_mistral3),  # its language model
    Family("qwen3", ("Qwen3ForCausalLM",), qwen3.parse),
    # the language model of Qwen's image-text checkpoints
    Family("qwen2_vl", ("Qwen2VLForConditionalGeneration",), qwen_vl.parse_qwen2_vl),
    Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), qwen_vl.parse_qwen2_vl),
    Family("qwen3_vl", ("Qwen3VLForConditionalGeneration",), qwen_vl.parse_qwen3_vl),
    Family("phi3", ("Phi3ForCausalLM",), phi3.parse),
    Family("gemma", ("GemmaForCausalLM",), gemma.parse_gemma),
    Family("gemma2", ("Gemma2ForCausalLM",), gemma.parse_gemma2),
    Family("gemma3_text", ("Gemma3ForCausalLM",), gemma.parse_gemma3),
    Family("gemma3", ("Gemma3ForConditionalGeneration",), gemma.parse_gemma3_image_text),  # its language model
    Family("granite", ("GraniteForCausalLM",), granite.parse),
    Family("olmo2", ("Olmo2ForCausalLM",), olmo2.parse),
    Family("glm", ("GlmForCausalLM",), glm.parse_glm),
    Family("glm4", ("Glm4ForCausalLM",), glm.parse_glm4),
    Family("ernie4_5", ("Ernie4_5ForCausalLM",), ernie.parse),
    Family("helium", ("HeliumForCausalLM",), helium.parse),
    Family("seed_oss", ("SeedOssForCausalLM",), seed_oss.parse),
    Family("cohere", ("CohereForCausalLM",), cohere.parse_cohere),
    Family("cohere2", ("Cohere2ForCausalLM",), cohere.parse_cohere2),
    Family("exaone4", ("Exaone4ForCausalLM",), exaone4.parse),
    Family("olmo3", ("Olmo3ForCausalLM",), olmo3.parse),
    Family("smollm3", ("SmolLM3ForCausalLM",), smollm3.parse),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), moe.parse_qwen2_moe),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), moe.parse_qwen3_moe),
    Family("mixtral", ("MixtralForCausalLM",), moe.parse_mixtral),
)}


def supported() -> str:
    """The supported architectures, for error messages."""
    return ", ".join(a for f in FAMILIES.values() for a in f.architectures)


def family_for(data: dict[str, Any]) -> Family:
    """The family config.json's dict belongs to: by `architectures` where it names any, else by `model_type`.

    Raises ConfigError naming the supported architectures for one tc does not run (a causal LM of another family,
    or a model of a known family with another head, such as a sequence classifier).
    """
    archs = data.get("architectures") or []
    model_type = data.get("model_type")
    if not isinstance(archs, list):
        raise ConfigError(f"config.json sets architectures = {archs!r}; expected a list of class names")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"config.json sets model_type = {model_type!r}; expected a name such as \"qwen2\"")
    for family in FAMILIES.values():
        if any(a in family.architectures for a in archs):
            return family
    if not archs and model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ConfigError(f"unsupported model: model_type={model_type!r}, architectures={archs!r}; tc runs "
                      f"{supported()}")


def parse_config(data: dict[str, Any]) -> ModelConfig:
    """config.json's dict as its family reads it. Raises ConfigError, also for a checkpoint whose weights another
    tool quantized (FP8, GPTQ, AWQ, bitsandbytes: `quantization_config`), which tc would read as plain weights."""
    family = family_for(data)
    quantized = data.get("quantization_config")
    if isinstance(data.get("text_config"), dict) and quantized is None:
        quantized = data["text_config"].get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ConfigError(f"config.json sets quantization_config (quant_method {method!r}): this checkpoint's weights "
                          "are quantized by another tool, which tc does not read; use the model's BF16 / FP16 "
                          "release and let tc quantize it (quant: int8 or int4 in the topology)")
    return family.parse(data)
