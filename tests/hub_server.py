"""A small HuggingFace Hub on 127.0.0.1, for the real huggingface_hub client (HF_ENDPOINT points at it).

It answers what huggingface_hub calls, as huggingface.co does:
- GET /api/models/ORG/REPO[/revision/REV]?blobs=True: the model info, with `sha` (the commit) and
  `siblings` (rfilename, size, blobId, and lfs {sha256, size, pointerSize} for LFS files);
- HEAD/GET /ORG/REPO/resolve/REV/FILE: a plain file with ETag = its git blob id; an LFS file (weights)
  as a 302 to the "CDN" (a second server, so another origin) with X-Linked-Etag = its sha256 and
  X-Linked-Size; X-Repo-Commit on both;
- ranged GETs (`Range: bytes=N-`, answered 206 with Content-Range), on both servers;
- errors with the hub's X-Error-Code: RepoNotFound (404), RevisionNotFound, EntryNotFound, and GatedRepo
  (401 without a token, 403 with one that has no access).
Faults a test switches on: `drop_once` (a file's first GET stops halfway and the connection closes),
`corrupt` (a file is served with one byte changed, its listed checksums unchanged), `slow` (a file's
body trickles out), `hold` (a file's body waits halfway for a second client), `fail` (500 for a file). `log` records every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: content}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    token: str | None
    server: str  # "hub" or "cdn"


class HubServer:
    GOOD_TOKEN = "hf_test_token_with_access"

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> content (the CDN's store)
        self.log: list[Request] = []
        self.drop_once: set[str] = set()  # file names
        self.corrupt: set[str] = set()
        self.slow: dict[str, float] = {}  # file name -> seconds between 4 KiB pieces
        self.fail: set[str] = set()
        # file name -> n: its body stops halfway until n clients have asked for it (HEAD), so that two
        # downloads of it overlap; `held` records the files released so (not by the 60 s timeout).
        self.hold: dict[str, int] = {}
        self.held: set[str] = set()
        self._lock = threading.Lock()
        self._servers: list[ThreadingHTTPServer] = []

    # ------------------------------------------------------------------ contents

    def add_repo(self, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",),
                 gated: bool = False) -> str:
        """A commit of `files` in `repo_id`, which `refs` then point at; returns the commit."""
        repo = self.repos.setdefault(repo_id, Repo(gated=gated))
        commit = hashlib.sha1(repo_id.encode() + json.dumps(sorted((k, git_blob_id(v)) for k, v in files.items()))
                              .encode()).hexdigest()
        repo.commits[commit] = dict(files)
        for ref in refs:
            repo.refs[ref] = commit
        for path, data in files.items():
            if path.endswith(LFS_SUFFIXES):
                self.blobs[hashlib.sha256(data).hexdigest()] = data
        return commit

    def reset(self) -> None:
        self.log.clear()
        self.drop_once.clear()
        self.corrupt.clear()
        self.slow.clear()
        self.fail.clear()
        self.hold.clear()
        self.held.clear()

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    # ------------------------------------------------------------------ serving

    def start(self) -> HubServer:
        for name in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, name))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)


def _siblings(files: dict[str, bytes]) -> list[dict]:
    siblings = []
    for path, data in sorted(files.items()):
        entry: dict = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        siblings.append(entry)
    return siblings


def _handler(hub: HubServer, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # quiet
            pass

        def do_HEAD(self):
            self._serve(head=True)

        def do_GET(self):
            self._serve(head=False)

        # -------------------------------------------------------------- answers

        def _reply(self, status: int, headers: dict[str, str], body: bytes = b"", head: bool = False) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
            self.end_headers()
            if not head and body:
                self.wfile.write(body)

        def _error(self, status: int, code: str, head: bool, commit: str | None = None) -> None:
            headers = {"X-Error-Code": code, "Content-Type": "application/json"}
            if commit:
                headers["X-Repo-Commit"] = commit
            body = json.dumps({"error": code}).encode()
            self._reply(status, headers, b"" if head else body, head)

        def _token(self) -> str | None:
            auth = self.headers.get("authorization") or ""
            return auth.removeprefix("Bearer ").strip() or None

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub._record(Request(self.command, path, self.headers.get("Range"), self._token(), name))
            if name == "cdn":
                found = re.fullmatch(r"/blobs/([0-9a-f]{64})/(.+)", path)
                if found is None or found.group(1) not in hub.blobs:
                    return self._error(404, "EntryNotFound", head)
                return self._content(hub.blobs[found.group(1)], found.group(2), {}, head)
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
            if info is not None:
                return self._info(info.group(1), info.group(2) or "main", head)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if resolve is not None:
                repo_id, revision, file = resolve.groups()
                return self._resolve(repo_id, revision, file, head)
            self._error(404, "NotFound", head)

        def _repo(self, repo_id: str, revision: str, head: bool) -> tuple[Repo, str] | None:
            repo = next((r for key, r in hub.repos.items() if key.lower() == repo_id.lower()), None)
            if repo is None:
                self._error(404, "RepoNotFound", head)
                return None
            commit = repo.refs.get(revision, revision if revision in repo.commits else None)
            if commit is None:
                self._error(404, "RevisionNotFound", head)
                return None
            return repo, commit

        def _info(self, repo_id: str, revision: str, head: bool) -> None:
            found = self._repo(repo_id, revision, head)
            if found is None:
                return
            repo, commit = found
            canonical = next(key for key in hub.repos if key.lower() == repo_id.lower())
            body = {"id": canonical, "sha": commit, "private": False, "gated": "manual" if repo.gated else False,
                    "siblings": _siblings(repo.commits[commit])}
            self._reply(200, {"Content-Type": "application/json"}, json.dumps(body).encode(), head)

        def _resolve(self, repo_id: str, revision: str, file: str, head: bool) -> None:
            found = self._repo(repo_id, revision, head)
            if found is None:
                return
            repo, commit = found
            if repo.gated and self._token() != hub.GOOD_TOKEN:
                return self._error(403 if self._token() else 401, "GatedRepo", head)
            files = repo.commits[commit]
            if file not in files:
                return self._error(404, "EntryNotFound", head, commit)
            data = files[file]
            common = {"X-Repo-Commit": commit}
            if file.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                location = f"{hub.cdn_url}/blobs/{sha}/{Path(file).name}"
                self._reply(302, {**common, "Location": location, "X-Linked-Etag": f'"{sha}"',
                                  "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_id(data)}"'}, head=True)
                return
            self._content(data, file, {**common, "ETag": f'"{git_blob_id(data)}"'}, head)

        def _content(self, data: bytes, file: str, headers: dict[str, str], head: bool) -> None:
            key = Path(file).name  # faults are switched on by file name
            if key in hub.fail:
                return self._error(500, "ServerError", head)
            if key in hub.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])  # same size, one byte changed
            start = 0
            ranged = self.headers.get("Range")
            if ranged:
                start = int(re.fullmatch(r"bytes=(\d+)-(\d*)", ranged).group(1))  # type: ignore[union-attr]
            body = data[start:]
            status = 206 if ranged else 200
            extra = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if ranged else {}
            self.send_response(status)
            for k, v in {**headers, **extra, "Content-Length": str(len(body)), "Accept-Ranges": "bytes"}.items():
                self.send_header(k, v)
            self.end_headers()
            if head:
                return
            if key in hub.drop_once:
                hub.drop_once.discard(key)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if key in hub.hold:
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if len([r for r in hub.requests("HEAD") if r.path.endswith("/" + key)]) >= hub.hold[key]:
                        hub.held.add(key)
                        break
                    time.sleep(0.01)
                self.wfile.write(body[len(body) // 2:])
                return
            delay = hub.slow.get(key)
            if delay:
                for i in range(0, len(body), 4096):
                    self.wfile.write(body[i:i + 4096])
                    self.wfile.flush()
                    time.sleep(delay)
                return
            self.wfile.write(body)

    return Handler
