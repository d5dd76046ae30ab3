"""Run our model and transformers' on the same directory, for parity tests."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from tc.generation import LocalPipeline
from tc.head.api import create_app
from tc.head.http_server import start_http_server
from tc.head.service import GenerationService, Readiness, WorkerLost
from tc.model.config import ModelConfig
from tc.model.qwen2 import HeadModel, Stage
from tc.model.weights import WeightIndex, layer_tensor_names
from tc.protocol.messages import Assignment


NEAR_TIE = 1e-3  # a log-probability gap so small that fp32 rounding of another product shape may pick either token


def assert_same_greedy_text(text: str, alone) -> None:
    """A batched request's greedy `text` equals its solo Completion `alone` (asked with logprobs >= 2), or departs
    from it only at a token where the solo run's two best candidates were within NEAR_TIE.

    In fp32 a batch's products run over more rows than a solo step's, and the BLAS may then sum in another order
    (last bits, ~1e-6 relative): greedy output stays the same except at a genuine tie, where either token is right
    and the texts part ways for good. Anything else (a wrong cache, a row from another sequence) departs at once
    and by far."""
    if text == alone.text:
        return
    at = next((i for i, (a, b) in enumerate(zip(text, alone.text)) if a != b), min(len(text), len(alone.text)))
    token = max((t for t in alone.tokens if t.offset <= at), key=lambda t: t.offset)
    (_, best), (_, second) = token.logprob.top[:2]
    assert best - second < NEAR_TIE, (f"the batched text departs from the solo one at character {at} (token "
                                      f"{token.id}, logprob gap {best - second:.2e}, not a tie):\n{text!r}\n"
                                      f"{alone.text!r}")


class GatedPipeline(LocalPipeline):
    """The real stages, but once a step holds `hold_at` sequences, one of them already started, it waits for `gate`
    to open (60 s at most): the running generations then keep their places in the batch, and the scheduler stays
    in that step, for as long as a test needs."""

    def __init__(self, stages: list, hold_at: int = 1):
        super().__init__(stages)
        self.gate = threading.Event()
        self.hold_at = hold_at

    def run(self, entries, hidden):
        if len(entries) >= self.hold_at and any(e.start > 0 for e in entries):
            self.gate.wait(60)
        return super().run(entries, hidden)


def serve_app(generator, model_id: str, body_limit: int, cors_origins: tuple[str, ...] = (),
              api_keys: tuple[str, ...] = (), **service_args):
    """The head's API over `generator` on a live Waitress server (an ephemeral loopback port), its one worker w1
    ready; `service_args` go to GenerationService."""
    service = GenerationService(model_id, generator.tokenizer, generator, readiness=lambda: Readiness(1, ("w1",), ()),
                                **service_args)
    app = create_app(service, max_body_bytes=body_limit, cors_origins=cors_origins, api_keys=api_keys)
    return start_http_server(app, "127.0.0.1", 0, threads=4, max_body_bytes=body_limit, cors_origins=cors_origins)


class LosesWorkerAtDecode(LocalPipeline):
    """The real stages, but the third decode step loses its worker w1, as a remote pipeline would."""

    decodes = 0

    def run(self, entries, hidden):
        if entries[0].start > 0:
            self.decodes += 1
            if self.decodes == 3:
                raise WorkerLost("w1", "connection reset")
        return super().run(entries, hidden)


class OurModel:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, splits: list[int] | None = None,
                 pack: bool | None = None):
        self.config = ModelConfig.from_file(Path(model_dir) / "config.json")
        self.index = WeightIndex.open(model_dir)
        self.index.validate(self.config)
        self.dtype = dtype
        self.head = HeadModel.load(self.config, self.index, dtype, pack=pack)
        bounds = [0, *(splits or []), self.config.num_hidden_layers]
        self.stages = [Stage.load(self.config, self.index, a, b, dtype, pack=pack) for a, b in zip(bounds, bounds[1:])]

    def pipeline(self) -> LocalPipeline:
        return LocalPipeline(self.stages)

    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [L, vocab] for every position, from one prefill."""
        hidden = self.pipeline().prefill(self.head.embed(torch.tensor([ids])), capacity=len(ids))
        return self.head.logits(hidden)[0]

    def cached_logits(self, ids: list[int], split: int) -> torch.Tensor:
        """fp32 logits [L, vocab] from a prefill of ids[:split] and then one cached decode step per token."""
        pipe = self.pipeline()
        hidden = pipe.prefill(self.head.embed(torch.tensor([ids[:split]])), capacity=len(ids))
        steps = [self.head.logits(hidden)[0]]
        for pos in range(split, len(ids)):
            hidden = pipe.decode(self.head.embed(torch.tensor([[ids[pos]]])), pos)
            steps.append(self.head.logits(hidden)[0])
        return torch.cat(steps)

    def final_hidden(self, ids: list[int]) -> torch.Tensor:
        return self.pipeline().prefill(self.head.embed(torch.tensor([ids])), capacity=len(ids))


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), torch_dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def local_assignment(model_dir: Path, start: int, end: int, **changes) -> Assignment:
    """The ASSIGNMENT a head sends for layers [start, end) of the model directory on this machine, fp16 in fp32;
    `changes` replaces any field."""
    config = ModelConfig.from_file(Path(model_dir) / "config.json")
    fields = dict(model_id=str(model_dir), model_source="local", revision=None, device="cpu",
                  architecture=config.model_type,
                  quant="fp16", group_size=128, compute_dtype="fp32", layer_start=start, layer_end_exclusive=end,
                  config=config.to_dict(), tensor_count=len(layer_tensor_names(config, start, end)))
    return Assignment(**{**fields, **changes})
