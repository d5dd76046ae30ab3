"""The real SmolLM2-135M-Instruct (Llama architecture, tied embeddings, 30 layers) through a head and two
workers in fp32: greedy text equal to transformers', and a chat through its own template."""
from __future__ import annotations

import pytest
import torch

from cluster import Cluster, write_topology
from model_helpers import OurModel, hf_logits
from tc.model.config import ModelConfig
from tc.model.tokenizer import TextTokenizer

pytestmark = [pytest.mark.demo, pytest.mark.slow]

PROMPT = "The three primary colors are"
NEW_TOKENS = 24
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def cluster(smollm2_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smollm2-cluster")
    topo = write_topology(workdir / "t.yaml", smollm2_dir, [{"id": "a", "device": "cpu"},
                                                            {"id": "b", "device": "cpu"}])
    with Cluster(topo, workdir) as running:
        running.start_all(["a", "b"])
        yield running


def hf_greedy(model, ids: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_it_is_a_tied_llama_and_its_fp32_logits_match_transformers(smollm2_dir, hf_smollm2):
    config = ModelConfig.from_file(smollm2_dir / "config.json")
    assert (config.model_type, config.num_hidden_layers, config.tie_word_embeddings) == ("llama", 30, True)
    ids = TextTokenizer.load(smollm2_dir).encode(PROMPT)
    ours = OurModel(smollm2_dir, splits=[15]).full_logits(ids)
    assert (ours - hf_logits(hf_smollm2, ids)).abs().max().item() < 1e-3  # the demo model's fp32 bound


def test_head_and_two_workers_write_transformers_greedy_text(cluster, smollm2_dir, hf_smollm2):
    tokenizer = TextTokenizer.load(smollm2_dir)
    expected = tokenizer.decode(hf_greedy(hf_smollm2, tokenizer.encode(PROMPT), NEW_TOKENS))
    status, body = cluster.post("/v1/completions", {"model": smollm2_dir.name, "prompt": PROMPT,
                                                    "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected
    assert any(color in expected.lower() for color in ("red", "blue", "yellow", "green")), expected  # real words
    head_log = cluster.head.output()
    assert "assigned layers 0-14" in head_log and "assigned layers 15-29" in head_log


def test_chat_through_its_own_template(cluster, smollm2_dir, hf_smollm2):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": QUESTION}]
    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert TextTokenizer.load(smollm2_dir).encode(
        TextTokenizer.load(smollm2_dir).apply_chat_template(messages)) == list(prompt_ids)
    end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    reply = hf_greedy(hf_smollm2, list(prompt_ids), 40, eos=end)
    expected = hf_tok.decode([t for t in reply if t != end])
    status, body = cluster.post("/v1/chat/completions", {"model": smollm2_dir.name, "messages": messages,
                                                         "max_tokens": 40, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected
    assert "Paris" in expected
