"""Tiny random-weight Qwen2 model directories, made with a fixed seed, for fast tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": 256,
        "use_sliding_window": False,
        "hidden_act": "silu",
    }
    config.update(overrides)
    return config


def random_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    state = {"model.embed_tokens.weight": rand(config["vocab_size"], h, scale=1.0),
             "model.norm.weight": 1 + rand(h, scale=0.1)}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = rand(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": 1 + rand(h, scale=0.1),
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.q_proj.bias": rand(h),
            p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    return state


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with no merges: 256 byte tokens, then the ChatML specials at 256..258."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def sentencepiece_tokenizer() -> Tokenizer:
    """A tokenizer as Llama 2's and Mistral's tokenizer.json hold theirs: SentencePiece pieces ("▁" for a space)
    with byte fallback (a byte no piece spells is a token "<0xNN>"). <unk>, <s>, </s> at 0..2, the 256 bytes at
    3..258, then the pieces of "the café"."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "c"), ("▁c", "a"), ("▁ca", "f"), ("▁caf", "é")]
    for piece in ["▁", "t", "h", "e", "c", "a", "f", "é", *(a + b for a, b in merges)]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def write_tiny_model(path: Path, *, seed: int = 0, shards: int = 1, dtype: torch.dtype = torch.float32,
                     **config_overrides) -> Path:
    """Write a complete HF-style model directory (weights, config, tokenizer) and return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**config_overrides)
    state = {k: v.to(dtype).contiguous() for k, v in random_state_dict(config, seed).items()}
    if shards == 1:
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    else:
        # like real checkpoints: layers in order across the shards, the embedding first, the norm and lm_head last
        layers = config["num_hidden_layers"]

        def shard_of(name: str) -> int:
            if name.startswith("model.layers."):
                return int(name.split(".")[2]) * shards // layers
            return 0 if name.startswith("model.embed_tokens") else shards - 1

        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t for n, t in state.items() if shard_of(n) == s}
            save_file(part, path / file, metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 258]}))
    return path
