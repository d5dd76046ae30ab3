"""The sampling a model's own generation_config.json recommends, for the requests that leave those fields out.

Qwen3 asks for temperature 0.6, top_p 0.95 and top_k 20 (its card warns that other settings repeat without end),
Qwen2.5 for 0.7 / 0.8 / 20 with a repetition penalty: a request that names none of these was sampled at OpenAI's
temperature 1 with no truncation, which small models answer with noise. As vLLM serves by default, each of the
fields below that the file gives and a request leaves out takes the file's value; a request's own value always
wins, and `do_sample` is not read (vLLM does not either). A greedy request (temperature 0, its own or the
model's) takes none of the others: its reply is the model's argmax, which a repetition penalty would move and
which top_k, top_p and min_p leave as it is. A value out of the API's range is left out, with a warning.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

from .api_requests import SAMPLING_PARSERS, RequestError

log = logging.getLogger(__name__)

DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(model_dir: Path) -> Mapping[str, float]:
    """The fields of DEFAULTED that `model_dir`'s generation_config.json gives, each checked as a request's is."""
    path = Path(model_dir) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): requests that leave out their sampling take the API's defaults", path, exc)
        return {}
    if not isinstance(data, dict):
        return {}
    defaults: dict[str, float] = {}
    for name in DEFAULTED:
        if data.get(name) is None:
            continue
        try:
            defaults[name] = SAMPLING_PARSERS[name](data[name])
        except RequestError as exc:
            log.warning("%s: %s; requests that leave %s out take the API's default", path.name, exc, name)
    return defaults


def describe(defaults: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in defaults.items())
