"""Record agent sessions from the real CLIs against a real Tandem server, for
`tandem bench agent` (bench/data/agent/*-tandem.json).

    python -m bench.agent_record [--clients claude,codex] [--seconds 600]

Claude Code and Codex CLI (installed in .agent-clients/, see tests/test_agent_clients.py)
each run one task against `python -m tests.agent_server` (`tandem serve`'s own app with
the tiny agent model forced to call the client's tools, so a session has real tool
calls: Claude Code Read, Edit, answer; Codex exec_command, answer), through a recording
proxy on 127.0.0.1 that writes down every request as sent and passes the streamed
answer through unchanged. Each later turn's history therefore holds the answers the
server really gave. Bounded: the server exits after --seconds, each client is killed
(its process group) after --client-seconds, everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from bench.agent_sessions import DROPPED_HEADERS, ROOT, SESSIONS_DIR, SURFACES

NODE_BIN = ROOT / ".agent-clients" / "node_modules" / ".bin"
MODEL = "tiny"
CALC = "def add(a, b):\n    return a + b\n"
TASK = "Add a function div(a, b) to calc.py. FORCE:agent-"
HOP = {"transfer-encoding", "connection", "keep-alive", "content-length"}
CLIENTS = {  # name -> (session name, client as recorded, surface path)
    "claude": (
        "claude-code-2.1-tandem",
        "Claude Code 2.1.197 (claude -p) vs Tandem",
        "/v1/messages",
    ),
    "codex": ("codex-0.171-tandem", "Codex CLI 0.171.0 (codex exec) vs Tandem", "/v1/responses"),
}


def recording_proxy(upstream: int, log: list[dict]) -> ThreadingHTTPServer:
    """A proxy on 127.0.0.1 to `upstream` that appends each request to `log` and
    relays the response, chunk by chunk as it streams."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            url = urlsplit(self.path)
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in DROPPED_HEADERS}
            log.append(
                {
                    "method": self.command,
                    "path": url.path,
                    "query": parse_qs(url.query),
                    "headers": headers,
                    "body": body,
                }
            )
            conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=600)
            forward = {k: v for k, v in self.headers.items() if k.lower() not in HOP | {"host"}}
            conn.request(self.command, self.path, body=raw, headers=forward)
            response = conn.getresponse()
            self.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in HOP:
                    self.send_header(key, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            conn.close()

        do_GET = do_POST = do_DELETE = relay

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_tandem(workdir: Path, model_dir: str, seconds: float) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "tests.agent_server", str(workdir), "--seconds", str(seconds)]
    command += ["--", model_dir, "--served-model-name", MODEL]
    log = (workdir / "tandem.log").open("w")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=300)
    except queue.Empty:
        stop(proc)
        raise SystemExit(f"no port from the agent server; see {workdir}/tandem.log") from None
    return proc, int(line.split()[1])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def client_env(home: Path, **extra: str) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    return {**env, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def client_command(name: str, workdir: Path, url: str) -> tuple[list[str], dict[str, str]]:
    if name == "claude":
        env = client_env(
            workdir / "claude-home",
            ANTHROPIC_BASE_URL=url,
            ANTHROPIC_API_KEY="bench",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_TELEMETRY="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_ERROR_REPORTING="1",
            IS_SANDBOX="1",
        )
        command = [str(NODE_BIN / "claude"), "-p", TASK + "claude", "--model", MODEL]
        return [*command, "--dangerously-skip-permissions"], env
    home = workdir / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "tandem"\n\n'
        '[model_providers.tandem]\nname = "Tandem"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "TANDEM_API_KEY"\n'
    )
    env = client_env(home, CODEX_HOME=str(home), TANDEM_API_KEY="bench")
    command = [str(NODE_BIN / "codex"), "exec", "--skip-git-repo-check"]
    return [*command, "--dangerously-bypass-approvals-and-sandbox", TASK + "codex"], env


def run_client(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> int:
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    print(f"{command[0]} exit {proc.returncode}\n{out[-800:]}\n{err[-800:]}", file=sys.stderr)
    return proc.returncode


def session_file(name: str, log: list[dict], out_dir: Path) -> Path | None:
    """The session of the client's streamed requests on its surface, in order."""
    session, client, path = CLIENTS[name]
    turns = []
    for request in log:
        body = request["body"]
        if request["path"] == path and isinstance(body, dict) and body.get("stream"):
            turns.append({"surface": SURFACES[path], **request})
    if not turns:
        return None
    data = {
        "name": session,
        "client": client,
        "recorded_from": "python -m bench.agent_record: the real CLI against "
        "tests.agent_server (tandem serve's app, the tiny agent model forced to use tools)",
        "note": "each turn's request as the client sent it; later turns carry the answers "
        "the server gave (forced reasoning and tool calls) and the tools' real results",
        "turns": turns,
    }
    target = out_dir / f"{session}.json"
    target.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_record")
    parser.add_argument("--clients", default="claude,codex")
    parser.add_argument("--seconds", type=float, default=600.0, help="the server's lifetime")
    parser.add_argument("--client-seconds", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=SESSIONS_DIR)
    args = parser.parse_args(argv)
    from bench.agent import resolve

    model_dir = resolve("agent-tiny")
    workdir = Path(tempfile.mkdtemp(prefix="tandem-agent-record-"))
    proc, port = start_tandem(workdir, model_dir, args.seconds)
    try:
        for name in args.clients.split(","):
            log: list[dict] = []
            proxy = recording_proxy(port, log)
            folder = workdir / name
            folder.mkdir()
            (folder / "calc.py").write_text(CALC)
            command, env = client_command(name, workdir, f"http://127.0.0.1:{proxy.server_port}")
            run_client(command, folder, env, args.client_seconds)
            proxy.shutdown()
            print(name, session_file(name, log, args.out), len(log), "requests")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
