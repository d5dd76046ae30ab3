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
"""
from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROUTE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")


class HubStandIn:
    def __init__(self, repos: dict[str, Path], revisions: set[str] | None = None, trickle: set[str] = frozenset(),
                 trickle_s: float = 0.05, refuse: dict[str, tuple[int, str | None]] | None = None,
                 snapshots: dict[str, Path] | None = None, branches: dict[str, str] | None = None,
                 hold: set[str] = frozenset()):
        self.repos = repos
        self.snapshots = snapshots or {}  # commit -> the repo's files at it (for every repo)
        self.branches = branches or {}  # branch -> the commit it is at, in `snapshots`
        self.refuse = refuse or {}  # file name -> (status, X-Error-Code or None)
        self.revisions = revisions  # the revisions it knows (None: any); another is the Hub's RevisionNotFound
        self.trickle, self.trickle_s = trickle, trickle_s
        self.hold = hold
        self.holding = threading.Event()  # a held file's first half is sent
        self.release = threading.Event()  # sends the rest of a held file (or, with `cut`, closes it unsent)
        self.cut = False
        self.closed = threading.Event()  # ends the trickles, whose handler threads would otherwise run on
        self.requests: list[tuple[str, str]] = []  # (method, path)
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
                match = ROUTE.match(self.path.split("?", 1)[0])
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
                start, end = 0, size - 1
                ranged = self.headers.get("Range")
                if ranged:
                    m = re.match(r"bytes=(\d+)-(\d*)", ranged)
                    start, end = int(m[1]), int(m[2]) if m[2] else size - 1
                self.send_response(206 if ranged else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hub.etag(path)}"')
                self.send_header("Content-Length", str(end - start + 1))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if with_body and match["filename"] in hub.hold and not hub.release.is_set():
                    with open(path, "rb") as f:
                        f.seek(start)
                        self.wfile.write(f.read((end - start + 1) // 2))
                        self.wfile.flush()
                        hub.holding.set()
                        hub.release.wait()  # closing the stand-in sets it too
                        if not hub.cut and not hub.closed.is_set():
                            self.wfile.write(f.read(end + 1 - f.tell()))
                elif with_body and match["filename"] in hub.trickle:
                    with open(path, "rb") as f:
                        f.seek(start)
                        for _ in range(end - start + 1):
                            if hub.closed.wait(hub.trickle_s):
                                return
                            try:
                                self.wfile.write(f.read(1))
                                self.wfile.flush()
                            except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
                                return
                elif with_body:
                    with open(path, "rb") as f:
                        f.seek(start)
                        remaining = end - start + 1
                        while remaining:
                            block = f.read(min(remaining, 1 << 20))
                            self.wfile.write(block)
                            remaining -= len(block)

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
