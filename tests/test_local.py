"""The single-process generator in each weight mode: quantized while loading, as a cluster's workers and head do."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model_helpers import OurModel
from tc.local import load_local_generator
from tc.model.quant import Int4Linear, Int8Linear, QuantizationError, quantize_linears
from tc.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("quant,layer_cls", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_layers_in_the_mode_and_the_lm_head_in_the_head_mode(tiny_model_dir, quant, layer_cls):
    generator = load_local_generator(tiny_model_dir, "fp32", quant=quant, group_size=32)
    stage = generator.pipeline.stages[0]
    assert isinstance(stage.layers["0"].mlp.down_proj, layer_cls)
    assert isinstance(generator.head.lm_head, Int8Linear)  # quant.head_weight_mode: int8 under int4 too
    # the same as quantizing a loaded float model afterwards: the codes do not depend on when
    ours = OurModel(tiny_model_dir)
    quantize_linears(ours.stages[0], quant, 32)
    quantize_linears(ours.head, "int8", 32)
    ids = [5, 77, 200, 13, 42]
    with torch.inference_mode():
        hidden = generator.pipeline.prefill(generator.head.embed(torch.tensor([ids])), capacity=len(ids))
        assert torch.equal(generator.head.logits(hidden), ours.head.logits(ours.final_hidden(ids)))
    assert generator.generate(ids, SamplingParams(max_tokens=3, temperature=0)).completion_tokens == 3


def test_an_unknown_mode_is_refused(tiny_model_dir):
    with pytest.raises(QuantizationError, match="int3"):
        load_local_generator(tiny_model_dir, "fp32", quant="int3")


@pytest.mark.parametrize("flag, value, named", [("--top-p", "0", "top_p"), ("--temperature", "-1", "temperature"),
                                                ("--temperature", "inf", "temperature"),
                                                ("--seed", "99999999999999999999999", "seed")])
def test_generate_refuses_a_bad_sampling_value_in_one_line_before_loading(tiny_model_dir, flag, value, named):
    done = subprocess.run([sys.executable, "-m", "tc", "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                           flag, value], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "loaded" not in done.stderr  # refused before the model was read


@pytest.mark.parametrize("prompt, named", [("", "the prompt is empty"), ("hi " * 5000, "the context holds")])
def test_generate_refuses_a_prompt_the_model_cannot_take_in_one_line(tiny_model_dir, prompt, named):
    done = subprocess.run([sys.executable, "-m", "tc", "generate", "--model", str(tiny_model_dir), "--prompt", prompt],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_generate_refuses_layer_tensors_a_worker_would_refuse(tmp_path):
    """A checkpoint with weights tc would leave out (a variant's extra bias or norm) is refused by every worker;
    `tc generate` ran it and printed what the model without them computes."""
    from safetensors.torch import load_file, save_file

    from tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "extra", seed=2)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.extra_norm.weight"] = torch.ones(64)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    done = subprocess.run([sys.executable, "-m", "tc", "generate", "--model", str(model_dir), "--prompt", "hi",
                           "--max-tokens", "2", "--dtype", "fp32"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "model.layers.1.mlp.extra_norm.weight" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_generate_writes_a_plain_prompts_text_as_a_completion_goes_on(tmp_path, capsys):
    """A plain prompt is read as /v1/completions reads it (its BOS too), and its text goes on as a completion's:
    under a SentencePiece tokenizer the text was decoded on its own, so it lost the space its first word starts
    with ("the café" went on "the..." where the API's completion read " the...")."""
    import json

    from tiny_model import sentencepiece_tokenizer, write_tiny_model
    from tc.cli import main

    model_dir = write_tiny_model(tmp_path / "sp", seed=4)  # its first greedy token after the prompt is a word's
    sentencepiece_tokenizer().save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    generator = load_local_generator(model_dir, "fp32")
    ids = generator.tokenizer.encode("the café", add_special_tokens=True)
    expected = generator.generate(ids, SamplingParams(max_tokens=4, temperature=0, continues_prompt=True)).text
    assert expected.startswith(" ")
    assert main(["generate", "--model", str(model_dir), "--prompt", "the café", "--max-tokens", "4",
                 "--dtype", "fp32"]) == 0
    assert capsys.readouterr().out == expected + "\n"
