"""The prompts `tandem bench serve` (and the soak, the ceiling bench) send.

Kept apart from the load generator because other benchmarks read the same datasets:
the built-in `bench/data/*.jsonl` files or any JSONL of `{"messages": [...]}` or
`{"prompt": "..."}` lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_DATASETS = ("echo", "novel", "mixed", "chat", "code-edit", "code-novel")


@dataclass(frozen=True)
class Prompt:
    """One dataset line in both shapes: chat messages and one completion string."""

    messages: tuple[dict[str, str], ...]
    text: str


def dataset_path(name: str) -> Path:
    return DATA_DIR / f"{name}.jsonl" if name in BUILTIN_DATASETS else Path(name)


def load_prompts(name: str) -> list[Prompt]:
    path = dataset_path(name)
    if not path.is_file():
        raise SystemExit(f"dataset not found: {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    prompts = [prompt_from_line(json.loads(line)) for line in lines]
    if not prompts:
        raise SystemExit(f"dataset is empty: {path}")
    return prompts


def prompt_from_line(line: dict[str, Any]) -> Prompt:
    """`{"messages": [...]}` (chat turns) or `{"prompt": "..."}` (one user message)."""
    if "messages" in line:
        messages = tuple({"role": m["role"], "content": m["content"]} for m in line["messages"])
        return Prompt(messages, "\n\n".join(m["content"] for m in messages))
    if "prompt" in line:
        return Prompt(({"role": "user", "content": line["prompt"]},), line["prompt"])
    raise SystemExit(f"dataset line has neither 'messages' nor 'prompt': {line}")


def prompt_order(num_prompts: int, dataset_size: int) -> list[int]:
    """Cycle the dataset to reach `num_prompts`."""
    return [index % dataset_size for index in range(num_prompts)]
