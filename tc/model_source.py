"""Where a model's files come from: a local directory as it is, or a HuggingFace repo via its cache.

Each machine resolves the model itself (no weights cross the cluster), and fetches only the files it needs:
config.json and the shard index always, the tokenizer on the head, and only the safetensors shards holding the
tensors it will load.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable

from .model.weights import INDEX_FILE, SINGLE_FILE, WeightsError, read_weight_map

log = logging.getLogger(__name__)

# the chat template may live in tokenizer_config.json or in files of its own (tc/model/chat_template.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/tool_use.jinja")
REQUIRED_TOKENIZER_FILES = ("tokenizer.json",)


class ModelSourceError(RuntimeError):
    """The model could not be found or downloaded."""


class ModelSource:
    def __init__(self, model: str, is_local: bool, revision: str | None = None, cache_dir: Path | None = None):
        self.model, self.is_local, self.revision, self.cache_dir = model, is_local, revision, cache_dir

    def __str__(self) -> str:
        return self.model

    def _download(self, filename: str, optional: bool = False) -> Path | None:
        """One file through huggingface_hub (HF cache semantics, HF_ENDPOINT and HF_HUB_OFFLINE honoured).

        Returns None for an optional file the repo does not have.
        """
        from huggingface_hub import errors, hf_hub_download

        # the remote "no such file" error is its own class in newer huggingface_hub releases
        not_found = tuple(c for c in (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", None))
                          if c is not None)
        try:
            return Path(hf_hub_download(self.model, filename, revision=self.revision,
                                        cache_dir=str(self.cache_dir) if self.cache_dir else None))
        except errors.LocalEntryNotFoundError as exc:  # offline, or the Hub unreachable, and not in the cache
            if optional:  # a cache filled by snapshot_download or `hf download` records no absent files
                log.warning("%s of %s is not in the HF cache and the Hub could not be asked for it; going on "
                            "without it", filename, self.model)
                return None
            raise ModelSourceError(
                f"cannot get {filename} of {self.model}: it is not in the HF cache and the Hub did not provide it "
                f"({_first_line(exc)}). Check this machine reaches the Hub (or set HF_ENDPOINT to a mirror; "
                "HF_HUB_OFFLINE=1 uses the cache alone), or copy the model directory here and give its path as "
                "model: in topology.yaml") from exc
        except not_found:
            if optional:
                return None
            raise ModelSourceError(f"{self.model} has no {filename}") from None
        except errors.RevisionNotFoundError as exc:
            raise ModelSourceError(f"{self.model} has no revision {self.revision!r}; give a branch, tag or commit "
                                   "of the repo as revision: in topology.yaml") from exc
        except errors.RepositoryNotFoundError as exc:
            raise ModelSourceError(f"no HuggingFace repo {self.model!r} (or it is private or gated)") from exc
        except Exception as exc:  # an HTTP error, a broken-off body, a name the cache refuses: one line, not a trace
            raise ModelSourceError(f"cannot download {filename} of {self.model}: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from exc

    def config_dir(self) -> Path:
        """The directory holding config.json (downloading it if needed)."""
        if self.is_local:
            path = Path(self.model)
            if not (path / "config.json").is_file():
                raise ModelSourceError(f"{path} has no config.json; is it a HuggingFace model directory?")
            return path
        log.info("resolving %s from the HuggingFace Hub", self.model)
        path = self._download("config.json")
        assert path is not None
        return path.parent

    def fetch_tensors(self, names: Iterable[str]) -> Path:
        """Make sure the shards holding `names` are present; returns the model directory."""
        root = self.config_dir()
        if self.is_local:
            return root
        index = self._download(INDEX_FILE, optional=True)
        if index is None:
            files = [SINGLE_FILE]
        else:
            files = self._shards(index, names)
        for i, file in enumerate(files, 1):
            started = time.perf_counter()
            log.info("fetching %s (%d/%d) of %s", file, i, len(files), self.model)
            path = self._download(file)
            assert path is not None
            log.info("have %s: %.0f MB in %.1fs", file, path.stat().st_size / 1e6, time.perf_counter() - started)
        return root

    def _shards(self, index: Path, names: Iterable[str]) -> list[str]:
        """The shard files the index puts `names` in (read as WeightIndex reads it). Raises ModelSourceError for
        an index that is no JSON object with a weight_map of file names in the model directory."""
        try:
            weight_map = read_weight_map(index)
        except WeightsError as exc:
            raise ModelSourceError(f"{INDEX_FILE} of {self.model} is malformed: {exc}") from exc
        return sorted({weight_map[n] for n in names if n in weight_map})

    def fetch_tokenizer(self) -> Path:
        root = self.config_dir()
        if not self.is_local:
            for file in TOKENIZER_FILES:
                self._download(file, optional=file not in REQUIRED_TOKENIZER_FILES)
        return root


def _first_line(exc: BaseException) -> str:
    """An exception's message, its first line only (huggingface_hub's run to several, with URLs)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
