"""A capturing stand-in for an LLM API: records every request a coding-agent client
sends (method, path, query, headers, JSON body) and answers plausibly so the client
goes on to its next request.

Why: the fixtures under tests/data/agent_requests/ are what real clients (Claude Code,
Codex CLI, the openai-agents SDK, ...) put on the wire; they are recorded with this
server, not written by hand. Run it as a script:

    python -m tests.agent_clients.capture_server OUT_DIR [--tool-call]

It prints "PORT <n>" on its first line. With --tool-call, a request that offers tools
and carries no tool result yet is answered with one tool call (a Write/Edit for the
Messages API, a shell call for Responses, a function call for chat completions), so the
client's second request (the one carrying the tool result) is captured too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "openai-api-key"}
ANSWER = "Done: added div(a, b) to calc.py."
# What --stall sends each second before the answer, to learn which keep-alive a client honours.
KEEPALIVES = {
    "comment": b": keep-alive\n\n",
    "ping": b'event: ping\ndata: {"type": "ping"}\n\n',
    "message_delta": b'event: message_delta\ndata: {"type": "message_delta", "delta": '
    b'{"stop_reason": null, "stop_sequence": null}, "usage": {"output_tokens": 0}}\n\n',
    "in_progress": b'event: response.in_progress\ndata: {"type": "response.in_progress", '
    b'"response": {"id": "resp_capture", "object": "response", "status": "in_progress", '
    b'"output": []}}\n\n',
}


def sse(event: str | None, data: dict) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def anthropic_has_tool_result(body: dict) -> bool:
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        ):
            return True
    return False


def anthropic_tool_input(body: dict, workdir: str) -> tuple[str, dict] | None:
    names = {t.get("name") for t in body.get("tools", []) if isinstance(t, dict)}
    if "Write" in names:
        return "Write", {
            "file_path": f"{workdir}/div.py",
            "content": "def div(a, b):\n    return a / b\n",
        }
    return None


def anthropic_stream(body: dict, tool: tuple[str, dict] | None) -> list[bytes]:
    message = {
        "id": "msg_capture",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "m"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }
    out = [sse("message_start", {"type": "message_start", "message": message})]
    if tool:
        name, args = tool
        block = {"type": "tool_use", "id": "toolu_capture1", "name": name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": ANSWER}
        stop = "end_turn"
    out += [
        sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 5},
            },
        ),
        sse("message_stop", {"type": "message_stop"}),
    ]
    return out


def anthropic_message(body: dict, tool: tuple[str, dict] | None) -> dict:
    if tool:
        content = [{"type": "tool_use", "id": "toolu_capture1", "name": tool[0], "input": tool[1]}]
    else:
        content = [{"type": "text", "text": ANSWER}]
    return {
        "id": "msg_capture",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "m"),
        "content": content,
        "stop_reason": "tool_use" if tool else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }


def responses_has_tool_result(body: dict) -> bool:
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(i, dict) and str(i.get("type", "")).endswith("_output") for i in items
    )


def responses_tool_item(body: dict, workdir: str) -> dict | None:
    for tool in body.get("tools", []):
        if tool.get("type") == "function" and tool.get("name") in ("shell", "exec_command"):
            command = f"printf 'def div(a, b):\\n    return a / b\\n' >> {workdir}/calc.py"
            if tool["name"] == "shell":
                args = {"command": ["bash", "-lc", command]}
            else:
                args = {"cmd": command}
            return {
                "type": "function_call",
                "id": "fc_capture1",
                "call_id": "call_capture1",
                "name": tool["name"],
                "arguments": json.dumps(args),
                "status": "completed",
            }
    for tool in body.get("tools", []):
        if tool.get("type") == "function" and tool.get("name"):
            return {
                "type": "function_call",
                "id": "fc_capture1",
                "call_id": "call_capture1",
                "name": tool["name"],
                "arguments": json.dumps({"city": "Paris"}),
                "status": "completed",
            }
    return None


def responses_stream(body: dict, tool: dict | None) -> list[bytes]:
    if tool:
        item = tool
    else:
        item = {
            "type": "message",
            "id": "msg_capture",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": ANSWER, "annotations": []}],
        }
    response = {
        "id": "resp_capture",
        "object": "response",
        "created_at": 0,
        "status": "in_progress",
        "model": body.get("model", "m"),
        "output": [],
    }
    done = {
        **response,
        "status": "completed",
        "output": [item],
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        },
    }
    seq = itertools.count()
    out = [
        sse(
            "response.created",
            {"type": "response.created", "response": response, "sequence_number": next(seq)},
        ),
        sse(
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "status": "in_progress"},
                "sequence_number": next(seq),
            },
        ),
    ]
    if not tool:
        out.append(
            sse(
                "response.output_text.delta",
                {
                    "type": "response.output_text.delta",
                    "item_id": "msg_capture",
                    "output_index": 0,
                    "content_index": 0,
                    "delta": ANSWER,
                    "sequence_number": next(seq),
                },
            )
        )
    out += [
        sse(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": item,
                "sequence_number": next(seq),
            },
        ),
        sse(
            "response.completed",
            {"type": "response.completed", "response": done, "sequence_number": next(seq)},
        ),
    ]
    return out


def chat_has_tool_result(body: dict) -> bool:
    return any(m.get("role") == "tool" for m in body.get("messages", []) if isinstance(m, dict))


def chat_tool_call(body: dict) -> dict | None:
    for tool in body.get("tools", []):
        function = tool.get("function", {})
        if tool.get("type") == "function" and function.get("name"):
            args = {"city": "Paris"}
            if function["name"] == "bash":
                args = {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}
            return {
                "id": "call_capture1",
                "type": "function",
                "function": {"name": function["name"], "arguments": json.dumps(args)},
            }
    return None


def chat_completion(body: dict, call: dict | None) -> dict:
    message: dict = {"role": "assistant", "content": None if call else ANSWER}
    if call:
        message["tool_calls"] = [call]
    return {
        "id": "chatcmpl-capture",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "m"),
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def chat_stream(body: dict, call: dict | None) -> list[bytes]:
    base = {
        "id": "chatcmpl-capture",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": body.get("model", "m"),
    }
    if call:
        delta = {"role": "assistant", "tool_calls": [{"index": 0, **call}]}
    else:
        delta = {"role": "assistant", "content": ANSWER}
    finish = "tool_calls" if call else "stop"
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(
            {
                **base,
                "choices": [],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )
    return [sse(None, c) for c in chunks] + [b"data: [DONE]\n\n"]


class Recorder:
    """Numbers and writes each request; explicit state shared by handler threads."""

    def __init__(
        self, out_dir: Path, tool_call: bool, workdir: str, stall: float = 0, keepalive: str = ""
    ) -> None:
        self.stall = stall
        self.keepalive = KEEPALIVES[keepalive] if stall else b""
        self.out_dir = out_dir
        self.tool_call = tool_call
        self.workdir = workdir
        self.lock = threading.Lock()
        self.counter = itertools.count(1)

    def record(self, entry: dict) -> None:
        with self.lock:
            n = next(self.counter)
        name = entry["path"].strip("/").replace("/", "_") or "root"
        path = self.out_dir / f"{n:03d}-{entry['method']}-{name}.json"
        path.write_text(json.dumps(entry, indent=2))


def make_handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            sys.stderr.write("capture: " + format % args + "\n")

        def do_GET(self) -> None:
            self.handle_any(None)

        def do_HEAD(self) -> None:
            self.record_only(None)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.headers.get("content-encoding") == "zstd":
                raw = b""  # not expected; recorded as empty
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = {"_raw": raw.decode("utf-8", "replace")}
            self.handle_any(body)

        def handle_any(self, body) -> None:
            self.record_only(body)
            self.answer(urlsplit(self.path).path, body if isinstance(body, dict) else {})

        def record_only(self, body) -> None:
            split = urlsplit(self.path)
            headers = {
                k: ("<removed>" if k.lower() in SECRET_HEADERS else v)
                for k, v in self.headers.items()
            }
            recorder.record(
                {
                    "method": self.command,
                    "path": split.path,
                    "query": parse_qs(split.query),
                    "headers": headers,
                    "body": body,
                }
            )

        def send_json(self, data: dict, status: int = 200) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def send_sse(self, events: list[bytes]) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("connection", "close")
            self.end_headers()
            # A long prefill, as a client sees it: only keep-alives for `stall` seconds.
            for _ in range(int(recorder.stall)):
                self.wfile.write(recorder.keepalive)
                self.wfile.flush()
                time.sleep(1)
            for event in events:
                self.wfile.write(event)
                self.wfile.flush()
            self.close_connection = True

        def answer(self, path: str, body: dict) -> None:
            workdir = recorder.workdir
            if path.endswith("/messages/count_tokens"):
                return self.send_json({"input_tokens": 100})
            if path.endswith("/messages"):
                tool = None
                if recorder.tool_call and not anthropic_has_tool_result(body):
                    tool = anthropic_tool_input(body, workdir)
                if body.get("stream"):
                    return self.send_sse(anthropic_stream(body, tool))
                return self.send_json(anthropic_message(body, tool))
            if path.endswith("/responses"):
                tool = None
                if recorder.tool_call and not responses_has_tool_result(body):
                    tool = responses_tool_item(body, workdir)
                return self.send_sse(responses_stream(body, tool))
            if path.endswith("/chat/completions"):
                call = None
                if recorder.tool_call and not chat_has_tool_result(body):
                    call = chat_tool_call(body)
                if body.get("stream"):
                    return self.send_sse(chat_stream(body, call))
                return self.send_json(chat_completion(body, call))
            if path.endswith("/models"):
                model = {"id": "capture-model", "object": "model", "created": 0, "owned_by": "x"}
                return self.send_json({"object": "list", "data": [model]})
            return self.send_json({})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--tool-call", action="store_true")
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--stall", type=float, default=0.0, help="seconds of keep-alives first")
    parser.add_argument("--keepalive", choices=sorted(KEEPALIVES), default="comment")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0),
        make_handler(Recorder(out, args.tool_call, args.workdir, args.stall, args.keepalive)),
    )
    print(f"PORT {server.server_address[1]}", flush=True)
    threading.Timer(args.seconds, server.shutdown).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
