"""A local stand-in for the Hugging Face Hub API, enough for whoami, create_repo, the model card's YAML check and a commit.

Jobs under test reach it through HF_ENDPOINT. It records every request (never the token itself: only
whether the right one was sent) and the files each commit carried, and can be told to fail: a route
answers the queued status codes first (e.g. three 503s), then succeeds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = {"/api/whoami-v2": "whoami", "/api/repos/create": "create", "/api/validate-yaml": "validate-yaml"}


@dataclass
class HubStub:
    token: str = "hf_test_token_value_0123456789"
    role: str = "write"  # or "read", or "fineGrained" with `scopes` on the user's namespace
    scopes: list[str] = field(default_factory=lambda: ["repo.content.read", "repo.write"])
    requests: list[tuple[str, str]] = field(default_factory=list)
    attempts: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), route) of every GET/POST
    retry_after: str = "1"  # the Retry-After header a queued 429 answers with
    commits: list[dict] = field(default_factory=list)  # {"repo": ..., "files": {path: bytes}}
    created: list[dict] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)  # model cards sent to /api/validate-yaml
    failures: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))  # route -> statuses to answer first
    served: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo -> {path: content}, for downloads
    bad_auth: int = 0
    silent: set[str] = field(default_factory=set)  # routes that accept the request and never answer
    _release: threading.Event = field(default_factory=threading.Event)

    def go_silent(self, *routes: str) -> None:
        """Make these routes accept requests and never answer (a Hub behind a broken proxy)."""
        self.silent.update(routes)

    def fail(self, route: str, *statuses: int) -> None:
        """Make `route` ('whoami', 'create', 'preupload', 'commit') answer these statuses before succeeding."""
        self.failures[route].extend(statuses)

    def serve(self, repo: str, folder) -> None:
        """Serve a folder's files as `repo` (GET/HEAD /{repo}/resolve/{revision}/{path}), e.g. a base model."""
        self.served[repo] = {
            str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }

    def repo_files(self, repo: str) -> dict[str, bytes] | None:
        """What a download of `repo` finds: the files served as it, then those its commits carried."""
        files = dict(self.served.get(repo, {}))
        for commit in self.commits:
            if commit["repo"] == repo:
                files.update(commit["files"])
        return files if repo in self.served or any(c["repo"] == repo for c in self.commits) else None

    def start(self) -> str:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status: int, payload=None, headers: dict | None = None):
                body = json.dumps(payload if payload is not None else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def _empty(self, status: int, headers: dict):
                self.send_response(status)
                for key, value in {**headers, "Content-Length": "0"}.items():
                    self.send_header(key, value)
                self.end_headers()

            def _authorized(self) -> bool:
                ok = self.headers.get("Authorization") == f"Bearer {stub.token}"
                stub.bad_auth += not ok
                return ok

            def _route(self) -> str:
                path = self.path.split("?")[0]
                inside = [route for route in ("preupload", "commit") if f"/{route}/" in path]
                return ROUTES.get(path) or (inside or ["other"])[0]

            def _maybe_fail(self, route: str) -> bool:
                stub.attempts.append((time.monotonic(), route))
                if route in stub.silent:
                    stub._release.wait()  # hold the connection open, answer nothing, until the stub stops
                    return True
                queue = stub.failures.get(route)
                if queue:
                    status = queue.popleft()
                    headers = {"Retry-After": stub.retry_after} if status == 429 else None
                    self._send(status, {"error": f"stub failure {status}"}, headers)
                    return True
                return False

            def _download(self, with_body: bool) -> bool:
                """/{org}/{name}/resolve/{revision}/{path}: a file of a served or pushed repo, as the Hub answers it."""
                parts = self.path.split("?")[0].lstrip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    return False
                repo, path = "/".join(parts[:2]), "/".join(parts[4:])
                files = stub.repo_files(repo)
                content = None if files is None else files.get(path)
                if content is None:
                    self._empty(404, {"X-Error-Code": "RepoNotFound" if files is None else "EntryNotFound"})
                    return True
                self.send_response(200)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("X-Repo-Commit", "a" * 40)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if with_body:
                    self.wfile.write(content)
                return True

            def do_HEAD(self):
                stub.requests.append(("HEAD", self.path))
                if not self._download(with_body=False):
                    self._empty(404, {})

            def do_GET(self):
                stub.requests.append(("GET", self.path))
                route = self._route()
                if self._maybe_fail(route):
                    return
                if route == "other" and self._download(with_body=True):
                    return
                if route == "whoami":
                    if not self._authorized():
                        return self._send(401, {"error": "Invalid credentials in Authorization header"})
                    access = {"role": stub.role}
                    scoped = [{"entity": {"type": "user", "name": "tester"}, "permissions": stub.scopes}]
                    if stub.role == "fineGrained":
                        access["fineGrained"] = {"scoped": scoped}
                    return self._send(200, {"name": "tester", "type": "user", "auth": {"accessToken": access}})
                self._send(404, {"error": "not found"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.requests.append(("POST", self.path))
                route = self._route()
                if self._maybe_fail(route):
                    return
                if route == "validate-yaml":
                    stub.validated.append(json.loads(body)["content"])
                    return self._send(200, {"errors": [], "warnings": []})
                if not self._authorized():
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                if route == "create":
                    payload = json.loads(body)
                    stub.created.append(payload)
                    name = f"{payload.get('organization') or 'tester'}/{payload['name']}"
                    return self._send(200, {"url": f"http://{self.headers['Host']}/{name}", "name": name})
                if route == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    return self._send(200, {"files": modes})
                if route == "commit":
                    repo = self.path.split("/api/models/")[1].split("/commit/")[0]
                    items = [json.loads(line) for line in body.decode().splitlines()]
                    added = [item["value"] for item in items if item["key"] == "file"]
                    files = {file["path"]: base64.b64decode(file["content"]) for file in added}
                    stub.commits.append({"repo": repo, "files": files})
                    url = f"http://{self.headers['Host']}/{repo}/commit/abc123"
                    return self._send(200, {"commitUrl": url, "commitOid": "abc123"})
                self._send(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def count(self, route_fragment: str) -> int:
        return sum(1 for _, path in self.requests if route_fragment in path)
