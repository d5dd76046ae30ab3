"""Fetching a model from a HuggingFace repo (tc/model_source.py) against a local stand-in for the Hub's routes:
what goes wrong there is one line that says what to do, never a traceback, and a cache filled by other tools
serves offline."""
from __future__ import annotations

import importlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hub_standin import COMMIT, HubStandIn, needs_hf_xet
from tc.model_source import ModelSource, ModelSourceError
from tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
REPO = "acme/tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny", seed=3, shards=2)


@pytest.fixture
def hub_env(monkeypatch):
    """Point huggingface_hub at a stand-in for this test: HF_ENDPOINT is read when a download starts."""
    def point(hub: HubStandIn) -> None:
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    return point


def test_an_unknown_revision_names_the_topology_key(tmp_path, model_dir, hub_env):
    with HubStandIn({REPO: model_dir}, revisions={"main", COMMIT}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError) as info:
            ModelSource(REPO, is_local=False, revision="no-such-branch", cache_dir=tmp_path / "cache").config_dir()
    message = str(info.value)
    assert "has no revision 'no-such-branch'" in message and "revision: in topology.yaml" in message
    assert "\n" not in message


@pytest.mark.parametrize("index", ["not json", "[1, 2]", '{"metadata": {}}', '{"weight_map": [1]}',
                                   '{"weight_map": {"model.embed_tokens.weight": 5}}'])
def test_a_malformed_shard_index_is_one_line_naming_it(tmp_path, model_dir, hub_env, index):
    repo = tmp_path / "repo"
    shutil.copytree(model_dir, repo)
    (repo / "model.safetensors.index.json").write_text(index)
    with HubStandIn({REPO: repo}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError, match="model.safetensors.index.json of acme/tiny is malformed"):
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
                ["model.embed_tokens.weight"])


def test_a_cache_without_records_of_absent_files_serves_offline(tmp_path, model_dir, hub_env):
    """snapshot_download and `hf download` fill a cache without the records of files a repo lacks (the optional
    tokenizer files, here the chat template files): offline, those are gone without a word, where the head
    refused a complete cached model."""
    cache = tmp_path / "cache"
    with HubStandIn({REPO: model_dir}) as hub:
        hub_env(hub)
        source = ModelSource(REPO, is_local=False, cache_dir=cache)
        source.fetch_tokenizer()
        source.fetch_tensors(["model.embed_tokens.weight", "lm_head.weight"])
    for marker in cache.glob("models--acme--tiny/.no_exist"):
        shutil.rmtree(marker)
    script = ("import sys; from tc.model_source import ModelSource; "
              f"print(ModelSource({REPO!r}, is_local=False, cache_dir=sys.argv[1]).fetch_tokenizer())")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "tokenizer.json").is_file()
    assert "is not in the HF cache and the Hub could not be asked for it" in done.stderr
    # a required file missing from the cache is still an error that says what to do
    for blob in cache.glob("models--acme--tiny/snapshots/*/tokenizer.json"):
        blob.unlink()
    done = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode != 0 and "cannot get tokenizer.json of acme/tiny" in done.stderr
    # offline, the Hub was not asked: the fix is the cache or the setting, not the link
    assert "it is not in the HF cache, and HF_HUB_OFFLINE=1 keeps this machine from asking the Hub" in done.stderr


def test_the_hub_s_warnings_print_once_under_tc_s_logging():
    """huggingface_hub's loggers print to stderr themselves and pass their records on to the root's handler,
    where tc's logging prints them again: under a root handler its own stderr handler goes, and only that."""
    from tc import model_source

    importlib.import_module("huggingface_hub")  # its logging module gives the library's logger that handler
    hub = logging.getLogger("huggingface_hub")
    kept, root = list(hub.handlers), logging.getLogger()
    own = logging.StreamHandler(sys.stderr)
    mine = logging.StreamHandler(io.StringIO())  # not stderr: someone else's, left alone
    root_handler = logging.NullHandler()
    try:
        hub.handlers[:] = [own, mine]
        root.addHandler(root_handler)
        model_source._one_line_per_hub_record()
        assert hub.handlers == [mine]
    finally:
        hub.handlers[:] = kept
        root.removeHandler(root_handler)


def test_a_download_trickling_below_the_stall_rule_stops_naming_the_file_and_the_setting(tmp_path, model_dir):
    """A link that stays alive but all but stalled (here one byte every 50 ms) passes every per-read timeout: the
    download must still end, with one line that names the file and the setting to change."""
    shard = "model-00001-of-00002.safetensors"
    script = ("import sys; from tc.model_source import ModelSource; "
              f"ModelSource({REPO!r}, is_local=False, cache_dir=sys.argv[1])"
              ".fetch_tensors(['model.embed_tokens.weight'])")
    with HubStandIn({REPO: model_dir}, trickle={shard}) as hub:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
               "TC_DOWNLOAD_STALL_S": "1"}
        try:
            done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], capture_output=True,
                                  text=True, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a download sent one byte every {hub.trickle_s}s ran on past the stall rule")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"{shard} of {REPO}" in last and "TC_DOWNLOAD_STALL_S" in last, done.stderr


@pytest.mark.parametrize("status, code, says", [
    (429, None, ["429", "wait", "HF_TOKEN"]),
    (403, "GatedRepo", ["gated", "accept its terms", "HF_TOKEN"]),
    (401, "RepoNotFound", ["no HuggingFace repo 'acme/tiny'", "HF_TOKEN"]),
    (401, None, ["401", "HF_TOKEN"]),
    (503, None, ["503", "try again later"]),
])
def test_a_refusal_from_the_hub_says_what_it_answered_and_what_to_do(tmp_path, model_dir, hub_env, status, code,
                                                                     says):
    """The Hub answered (a rate limit, a gated or private repo, its own failure): the operator reads that answer
    and what to do about it, not advice to check the connection, nor an HTTP library's line with a URL."""
    shard = "model-00001-of-00002.safetensors"
    with HubStandIn({REPO: model_dir}, refuse={shard: (status, code)}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError) as info:
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
                ["model.embed_tokens.weight"])
    message = str(info.value)
    assert REPO in message and "\n" not in message and "http://" not in message, message
    assert code == "RepoNotFound" or shard in message, message  # a repo not found is not about one file
    assert "reaches the Hub" not in message, message
    for word in says:
        assert word in message, message


def test_an_optional_file_the_hub_refused_is_not_taken_for_absent(tmp_path, model_dir, hub_env):
    """tokenizer_config.json holds the chat template: a rate limit on it must stop the start, not have the head
    serve chats without their template."""
    with HubStandIn({REPO: model_dir}, refuse={"tokenizer_config.json": (429, None)}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError, match="cannot get tokenizer_config.json of acme/tiny: .*429"):
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tokenizer()


def test_every_file_comes_from_the_commit_config_json_came_from(tmp_path, model_dir, hub_env):
    """An upload moves the branch while the head starts: its shards and tokenizer must still be those of the
    commit its config.json is, not the newer upload's under the older config."""
    newer = write_tiny_model(tmp_path / "newer", seed=4, shards=2)
    old, new = "a" * 40, "b" * 40
    shard = "model-00001-of-00002.safetensors"
    with HubStandIn({REPO: model_dir}, snapshots={old: model_dir, new: newer}, branches={"main": old}) as hub:
        hub_env(hub)
        source = ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache")
        config_dir = source.config_dir()
        hub.branches["main"] = new
        root = source.fetch_tensors(["model.embed_tokens.weight"])
        tokenizer_root = source.fetch_tokenizer()
    assert config_dir.name == old and root == config_dir and tokenizer_root == config_dir
    assert (root / shard).read_bytes() == (model_dir / shard).read_bytes()
    assert source.revision == old
    assert not [path for method, path in hub.requests if f"/resolve/{new}/" in path]


def test_a_commit_missing_from_an_offline_cache_is_named(tmp_path, model_dir, hub_env):
    """A worker offline is sent the head's commit; its cache holds the branch at an older one. "Not in the HF
    cache" alone reads as wrong to whoever sees the model there: the message names the commit it looked for."""
    cache = tmp_path / "cache"
    with HubStandIn({REPO: model_dir}) as hub:
        hub_env(hub)
        ModelSource(REPO, is_local=False, cache_dir=cache).fetch_tensors(["model.embed_tokens.weight"])
    newer = "c" * 40
    script = ("import sys; from tc.model_source import ModelSource; "
              f"ModelSource({REPO!r}, is_local=False, revision={newer!r}, cache_dir=sys.argv[1])"
              ".fetch_tensors(['model.embed_tokens.weight'])")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode != 0 and f"cannot get config.json of {REPO} at {newer}: " in done.stderr, done.stderr


def test_a_long_download_says_how_far_it_has_come(tmp_path, model_dir, hub_env, monkeypatch, caplog):
    """Between "fetching" and "have", a shard of gigabytes took minutes without a line: the log must show it
    moving (here every 0.2s of a download that trickles until the stall rule ends it)."""
    from tc import model_source

    monkeypatch.setattr(model_source, "PROGRESS_EVERY_S", 0.2, raising=False)
    monkeypatch.setenv("TC_DOWNLOAD_STALL_S", "2")
    shard = "model-00001-of-00002.safetensors"
    size = (model_dir / shard).stat().st_size
    with HubStandIn({REPO: model_dir}, trickle={shard}) as hub:
        hub_env(hub)
        with caplog.at_level("INFO", logger="tc.model_source"), pytest.raises(ModelSourceError, match="stalled"):
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
                ["model.embed_tokens.weight"])
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"fetching {shard} of {REPO}:")]
    assert progress and f"of {size / 1e6:.1f} MB" in progress[0], caplog.text


def test_fetch_tensors_tells_each_shard_it_fetches_and_its_bytes(tmp_path, model_dir, hub_env):
    """What the head's API reports while the head downloads: each shard with its number, then its bytes as they
    come in, up to the size the Hub gave."""
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    told: list[list] = []

    def progress(file: str, number: int, files: int):
        told.append([file, number, files, None, None])
        return lambda done, size: told[-1].__setitem__(slice(3, 5), [done, size])

    with HubStandIn({REPO: model_dir}) as hub:
        hub_env(hub)
        ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(list(weight_map), progress)
    shards = sorted(set(weight_map.values()))
    sizes = [(model_dir / shard).stat().st_size for shard in shards]
    assert told == [[shard, i, len(shards), size, size] for i, (shard, size) in enumerate(zip(shards, sizes), 1)]


def test_a_download_resumed_after_a_break_tells_the_whole_files_bytes(tmp_path, model_dir, hub_env, monkeypatch):
    """The link breaks off half way; huggingface_hub asks for the rest from the last chunk it wrote (a Range
    request, answered 206 with a Content-Length of what is left): the progress told stays of the whole file."""
    from huggingface_hub import constants

    chunk = 1024  # the bytes huggingface_hub writes at a time, and so resumes from (10 MB unless set)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", chunk)
    shard = "model-00001-of-00002.safetensors"
    size = (model_dir / shard).stat().st_size
    told: list[tuple[int, int | None]] = []
    with HubStandIn({REPO: model_dir}, hold={shard}) as hub:
        hub_env(hub)
        hub.cut = True

        def break_off() -> None:
            if hub.holding.wait(30):
                time.sleep(0.2)  # the half sent is read, and told
                hub.release.set()

        breaker = threading.Thread(target=break_off)
        breaker.start()
        ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
            ["model.embed_tokens.weight"], lambda file, number, files: lambda done, whole: told.append((done, whole)))
        breaker.join()
    ranges = [range_ for path, range_ in hub.ranges if path.endswith(shard)]
    assert len(ranges) == 1 and ranges[0] == f"bytes={size // 2 // chunk * chunk}-", ranges
    assert told[-1] == (size, size) and {whole for _, whole in told} == {size}
    dones = [done for done, _ in told]
    assert any(0 < done <= size // 2 for done in dones)  # the half before the break
    assert all(later >= earlier - chunk for earlier, later in zip(dones, dones[1:]))  # not from 0 again


@pytest.mark.parametrize("layout, says", [
    ("bin only", "has neither model.safetensors nor model.safetensors.index.json: tc loads safetensors"),
    ("shard missing", "has no model-00001-of-00002.safetensors, which its model.safetensors.index.json names"),
])
def test_a_repo_without_the_safetensors_tc_needs_says_what_is_wrong(tmp_path, model_dir, hub_env, layout, says):
    """"acme/tiny has no model.safetensors" of a repo of pytorch_model.bin files, or of a repo whose index names a
    shard it lacks, left the operator to guess why tc asked for that file at all."""
    repo = tmp_path / "repo"
    shutil.copytree(model_dir, repo)
    if layout == "bin only":  # an older repo: its weights in torch's own format alone
        for path in repo.glob("model*.safetensors*"):
            path.unlink()
        (repo / "pytorch_model.bin").write_bytes(b"weights tc does not read")
    else:
        (repo / "model-00001-of-00002.safetensors").unlink()
    with HubStandIn({REPO: repo}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError) as info:
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(
                ["model.embed_tokens.weight"])
    assert says in str(info.value), str(info.value)


@needs_hf_xet
def test_a_xet_backed_shard_comes_whole_and_tells_its_bytes(tmp_path, model_dir, hub_env, monkeypatch):
    """Nearly every model repo on the Hub is Xet-backed: hf_xet fetches its files with a client of its own, past the
    hook that counts a body's bytes over HTTP. The head's API must still hear each shard's bytes up to its size."""
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet"))  # hf_xet's staging (and a first session's logs)
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    told: list[list] = []

    def progress(file: str, number: int, files: int):
        told.append([file, number, files, None, None])
        return lambda done, size: told[-1].__setitem__(slice(3, 5), [done, size])

    with HubStandIn({REPO: model_dir}, xet=set(shards)) as hub:
        hub_env(hub)
        root = ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(list(weight_map),
                                                                                             progress)
    assert hub.fetched_over_xet() == set(shards) and not hub.fetched_files() & set(shards)
    sizes = [(model_dir / shard).stat().st_size for shard in shards]
    assert told == [[shard, i, len(shards), size, size] for i, (shard, size) in enumerate(zip(shards, sizes), 1)]
    for shard in shards:
        assert (root / shard).read_bytes() == (model_dir / shard).read_bytes()


@needs_hf_xet
def test_a_xet_download_trickling_below_the_stall_rule_says_how_far_it_came_then_stops(tmp_path, model_dir):
    """hf_xet's client ends on no read timeout while a byte comes now and then, and on no exception of tc's: a Xet
    download that all but stalls must still log its progress, then end with the line that names the file and the
    setting, as one over HTTP does."""
    shard = "model-00001-of-00002.safetensors"
    script = ("import logging, sys; from tc import model_source; logging.basicConfig(level=logging.INFO); "
              "model_source.PROGRESS_EVERY_S = 0.2; "
              f"model_source.ModelSource({REPO!r}, is_local=False, cache_dir=sys.argv[1])"
              ".fetch_tensors(['model.embed_tokens.weight'])")
    with HubStandIn({REPO: model_dir}, xet={shard}, trickle={shard}) as hub:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_XET_CACHE": str(tmp_path / "xet"), "TC_DOWNLOAD_STALL_S": "2"}
        try:
            done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], capture_output=True,
                                  text=True, env=env, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a Xet download sent one byte every {hub.trickle_s}s ran on past the stall rule")
        assert hub.fetched_over_xet() == {shard}
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"download of {shard} of {REPO} stalled" in last and "TC_DOWNLOAD_STALL_S" in last, done.stderr
    size = (model_dir / shard).stat().st_size
    assert f"fetching {shard} of {REPO}: 0.0 of {size / 1e6:.1f} MB" in done.stderr, done.stderr


@pytest.mark.parametrize("xet", [False, pytest.param(True, marks=needs_hf_xet)], ids=["http", "xet"])
def test_downloads_leave_no_thread_behind(tmp_path, model_dir, hub_env, monkeypatch, xet):
    """Each download hands huggingface_hub a bar class of its own (naming its watch); tqdm starts a monitor thread
    for a bar class that has none and never ends it, so a class of each download's own must not start one: a
    process that fetched a model's files would keep a thread (and the download's watch) for every one of them."""
    from huggingface_hub.utils import tqdm
    from tqdm._monitor import TMonitor

    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet"))
    monkeypatch.setattr(tqdm, "monitor", None)  # as in a process whose bars have not started tqdm's own monitor yet
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = set(weight_map.values())

    def monitors() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if isinstance(t, TMonitor)}

    before = monitors()
    with HubStandIn({REPO: model_dir}, xet=shards if xet else set()) as hub:
        hub_env(hub)
        ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tensors(list(weight_map))
    assert (hub.fetched_over_xet() == shards) == xet
    deadline = time.monotonic() + 5  # a Xet download's stall watchdog ends as its bar closes
    while any(t.name.startswith("stall watchdog") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate() if t.name.startswith("stall watchdog")]
    assert monitors() <= before and not left, (monitors() - before, left)


def test_a_repo_without_transformers_files_says_what_tc_reads(tmp_path, model_dir, hub_env):
    """A repo without tokenizer.json (a slow tokenizer only) or config.json (Mistral's own layout) said only
    "has no ...", leaving the operator to guess what would do."""
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    no_config = tmp_path / "no-config"
    shutil.copytree(model_dir, no_config)
    (no_config / "config.json").unlink()
    with HubStandIn({REPO: no_tokenizer, "acme/mistral-layout": no_config}) as hub:
        hub_env(hub)
        with pytest.raises(ModelSourceError) as info:
            ModelSource(REPO, is_local=False, cache_dir=tmp_path / "cache").fetch_tokenizer()
        assert "acme/tiny has no tokenizer.json: tc reads the fast tokenizer's tokenizer.json" in str(info.value)
        assert "AutoTokenizer.from_pretrained('acme/tiny').save_pretrained(DIR)" in str(info.value)
        with pytest.raises(ModelSourceError) as info:
            ModelSource("acme/mistral-layout", is_local=False, cache_dir=tmp_path / "cache").config_dir()
        assert "acme/mistral-layout has no config.json: tc reads a model as transformers saves it" in str(info.value)
        assert "transformers-format release" in str(info.value)
