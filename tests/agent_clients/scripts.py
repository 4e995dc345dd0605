"""What the forced tiny model writes for each coding-agent client, turn by turn.

A task given to a client ends with "FORCE:agent-<client>"; the model's answer to a
request is that client's script at the turn given by how many tool results the
conversation holds after the marker (0: the first tool call; one result: the next
step; ...). So a session is scripted without the server keeping any state, and a
client that re-sends a request (a retry) gets the same answer.
"""

from __future__ import annotations

import json

from engines.request import GenerationRequest
from tests.forcing import forced_tokens_processor

MARKER = "FORCE:agent-"
# How the demo chat template renders a tool's result (engines/model/demo.py CHAT_TEMPLATE).
TOOL_RESULT = "<tool_response>"
CALC = "def add(a, b):\n    return a + b\n"
DIV = "\n\ndef div(a, b):\n    return a / b\n"
APPEND_DIV = "printf '\\n\\ndef div(a, b):\\n    return a / b\\n' >> calc.py"
ANSWER = "Added div(a, b) to calc.py."
SEEN = "The screenshot is coloured noise."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# Reasoning before the first call: the client must carry it back (Claude Code a thinking
# block with its signature, Codex a reasoning item with encrypted_content).
THINK = "<think>calc.py needs a div function next to add.</think>"


def tool_call(name: str, arguments: dict) -> str:
    payload = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{payload}\n</tool_call>"


def client_scripts(workdir: str) -> dict[str, list[str]]:
    """Per client, the model's text at turn 0, 1, ...; paths are under `workdir`, one
    folder per client, each holding a calc.py that starts as CALC."""
    claude_calc = f"{workdir}/claude/calc.py"
    return {
        # Claude Code's Edit refuses a file not Read in this session: Read, Edit, answer.
        "claude": [
            THINK + tool_call("Read", {"file_path": claude_calc}),
            tool_call(
                "Edit",
                {"file_path": claude_calc, "old_string": CALC, "new_string": CALC + DIV},
            ),
            ANSWER,
        ],
        # Claude Code reads a screenshot: its Read tool returns the image in the result.
        "claude-image": [
            tool_call("Read", {"file_path": f"{workdir}/claude-image/shot.png"}),
            SEEN,
        ],
        "codex": [THINK + tool_call("exec_command", {"cmd": APPEND_DIV}), ANSWER],
        "mini": [
            tool_call("bash", {"command": APPEND_DIV}),
            tool_call("bash", {"command": SUBMIT}),
        ],
        "sdk": [tool_call("get_weather", {"city": "Paris"}), "It is sunny in Paris."],
    }


def script_for(prompt: str, scripts: dict[str, list[str]]) -> str | None:
    """The text to force for this prompt, or None when it carries no marker."""
    at = prompt.rfind(MARKER)
    if at < 0:
        return None
    rest = prompt[at + len(MARKER) :]
    name = next((n for n in sorted(scripts, key=len, reverse=True) if rest.startswith(n)), None)
    if name is None:
        return None
    turn = rest.count(TOOL_RESULT)
    steps = scripts[name]
    return steps[min(turn, len(steps) - 1)]


def agent_forcing_factory(tokenizer, scripts: dict[str, list[str]]):
    """`SchedulerConfig.logits_processor_factory`: a marked prompt is answered with its
    client's script for the turn it is at, then EOS; any other prompt is left alone."""
    eos = min(tokenizer.eos_token_ids)

    def factory(request: GenerationRequest) -> list:
        text = script_for(tokenizer.decode(list(request.prompt_tokens)), scripts)
        if text is None:
            return []
        script = [*tokenizer.encode(text, add_special_tokens=False), eos]
        return [forced_tokens_processor(len(request.prompt_tokens), script)]

    return factory
