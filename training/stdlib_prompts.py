"""Chat requests built from the Python standard library, for the target to answer.

A drafter drafts what the model writes when it is asked something, in its chat
template: answers, not source files. Without data of the user's own, the only text
every machine has is the standard library, so requests are made from its documented
public functions (read with `ast`, nothing imported): half ask for code ("Write a
Python function `name(args)` that ..."), half for an explanation of what a function
does. `training.answers` has the target answer them, so the drafter learns the model's
own answers of both kinds. The choice is a seeded shuffle, the same on every run.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

from training.corpus import Record, default_corpus

MAX_FILE_BYTES = 1 << 20


def documented_functions(root: Path) -> list[tuple[str, str, str]]:
    """(module, signature, first docstring sentence) of every public top-level function
    with a docstring under `root`, in a stable order (tests and private modules left out)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(p.startswith(("_", "test")) or p in ("site-packages", "idlelib") for p in parts):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(parts)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = " ".join(doc.split()).split(". ")[0].rstrip(".") if doc else ""
            if len(summary) < 20:
                continue
            signature = f"{node.name}({ast.unparse(node.args)})"
            found.append((module, signature, summary))
    return found


def stdlib_prompts(count: int, seed: int, tokenizer: Any, root: Path | None = None) -> list[Record]:
    """`count` requests (alternately code to write and a function to explain), chosen by
    a seeded shuffle, rendered with the model's chat template where it has one."""
    functions = documented_functions(root or default_corpus())
    random.Random(f"prompts:{seed}").shuffle(functions)
    records = []
    for i, (module, signature, summary) in enumerate(functions[:count]):
        if i % 2 == 0:
            ask = f"Write a Python function `{signature}` that does this: {summary}."
        else:
            name = signature.split("(")[0]
            ask = f"Explain what `{module}.{name}` in Python's standard library does, "
            ask += "with a short example."
        records.append(Record(_rendered(tokenizer, ask), is_prompt=True))
    return records


def _rendered(tokenizer: Any, ask: str) -> str:
    """The request as the server would give it to the model: its chat template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": ask}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return ask + "\n"
