from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_model import write_tiny_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from _demo import demo_model_dir as build

    return build()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from _demo import smollm2_dir as build

    return build()


@pytest.fixture
def gated(tiny_model_dir):
    """A generator whose steps after the first wait for generator.pipeline.gate (model_helpers.GatedPipeline): a
    generation then keeps its place in the batch for as long as a test needs, where a few tokens of the tiny model
    would otherwise be done before the test's next line."""
    from model_helpers import GatedPipeline, OurModel
    from tc.generation import Generator
    from tc.model.tokenizer import TextTokenizer

    model = OurModel(tiny_model_dir)
    return Generator(model.head, TextTokenizer.load(tiny_model_dir), GatedPipeline(model.stages), torch.float32)
