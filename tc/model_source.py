"""Where a model's files come from: a local directory as it is, or a HuggingFace repo via its cache.

Each machine resolves the model itself (no weights cross the cluster), and fetches only the files it needs:
config.json and the shard index always, the tokenizer on the head, and only the safetensors shards holding the
tensors it will load.

Every download is watched the same way, whichever path huggingface_hub takes: progress lines every
PROGRESS_EVERY_S, its bytes told to a caller as they come (the head's loading status), and the stall rule below. A
file it fetches over HTTP is watched where its body is read, by a hook on its HTTP client (`_StallHook`). A file
of a Xet-backed repo (nearly every model repo on the Hub), with hf_xet installed, hf_xet fetches with a client of
its own that no hook reaches: its progress bar is tc's (`_xet_watched_bar`), and a watchdog thread gives it up.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from .model.weights import INDEX_FILE, SINGLE_FILE, WeightsError, read_weight_map

log = logging.getLogger(__name__)


def _hub_offline() -> bool:
    """Whether huggingface_hub was told to use the cache alone (HF_HUB_OFFLINE, as it read it at import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _one_line_per_hub_record() -> None:
    """huggingface_hub gives its loggers a stderr handler of their own and lets their records reach the root's
    too: where tc's logging has a handler there, each of its retry warnings printed twice. Its own goes."""
    hub = logging.getLogger("huggingface_hub")
    if logging.getLogger().handlers:
        for handler in list(hub.handlers):
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stderr:
                hub.removeHandler(handler)

# the chat template may live in tokenizer_config.json or in files of its own (tc/model/chat_template.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/tool_use.jinja")
REQUIRED_TOKENIZER_FILES = ("tokenizer.json",)

# The stall rule: a download that gets fewer than STALL_MIN_BYTES in any STALL_S_ENV seconds is given up. The
# per-read timeout (HF_HUB_DOWNLOAD_TIMEOUT) alone never ends a link that is alive but all but stalled: a byte
# every few seconds resets it, and a shard of gigabytes would take years. 64 KiB a minute, the default, is about
# 1 KiB/s; a slower link sets a longer time.
STALL_S_ENV = "TC_DOWNLOAD_STALL_S"
DEFAULT_STALL_S = 60.0
STALL_MIN_BYTES = 64 * 1024
PROGRESS_EVERY_S = 30.0  # a download that takes longer says how far it has come this often, not nothing till done
TOKEN_HINT = "HF_TOKEN, or `hf auth login`"  # how a machine gets a Hub token, for the refusals that need one

# told of each file fetch_tensors fetches: (file, its number, files in all); returns what is then told of the file's
# bytes as they come in: (bytes so far, its size where the Hub gave it)
FetchProgress = Callable[[str, int, int], Callable[[int, "int | None"], None]]


class ModelSourceError(RuntimeError):
    """The model could not be found or downloaded."""


class NotInRepo(ModelSourceError):
    """The Hub says the repo has no such file."""


class DownloadStalled(Exception):
    """A response body came in slower than the stall rule allows."""

    def __init__(self, received: int, seconds: float):
        super().__init__(f"{received} bytes in {seconds:.0f}s")
        self.received, self.seconds = received, seconds


def stall_seconds(environ: Mapping[str, str]) -> float:
    """The stall rule's time from STALL_S_ENV (default DEFAULT_STALL_S). Raises ModelSourceError for a value that
    is no finite number above 0."""
    text = environ.get(STALL_S_ENV, "").strip()
    if not text:
        return DEFAULT_STALL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ModelSourceError(f"{STALL_S_ENV}={text!r} is not a number of seconds above 0; it is how long a "
                               f"download may get fewer than {STALL_MIN_BYTES // 1024} KiB before it is given up")
    return seconds


class ModelSource:
    def __init__(self, model: str, is_local: bool, revision: str | None = None, cache_dir: Path | None = None):
        self.model, self.is_local, self.revision, self.cache_dir = model, is_local, revision, cache_dir

    def __str__(self) -> str:
        return self.model

    def _download(self, filename: str, optional: bool = False,
                  on_bytes: Callable[[int, int | None], None] | None = None) -> Path | None:
        """One file through huggingface_hub (HF cache semantics, HF_ENDPOINT and HF_HUB_OFFLINE honoured); told
        to `on_bytes` as its body comes in (bytes so far, the size).

        Returns None for an optional file the repo does not have.
        """
        from huggingface_hub import errors, hf_hub_download

        _one_line_per_hub_record()
        stall_s = stall_seconds(os.environ)
        watch = _Watch(f"{filename} of {self.model}", stall_s, on_bytes)
        bars = _guard_downloads(watch)
        # the remote "no such file" error is its own class in newer huggingface_hub releases
        not_found = tuple(c for c in (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", None))
                          if c is not None)
        try:
            return Path(hf_hub_download(self.model, filename, revision=self.revision,
                                        cache_dir=str(self.cache_dir) if self.cache_dir else None,
                                        **({} if bars is None else {"tqdm_class": bars})))
        except errors.LocalEntryNotFoundError as exc:  # offline, or the Hub unreachable, and not in the cache
            refusal = _refusal(exc.__cause__)  # or the Hub answered, refusing: that says nothing of the file
            if refusal is not None:
                raise ModelSourceError(f"cannot get {filename} of {self.model}: {refusal}") from exc
            if optional:  # a cache filled by snapshot_download or `hf download` records no absent files
                log.warning("%s of %s is not in the HF cache and the Hub could not be asked for it; going on "
                            "without it", filename, self.model)
                return None
            # the commit, once pinned: a cache may hold the repo at another (a branch's older one)
            at = "" if self.revision is None else f" at {self.revision}"
            if _hub_offline():  # asking the Hub would not help: it was not asked
                pinned = "" if self.revision is None else f" --revision {self.revision}"
                raise ModelSourceError(
                    f"cannot get {filename} of {self.model}{at}: it is not in the HF cache, and HF_HUB_OFFLINE=1 "
                    f"keeps this machine from asking the Hub ({_first_line(exc)}). Fill the cache where the Hub is "
                    f"reachable (hf download {self.model}{pinned}) and copy it here, unset HF_HUB_OFFLINE, or copy "
                    "the model directory here and give its path as model: in topology.yaml") from exc
            raise ModelSourceError(
                f"cannot get {filename} of {self.model}{at}: it is not in the HF cache and the Hub did not provide it "
                f"({_first_line(exc)}). Check this machine reaches the Hub (or set HF_ENDPOINT to a mirror; "
                "HF_HUB_OFFLINE=1 uses the cache alone), or copy the model directory here and give its path as "
                "model: in topology.yaml") from exc
        except not_found:
            if optional:
                return None
            raise NotInRepo(f"{self.model} has no {filename}") from None
        except errors.RevisionNotFoundError as exc:
            raise ModelSourceError(f"{self.model} has no revision {self.revision!r}; give a branch, tag or commit "
                                   "of the repo as revision: in topology.yaml") from exc
        except errors.GatedRepoError as exc:
            raise ModelSourceError(f"cannot get {filename} of {self.model}: the repo is gated; accept its terms on "
                                   f"its Hub page, then give this machine a token of that account ({TOKEN_HINT})"
                                   ) from exc
        except errors.RepositoryNotFoundError as exc:
            raise ModelSourceError(f"no HuggingFace repo {self.model!r} (or it is private or gated): check the id, "
                                   f"and for a private repo give this machine a token that can read it "
                                   f"({TOKEN_HINT})") from exc
        except DownloadStalled as exc:
            raise self._stalled(filename, exc, stall_s) from None
        except Exception as exc:  # an HTTP error, a broken-off body, a name the cache refuses: one line, not a trace
            if watch.stalled is not None:  # a Xet download given up for a stall ends in hf_xet's "cancelled"
                raise self._stalled(filename, watch.stalled, stall_s) from None
            refusal = _refusal(exc)
            if refusal is not None:
                raise ModelSourceError(f"cannot get {filename} of {self.model}: {refusal}") from exc
            raise ModelSourceError(f"cannot download {filename} of {self.model}: {type(exc).__name__}: "
                                   f"{_first_line(exc)}") from exc

    def _stalled(self, filename: str, exc: DownloadStalled, stall_s: float) -> ModelSourceError:
        return ModelSourceError(
            f"download of {filename} of {self.model} stalled: {exc}, under the {STALL_MIN_BYTES // 1024} KiB "
            f"it must get in {stall_s:g}s. Check this machine's link to the Hub (or the mirror in HF_ENDPOINT), "
            f"or for a slow link set {STALL_S_ENV} to a longer time")

    def config_dir(self) -> Path:
        """The directory holding config.json (downloading it if needed)."""
        if self.is_local:
            path = Path(self.model)
            if not path.is_dir():  # the head has it; a worker on another machine needs its own copy
                raise ModelSourceError(f"{path}: no such directory on this machine; a local model must be at the "
                                       "same path on every machine: copy the model directory here, then restart "
                                       "this worker (or give model: a HuggingFace repo id)")
            if not (path / "config.json").is_file():
                raise ModelSourceError(f"{path} has no config.json; is it a HuggingFace model directory?")
            return path
        log.info("resolving %s from the HuggingFace %s", self.model,
                 "cache alone (HF_HUB_OFFLINE)" if _hub_offline() else "Hub")
        try:
            path = self._download("config.json")
        except NotInRepo as exc:
            raise NotInRepo(f"{exc}: tc reads a model as transformers saves it (config.json, *.safetensors, "
                            "tokenizer.json); a repo in another layout (Mistral's params.json and consolidated "
                            "safetensors, a GGUF) needs the model's transformers-format release") from None
        assert path is not None
        # Pin the commit that config.json came from (hf_hub_download keeps a file at snapshots/<commit>/): every
        # later file of this source, and the head's workers, then come from that commit. A branch moves; asked
        # for by name, each file would come from wherever it stands at that moment, a tokenizer or the shards of
        # a newer upload under an older config.
        commit = path.parent.name
        if self.revision != commit:
            log.info("%s at %s is commit %s; every file comes from that commit", self.model,
                     self.revision or "main", commit)
            self.revision = commit
        return path.parent

    def fetch_tensors(self, names: Iterable[str], progress: FetchProgress | None = None) -> Path:
        """Make sure the shards holding `names` are present, telling `progress` of each one fetched; returns the
        model directory."""
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
            try:
                path = self._download(file, on_bytes=None if progress is None else progress(file, i, len(files)))
            except NotInRepo as exc:
                if index is not None:
                    raise NotInRepo(f"{exc}, which its {INDEX_FILE} names for tensors tc needs: the repo's upload "
                                    "is incomplete, or its index is out of date") from None
                raise NotInRepo(f"{self.model} has neither {SINGLE_FILE} nor {INDEX_FILE}: tc loads safetensors "
                                "checkpoints (a repo of pytorch_model.bin files needs converting to safetensors)"
                                ) from None
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
                try:
                    self._download(file, optional=file not in REQUIRED_TOKENIZER_FILES)
                except NotInRepo as exc:  # a repo with only a slow tokenizer (tokenizer.model, vocab files)
                    raise NotInRepo(f"{exc}: tc reads the fast tokenizer's {file}; save one with transformers "
                                    f"(AutoTokenizer.from_pretrained({self.model!r}).save_pretrained(DIR), with the "
                                    "model's other files in DIR) and give DIR as model: in topology.yaml, or use a "
                                    "repo that has it") from None
        return root


class _Watch:
    """One file's download as tc watches it, on either of huggingface_hub's paths: the stall rule's time, the file
    for the progress lines, who is told of its bytes, and what gave it up."""

    def __init__(self, what: str, stall_s: float, on_bytes: Callable[[int, int | None], None] | None = None):
        self.what, self.stall_s, self.on_bytes = what, stall_s, on_bytes
        self.bodies = 0  # its response bodies that the HTTP hook is passing on now
        self.stalled: DownloadStalled | None = None  # set where the Xet watchdog gave it up

    def log_progress(self, done: int, size: int | None, seconds: float, fetched: int | None = None) -> None:
        """`done` bytes of `size`, `fetched` of them (all, where not given) in `seconds`."""
        log.info("fetching %s: %.1f of %s MB, %.2f MB/s", self.what, done / 1e6,
                 "?" if size is None else f"{size / 1e6:.1f}", (done if fetched is None else fetched) / 1e6 / seconds)


class _StallHook:
    """A response hook of huggingface_hub's HTTP client that holds each response body to the stall rule."""

    def __init__(self) -> None:
        # the download each thread is at, set by each downloading thread for itself (a worker's compute thread of a
        # session that ended may still be downloading beside the next's); the client runs its hooks on the thread
        # that sends the request
        self.local = threading.local()

    def __call__(self, response) -> None:
        watch = getattr(self.local, "watch", None)
        if watch is None:  # a request of another thread: a Hub API call
            watch = _Watch(str(response.request.url), DEFAULT_STALL_S)
        # the httpx package the client is built on (httpx, or httpx2 for huggingface_hub 2), for its stream class
        package = sys.modules[type(response).__module__.partition(".")[0]]
        size, offset = _body_span(response.headers)
        response.stream = _stall_guarded_stream(package.SyncByteStream)(response.stream, watch, size, offset)


def _body_span(headers) -> tuple[int | None, int]:
    """The whole file's size (None where the answer gives none) and where a response's body starts in it. A
    download resumed after a break (from the bytes the cache kept) is answered 206 with a Content-Length of what is
    left and a Content-Range of the whole ("bytes 1000-4999/5000"): the progress told is of the whole file."""
    whole = re.fullmatch(r"bytes (\d+)-\d+/(\d+)", headers.get("Content-Range", "").strip(), re.IGNORECASE)
    if whole:
        return int(whole[2]), int(whole[1])
    length = headers.get("Content-Length", "")
    return (int(length) if length.isdigit() else None), 0


@functools.cache
def _stall_guarded_stream(base: type) -> type:
    """A subclass of httpx's SyncByteStream (`base`) that passes on a body, logging how far it has come every
    PROGRESS_EVERY_S (and telling the watch's on_bytes of every chunk, where given), and raising DownloadStalled
    where it gets fewer than STALL_MIN_BYTES in the rule's time. A chunk comes in at least every
    HF_HUB_DOWNLOAD_TIMEOUT (else the read times out), so a stall is found within twice the rule's time and that
    timeout."""

    class StallGuardedStream(base):
        def __init__(self, stream, watch: _Watch, size: int | None, offset: int = 0):
            self.stream, self.watch, self.size, self.offset = stream, watch, size, offset
            self.open = True
            watch.bodies += 1

        def __iter__(self) -> Iterator[bytes]:
            started = since = logged = time.monotonic()
            received, done = 0, self.offset  # done: of the whole file, a resumed body's first byte at its offset
            for chunk in self.stream:
                received += len(chunk)
                done += len(chunk)
                if self.watch.on_bytes is not None:
                    self.watch.on_bytes(done, self.size)
                now = time.monotonic()
                if now - logged >= PROGRESS_EVERY_S:
                    logged = now
                    self.watch.log_progress(done, self.size, now - started, done - self.offset)
                if now - since >= self.watch.stall_s:
                    if received < STALL_MIN_BYTES:
                        raise DownloadStalled(received, now - since)
                    since, received = now, 0
                yield chunk

        def close(self) -> None:
            if self.open:
                self.open = False
                self.watch.bodies -= 1
            self.stream.close()

    return StallGuardedStream


@functools.cache
def _xet_watched_bar(base: type) -> type:
    """A subclass of huggingface_hub's progress bar (`base`) that watches a download the HTTP hook cannot see: one
    hf_xet fetches with a client of its own, for a file of a Xet-backed repo. huggingface_hub tells such a bar of the
    file's bytes written (`update`) and, as the class has `update_transfer`, of the bytes fetched for them on the
    same bar, every fraction of a second from a thread of hf_xet's. The bar logs progress lines and tells the watch's
    on_bytes as the stream does, and a watchdog thread holds the download to the stall rule.

    huggingface_hub makes its bars itself, from a class: each download gets a subclass of this naming its _Watch
    (`_guard_downloads`). The bar of a file fetched over HTTP only shows itself: the hook counts those bytes as they
    come in, where the bar hears of them 10 MB at a time."""

    class XetWatchedBar(base):
        watch: _Watch
        # tqdm starts a monitor thread for a bar class that has none and never ends it: with a class for each
        # download, that was a thread (holding the download's watch) for every file fetched. It only refreshes
        # bars that print, which these need not.
        monitor_interval = 0

        def __init__(self, *args, **kwargs):
            self.written = self.received = 0  # the file's bytes on disk; the bytes fetched for them
            self.size = kwargs.get("total")
            self.started = self.logged = time.monotonic()
            self.finished = threading.Event()
            # huggingface_hub makes the bar of an HTTP download once the body's response has come, on this thread
            self.counting = self.watch.bodies == 0
            super().__init__(*args, **kwargs)
            if self.counting:
                self._report()  # 0 of the file's size, in place of the hook's count of the Xet token's answer
                threading.Thread(target=self._watchdog, name=f"stall watchdog of {self.watch.what}",
                                 daemon=True).start()

        def update(self, n=1):
            if self.counting:
                self.written += n
                self._report()
            return super().update(n)

        def update_transfer(self, n: int) -> None:
            if self.counting:
                self.received += n
                self._report()

        def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            pass  # the transfer's rate, which the progress lines give

        def close(self) -> None:
            self.finished.set()
            super().close()

        def _report(self) -> None:
            # the bytes fetched run ahead of those written; fetched, they may be compressed or carry chunk headers
            done = max(self.written, self.received)
            done = done if self.size is None else min(done, self.size)
            if self.watch.on_bytes is not None:
                self.watch.on_bytes(done, self.size)
            now = time.monotonic()
            if now - self.logged >= PROGRESS_EVERY_S:
                self.logged = now
                self.watch.log_progress(done, self.size, now - self.started)

        def _watchdog(self) -> None:
            """Give the download up where it moves fewer than STALL_MIN_BYTES in the rule's time. Nothing raised in a
            bar ends it (hf_xet prints the exception and goes on), nor does hf_xet's read timeout while a byte comes
            now and then: only an abort of hf_xet's session does."""
            moved, since = 0, time.monotonic()
            while not self.finished.wait(self.watch.stall_s):
                now, moving = time.monotonic(), self.written + self.received
                if moving - moved < STALL_MIN_BYTES:
                    _give_up_xet(self.watch, DownloadStalled(moving - moved, now - since))
                    return
                moved, since = moving, now

    return XetWatchedBar


def _give_up_xet(watch: _Watch, stalled: DownloadStalled) -> None:
    """End the stalled Xet download of `watch`. hf_xet gives huggingface_hub's callers no handle on one download,
    only an abort of its session, which ends every Xet download of this process: one beside this fails (it said it
    was cancelled), and the next download starts a session anew."""
    try:
        from huggingface_hub.utils._xet import abort_xet_session
    except ImportError:  # a huggingface_hub with no session of hf_xet's to abort
        log.warning("download of %s stalled (%s), under the %d KiB it must get in %gs, but this huggingface_hub "
                    "cannot stop a Xet download; stop tc and check this machine's link to the Hub, or upgrade "
                    "with: python -m pip install -U huggingface_hub", watch.what, stalled, STALL_MIN_BYTES // 1024,
                    watch.stall_s)
        return
    watch.stalled = stalled
    abort_xet_session()


def _guard_downloads(watch: _Watch) -> type | None:
    """Hold huggingface_hub's download of `watch`'s file to the stall rule, with progress lines (and told to its
    on_bytes), on both of huggingface_hub's paths. Returns the progress bar class to give hf_hub_download as its
    tqdm_class, which watches a Xet download (None where it takes none).

    A file fetched over HTTP is watched by a hook on its shared HTTP client, which it makes anew after a fork or
    close_session(), so this looks again before each download. A file of a Xet-backed repo (with hf_xet installed)
    is fetched by hf_xet's own client, which no hook reaches: its progress bar watches it."""
    from huggingface_hub import get_session
    from huggingface_hub.utils import tqdm

    session = get_session()
    hooks = getattr(session, "event_hooks", None)
    if hooks is None:
        _warn_unguarded()
        return None
    hook = next((h for h in hooks["response"] if isinstance(h, _StallHook)), None)
    if hook is None:
        hook = _StallHook()
        session.event_hooks = {**hooks, "response": [*hooks["response"], hook]}
    hook.local.watch = watch
    if not _takes_tqdm_class():
        _warn_xet_unwatched()
        return None
    return type("XetWatchedBar", (_xet_watched_bar(tqdm),), {"watch": watch})


@functools.cache
def _takes_tqdm_class() -> bool:
    from huggingface_hub import hf_hub_download

    return "tqdm_class" in inspect.signature(hf_hub_download).parameters


@functools.cache
def _warn_unguarded() -> None:
    log.warning("huggingface_hub before 1.0 downloads through requests, whose reads tc cannot watch: a download "
                "that stalls is not given up (upgrade with: python -m pip install 'huggingface_hub>=1.0')")


@functools.cache
def _warn_xet_unwatched() -> None:
    log.warning("this huggingface_hub takes no progress bar class for a download, so tc cannot watch one of a "
                "Xet-backed repo: no progress lines, and a download that stalls is not given up (upgrade with: "
                "python -m pip install -U huggingface_hub)")


def _refusal(exc: BaseException | None) -> str | None:
    """What the Hub answered and what to do, for an HTTP error status of its own; None for any other error."""
    from huggingface_hub.errors import HfHubHTTPError

    if not isinstance(exc, HfHubHTTPError) or exc.response is None:
        return None
    status = exc.response.status_code
    if status in (401, 403):
        return f"the Hub refused it ({status}); give this machine a token that can read the repo ({TOKEN_HINT})"
    if status == 429:
        return ("the Hub is limiting this machine's requests (429 Too Many Requests); wait a few minutes and start "
                f"again, or give it a token, which gets a higher limit ({TOKEN_HINT})")
    if status >= 500:
        return f"the Hub failed ({status}); try again later, or set HF_ENDPOINT to a mirror"
    return None


def _first_line(exc: BaseException) -> str:
    """An exception's message, its first line only (huggingface_hub's run to several, with URLs)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
