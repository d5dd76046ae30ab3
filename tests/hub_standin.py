"""A local stand-in for the HuggingFace Hub's file routes, so download code runs for real without the Hub.

It serves directories as repos at `/{org}/{name}/resolve/{revision}/{filename}` with the headers
huggingface_hub reads (X-Repo-Commit, ETag, Content-Length, X-Error-Code on 404s), HEAD and GET, byte ranges
included. Point huggingface_hub at it with HF_ENDPOINT. Every request is recorded, so tests can check what
was (and was not) fetched. Files named in `trickle` are sent as a link that is alive but all but stalled would
send them: one byte every `trickle_s`, until the stand-in closes. Files named in `hold` are sent half, then held
(`holding` is set) until the test sets `release`: the rest then follows, or with `cut` set the connection closes
without it, as a link that breaks off does. Files named in `refuse` get the status (and X-Error-Code, if any) given
there, as the Hub refuses a token-less, gated or too frequent request.

A repo is one commit (COMMIT) under any revision, unless `snapshots` gives directories by commit and `branches`
the commit each branch is at; a test moves a branch by setting `branches[name]`, as an upload to the repo would.

Files named in `xet` are served Xet-backed, as the Hub serves nearly every model file: their metadata carries the
X-Xet-Hash and the Link to the repo's Xet token route, which names the stand-in's own CAS routes, so huggingface_hub
with hf_xet installed has hf_xet's client fetch them there, never through the resolve route. The CAS serves each
file as one xorb built from its bytes (`xorb_of`): its reconstruction (`/cas/v2/reconstructions/{file hash}`), then
the xorb's byte ranges (`/cas/xorbs/default/{xorb hash}`), trickled or held as the file's bytes would be. hf_xet
checks neither the file's hash nor the xorb's on download, so SHA-256 digests stand in for Xet's merkle hashes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROUTE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")
XET_TOKEN_ROUTE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/xet-read-token/(?P<revision>[^/]+)$")
RECONSTRUCTION_ROUTE = re.compile(r"^/cas/v2/reconstructions/(?P<hash>[0-9a-f]{64})$")
XORB_ROUTE = re.compile(r"^/cas/xorbs/default/(?P<hash>[0-9a-f]{64})$")
XET_CHUNK = 64 * 1024  # hf_xet's target chunk size (its chunks are at most twice that)
XET_CHUNK_HEADER = 8
# for tests of what hf_xet fetches: without it, huggingface_hub fetches a Xet-backed file over its resolve route
needs_hf_xet = pytest.mark.skipif(importlib.util.find_spec("hf_xet") is None,
                                  reason="hf_xet is not installed: huggingface_hub fetches Xet-backed files over HTTP")


def chunk_header(length: int) -> bytes:
    """A xorb chunk's 8-byte header for `length` bytes stored uncompressed: format version 0, the stored length (3
    bytes, little-endian), compression scheme 0 (none), the length once uncompressed (3 bytes)."""
    size = length.to_bytes(3, "little")
    return bytes([0]) + size + bytes([0]) + size


def xorb_of(data: bytes) -> bytes:
    """A file's bytes as one xorb: its XET_CHUNK-byte chunks in order, each stored uncompressed after its header."""
    return b"".join(chunk_header(len(data[i:i + XET_CHUNK])) + data[i:i + XET_CHUNK]
                    for i in range(0, len(data), XET_CHUNK))


class HubStandIn:
    def __init__(self, repos: dict[str, Path], revisions: set[str] | None = None, trickle: set[str] = frozenset(),
                 trickle_s: float = 0.05, refuse: dict[str, tuple[int, str | None]] | None = None,
                 snapshots: dict[str, Path] | None = None, branches: dict[str, str] | None = None,
                 hold: set[str] = frozenset(), xet: set[str] = frozenset()):
        self.repos = repos
        self.snapshots = snapshots or {}  # commit -> the repo's files at it (for every repo)
        self.branches = branches or {}  # branch -> the commit it is at, in `snapshots`
        self.refuse = refuse or {}  # file name -> (status, X-Error-Code or None)
        self.revisions = revisions  # the revisions it knows (None: any); another is the Hub's RevisionNotFound
        self.trickle, self.trickle_s = trickle, trickle_s
        self.hold = hold
        self.xet = xet
        self._xet_files: dict[str, tuple[str, Path]] = {}  # Xet hash -> (file name, path), once its metadata went out
        self._xorbs: dict[str, tuple[str, bytes]] = {}  # xorb hash -> (the name of the file it holds, its bytes)
        self.holding = threading.Event()  # a held file's first half is sent
        self.release = threading.Event()  # sends the rest of a held file (or, with `cut`, closes it unsent)
        self.cut = False
        self.closed = threading.Event()  # ends the trickles, whose handler threads would otherwise run on
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of each request that named a range
        self._etags: dict[Path, str] = {}
        handler = self._handler_class()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fetched_files(self) -> set[str]:
        return {path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path}

    def fetched_over_xet(self) -> set[str]:
        """The Xet-backed files whose bytes were asked for where hf_xet asks: as their xorbs."""
        return {self._xorbs[m["hash"]][0] for method, path in self.requests if (m := XORB_ROUTE.match(path))}

    def xorb(self, filename: str) -> bytes:
        """The xorb the CAS serves a Xet-backed file's bytes in (once huggingface_hub has asked for the file)."""
        return next(data for name, data in self._xorbs.values() if name == filename)

    def reconstruction(self, file_hash: str, first: int, last: int) -> dict:
        """How to rebuild bytes [first, last] of a Xet-backed file: one term of its xorb's chunks that hold them,
        and the xorb's byte range of those chunks (hf_xet asks with Range; chunks are at fixed places here)."""
        name, path = self._xet_files[file_hash]
        data = path.read_bytes()
        xorb = xorb_of(data)
        xorb_hash = hashlib.sha256(xorb).hexdigest()
        self._xorbs[xorb_hash] = (name, xorb)
        chunks = range(first // XET_CHUNK, last // XET_CHUNK + 1)
        unpacked = len(data[chunks.start * XET_CHUNK:chunks.stop * XET_CHUNK])
        stored = XET_CHUNK + XET_CHUNK_HEADER  # each chunk's bytes in the xorb, but the last's
        span = {"start": chunks.start * stored,
                "end": chunks.start * stored + unpacked + len(chunks) * XET_CHUNK_HEADER - 1}
        return {"offset_into_first_range": first - chunks.start * XET_CHUNK,
                "terms": [{"hash": xorb_hash, "unpacked_length": unpacked,
                           "range": {"start": chunks.start, "end": chunks.stop}}],
                "xorbs": {xorb_hash: [{"url": f"{self.url}/cas/xorbs/default/{xorb_hash}",
                                       "ranges": [{"chunks": {"start": chunks.start, "end": chunks.stop},
                                                   "bytes": span}]}]}}

    def resolve(self, repo: str, revision: str) -> tuple[str, Path]:
        """The commit a revision names, and the directory of the repo's files at it."""
        commit = self.branches.get(revision, revision)
        if commit in self.snapshots:
            return commit, self.snapshots[commit]
        return COMMIT, self.repos[repo]

    def etag(self, path: Path) -> str:
        if path not in self._etags:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            self._etags[path] = digest.hexdigest()
        return self._etags[path]

    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _not_found(self, code: str) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve(self, with_body: bool) -> None:
                hub.requests.append((self.command, self.path))
                if self.headers.get("Range"):
                    hub.ranges.append((self.path, self.headers["Range"]))
                route = self.path.split("?", 1)[0]
                for pattern, serve in ((XET_TOKEN_ROUTE, self._xet_token), (RECONSTRUCTION_ROUTE, self._reconstruction),
                                       (XORB_ROUTE, self._xorb)):
                    if match := pattern.match(route):
                        return serve(match, with_body)
                match = ROUTE.match(route)
                if match is None or match["repo"] not in hub.repos:
                    return self._not_found("RepoNotFound")
                if hub.revisions is not None and match["revision"] not in hub.revisions:
                    return self._not_found("RevisionNotFound")
                if match["filename"] in hub.refuse:
                    status, code = hub.refuse[match["filename"]]
                    self.send_response(status)
                    if code is not None:
                        self.send_header("X-Error-Code", code)
                    self.send_header("Retry-After", "0")  # huggingface_hub retries some: at once, for the tests
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                commit, root = hub.resolve(match["repo"], match["revision"])
                path = root / match["filename"]
                if not path.is_file():
                    return self._not_found("EntryNotFound")
                size = path.stat().st_size
                start, end = self._range(size)
                self.send_response(206 if self.headers.get("Range") else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hub.etag(path)}"')
                if match["filename"] in hub.xet:  # what makes huggingface_hub have hf_xet fetch it
                    hub._xet_files[hub.etag(path)] = (match["filename"], path)
                    self.send_header("X-Xet-Hash", hub.etag(path))
                    self.send_header("Link", f'<{hub.url}/api/models/{match["repo"]}/xet-read-token/{commit}>; '
                                             'rel="xet-auth"')
                self.send_header("Content-Length", str(end - start + 1))
                if self.headers.get("Range"):
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if with_body:
                    with open(path, "rb") as f:
                        self._send_body(match["filename"], f, start, end)

            def _range(self, size: int) -> tuple[int, int]:
                """The first and last byte a request's Range asks for (the whole `size` bytes without one)."""
                m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                return (0, size - 1) if m is None else (int(m[1]), int(m[2]) if m[2] else size - 1)

            def _send_body(self, filename: str, f, start: int, end: int) -> None:
                """Bytes [start, end] of `f`, for `filename`: held half sent, trickled, or all at once."""
                f.seek(start)
                if filename in hub.hold and not hub.release.is_set():
                    self.wfile.write(f.read((end - start + 1) // 2))
                    self.wfile.flush()
                    hub.holding.set()
                    hub.release.wait()  # closing the stand-in sets it too
                    if not hub.cut and not hub.closed.is_set():
                        self.wfile.write(f.read(end + 1 - f.tell()))
                elif filename in hub.trickle:
                    for _ in range(end - start + 1):
                        if hub.closed.wait(hub.trickle_s):
                            return
                        try:
                            self.wfile.write(f.read(1))
                            self.wfile.flush()
                        except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
                            return
                else:
                    remaining = end - start + 1
                    while remaining:
                        block = f.read(min(remaining, 1 << 20))
                        self.wfile.write(block)
                        remaining -= len(block)

            def _json(self, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _xet_token(self, match: re.Match, with_body: bool) -> None:
                """A read token for the repo's Xet storage, and where that is: the stand-in's own CAS routes."""
                expires = int(time.time()) + 3600
                cas = f"{hub.url}/cas"
                self._json({"casUrl": cas, "accessToken": "xet-read", "exp": expires},
                           {"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": "xet-read",
                            "X-Xet-Token-Expiration": str(expires)})

            def _reconstruction(self, match: re.Match, with_body: bool) -> None:
                if match["hash"] not in hub._xet_files:
                    return self._not_found("EntryNotFound")
                size = hub._xet_files[match["hash"]][1].stat().st_size
                self._json(hub.reconstruction(match["hash"], *self._range(size)))

            def _xorb(self, match: re.Match, with_body: bool) -> None:
                if match["hash"] not in hub._xorbs:
                    return self._not_found("EntryNotFound")
                filename, xorb = hub._xorbs[match["hash"]]
                start, end = self._range(len(xorb))
                self.send_response(206)
                self.send_header("Content-Length", str(end - start + 1))
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(xorb)}")
                self.end_headers()
                if with_body:
                    self._send_body(filename, io.BytesIO(xorb), start, end)

            def do_HEAD(self):
                self._serve(with_body=False)

            def do_GET(self):
                self._serve(with_body=True)

        return Handler

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closed.set()
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
