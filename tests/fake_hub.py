"""A Hugging Face Hub on 127.0.0.1 for offline tests: the few endpoints huggingface_hub calls.

- ``GET /api/models/ORG/NAME[/revision/REV]``: ``{id, sha, siblings: [{rfilename, size}]}``
- ``HEAD|GET /ORG/NAME/resolve/REV/PATH``: small files directly, with ``ETag``, ``X-Repo-Commit`` and
  ``Content-Length``; ``*.safetensors`` as the Hub serves large files, a 302 to ``http://localhost:PORT/cdn/SHA256`` (a
  "CDN" host) with
  ``X-Linked-Etag`` and ``X-Linked-Size``
- ``HEAD|GET /cdn/SHA256``: the bytes, honoring ``Range: bytes=A-B`` (206 and ``Content-Range``)

Errors carry the ``X-Error-Code`` huggingface_hub maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``GatedRepo``, ``EntryNotFound``). A gated repository lists its files to
anyone and serves them only with ``Authorization: Bearer <its token>``. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None  # gated: files need this bearer token

    @classmethod
    def from_dir(cls, path: Path, **kwargs: object) -> Repo:
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        return cls(files, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def blob(self, sha: str) -> bytes | None:
        for repo in self.repos.values():
            for content in repo.files.values():
                if hashlib.sha256(content).hexdigest() == sha:
                    return content
        return None

    def file_requests(self, name: str = "") -> list[Request]:
        """GETs of file bytes (resolve or CDN): of ``name`` (a path, a base name or, starting with a
        dot, a suffix), or of every file."""
        names = {hashlib.sha256(c).hexdigest(): n for r in self.repos.values() for n, c in r.files.items()}
        found = []
        for request in self.requests:
            if request.method != "GET" or request.path.startswith("/api/") or request.path.endswith(".safetensors"):
                continue  # listings, and the resolve redirects of weights, which carry no bytes
            path = (
                names.get(request.path.rpartition("/")[2]) or request.path.partition("/resolve/")[2].partition("/")[2]
            )
            if not name or path == name or path.endswith("/" + name) or (name[0] == "." and path.endswith(name)):
                found.append(request)
        return found


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_CDN = re.compile(r"^/cdn/([0-9a-f]{64})$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(
                Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
            )
            if match := _API.match(path):
                self._api(match.group(1), match.group(2) or "main", body)
            elif match := _RESOLVE.match(path):
                self._resolve(match.group(1), match.group(2), match.group(3), body)
            elif (match := _CDN.match(path)) and (content := hub.blob(match.group(1))) is not None:
                self._bytes(content, {"ETag": f'"{match.group(1)}"'}, body)
            else:
                self._error(404, "EntryNotFound", body)

        def _repo(self, repo_id: str, revision: str, body: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", body)  # the Hub answers 401 so as not to reveal private repos
            elif revision not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", body)
            else:
                return repo
            return None

        def _api(self, repo_id: str, revision: str, body: bool) -> None:
            if (repo := self._repo(repo_id, revision, body)) is None:
                return
            siblings = [{"rfilename": n, "size": len(c)} for n, c in repo.files.items()]
            info = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False, "siblings": siblings}
            if repo.token:
                info["gated"] = "manual"
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

        def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            if (repo := self._repo(repo_id, revision, body)) is None:
                return
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", body)
                return
            if name not in repo.files:
                self._error(404, "EntryNotFound", body)
                return
            content = repo.files[name]
            sha = hashlib.sha256(content).hexdigest()
            headers = {"X-Repo-Commit": repo.commit}
            if name.endswith(".safetensors"):
                headers.update({
                    # another host name for the same server: a CDN, where huggingface_hub stops a HEAD
                    "Location": f"http://localhost:{self.server.server_address[1]}/cdn/{sha}", "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(content)),
                })  # fmt: skip
                self._send(302, b"", headers, body)
            else:
                headers["ETag"] = f'"{hashlib.sha1(content).hexdigest()}"'
                self._bytes(content, headers, body)

        def _bytes(self, content: bytes, headers: dict[str, str], body: bool) -> None:
            headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if ranged is None:
                self._send(200, content, headers, body)
                return
            start = int(ranged.group(1))
            end = min(int(ranged.group(2) or len(content) - 1), len(content) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            self._send(206, content[start : end + 1], headers, body)

        def _error(self, status: int, code: str, body: bool) -> None:
            message = json.dumps({"error": code}).encode()
            self._send(status, message, {"X-Error-Code": code, "Content-Type": "application/json"}, body)

        def _send(self, status: int, content: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if body:
                self.wfile.write(content)

    return Handler


class Serving:
    """``with Serving(hub) as url:`` runs the server in a thread for the block."""

    def __init__(self, hub: FakeHub):
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        self.hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.hub.url

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
