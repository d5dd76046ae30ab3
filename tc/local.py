"""The whole model in one process: the baseline the cluster is measured against."""
from __future__ import annotations

import logging
import time
from pathlib import Path


from .generation import Generator, LocalPipeline
from .model import quant as quantization
from .model.config import ModelConfig
from .model.qwen2 import HeadModel, Stage, half_dtype, resolve_compute_dtype
from .model.tokenizer import TextTokenizer, check_vocab
from .model.weights import WeightIndex

log = logging.getLogger(__name__)


def load_local_generator(model_dir: Path, dtype: str = "bf16", device: str = "cpu", quant: str = "fp16",
                         group_size: int = quantization.DEFAULT_GROUP_SIZE, pack_head: bool | None = None,
                         draft_tokens: int = 0) -> Generator:
    """Load every layer of the model in `model_dir` into this process, in weight mode `quant` as a cluster does:
    each layer quantized as it loads, the lm_head in `quant.head_weight_mode(quant)`. An lm_head that stays in
    the compute dtype takes the fastest product a probe finds for it (`HeadModel.load`'s pack=None), or with
    pack_head=False stays a plain linear layer, whose weight a greedy screen can read whatever the probe says.

    Raises QuantizationError for an unknown weight mode or group size.
    """
    started = time.perf_counter()
    config = ModelConfig.from_file(Path(model_dir) / "config.json")
    index = WeightIndex.open(model_dir)
    index.validate(config)
    index.refuse_unused_in_layers(config, 0, config.num_hidden_layers)  # as every worker refuses them
    tokenizer = TextTokenizer.load(model_dir)  # before the weights: a damaged or foreign tokenizer fails at once
    check_vocab(tokenizer, config.vocab_size, model_dir)
    torch_dtype = resolve_compute_dtype(dtype, device)
    # the head's part (embedding, norm, lm_head) runs on the CPU, as on a cluster's head; the layers on `device`
    head_mode = quantization.head_weight_mode(quant)
    head = HeadModel.load(config, index, resolve_compute_dtype(dtype, "cpu"),
                          pack=pack_head if head_mode == "fp16" else False)  # a quantized lm_head: nothing to pack
    quantization.quantize_linears(head, head_mode, group_size)
    head.screen_greedy()
    # each weight is quantized as it loads (nothing to do for fp16), as a worker does
    stage = Stage.load(config, index, 0, config.num_hidden_layers, torch_dtype, device,
                       quantization.Quantization(quant, group_size, half_dtype(device)))
    log.info("loaded %s (%d layers, %s, weights %s) in %.1fs", model_dir, config.num_hidden_layers, torch_dtype,
             quant, time.perf_counter() - started)
    return Generator(head, tokenizer, LocalPipeline([stage], device), head.embed_tokens.weight.dtype,
                     draft_tokens=draft_tokens)
