"""What the head is doing before it serves: the steps of its start, as its API reports them meanwhile.

The head opens its API once it has planned, before it fetches and reads its own tensors (for a large model, a
download and minutes of reading), so that a health check, a load balancer or a client finds a head that is loading,
not a closed port it cannot tell from a dead head's. Until the model is loaded the API is `api.create_loading_app`,
which reads a `HeadLoading`: the loading thread names each step as it begins and reports its progress where it has
any (the bytes of a file being fetched), and request threads read the step at any time.

The head listens for workers meanwhile too: each joins and loads its layers while the head loads its own share,
so that a cluster is ready when its slowest member is, not after the head and then its workers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .service import Readiness, ServiceError


@dataclass(frozen=True)
class LoadStep:
    """One step of the head's start: `step` for programs, `message` for people, progress where the step has it."""

    step: str  # "opening", "fetching_tensors", "fetching_tokenizer", "loading_tensors", "loading_tokenizer"
    message: str
    done: int | None = None  # in `unit`, of `total`
    total: int | None = None
    unit: str | None = None

    def body(self) -> dict[str, Any]:
        progress = None if self.done is None else {"done": self.done, "total": self.total, "unit": self.unit}
        return {"step": self.step, "message": self.message, "progress": progress}


class HeadLoading:
    """The step the head's start is at. One thread (the head's start) sets it; any thread reads it: each change
    replaces a frozen LoadStep, so a reader sees one step whole, never half of two."""

    def __init__(self, model_id: str, context_length: int, workers: Callable[[], Readiness]):
        self.model_id, self.context_length = model_id, context_length
        self.workers = workers  # which workers have joined and loaded their layers meanwhile (the registry's view)
        self._step = LoadStep("opening", "opening the model's files")

    def now(self) -> LoadStep:
        return self._step

    def begin(self, step: str, message: str, *, total: int | None = None, unit: str | None = None) -> None:
        self._step = LoadStep(step, message, 0 if unit is not None else None, total, unit)

    def advance(self, done: int, total: int | None = None) -> None:
        """The current step's progress: `done` (and `total`, where it was not known at the start) in its unit."""
        step = self._step
        self._step = replace(step, done=done, total=step.total if total is None else total)


class StillLoading(ServiceError):
    """A request that needs the model, while the head still loads it."""

    def __init__(self, step: LoadStep):
        self.step = step
        super().__init__(f"The model is still loading at the head ({step.message}); try again shortly")
