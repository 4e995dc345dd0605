"""The documentation holds together: links resolve, the README stays a front door, and
docs/flags.md names every flag `tandem serve` accepts.

A moved section leaves links behind it; these checks find them before a reader does.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [README, *docs, ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md"]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            links.append((number, target))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link or image in `path` whose file or heading anchor does not exist."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where} (no heading #{anchor} in {linked.name})")
    return problems


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(path: Path) -> None:
    assert path.exists()
    assert broken_links(path) == []


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (`--flag`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section---flag) [self](#page)\n"
        "[gone](missing.md) ![img](missing.png) [bad anchor](other.md#nowhere)\n"
        "```\n[inside code](not-checked.md)\n```\n[web](https://example.com/x.md)\n"
    )
    problems = [line.split(": ", 1)[1] for line in broken_links(page, root=tmp_path)]
    assert problems == [
        "missing.md (no such file)",
        "missing.png (no such file)",
        "other.md#nowhere (no heading #nowhere in other.md)",
    ]


def test_slugs_follow_github() -> None:
    assert slug("One model across machines (`--distributed`)") == (
        "one-model-across-machines---distributed"
    )
    assert slug('GPUs (Metal, CUDA): what "exact" means there') == (
        "gpus-metal-cuda-what-exact-means-there"
    )
    assert slug("The peer: `mlx_lm.server` in the same run") == (
        "the-peer-mlx_lmserver-in-the-same-run"
    )


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    # The two commands come first, as the first code block, and the demo answers a curl.
    text = README.read_text()
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["make serve", "make test"]
    assert "curl -s localhost:8000/v1/chat/completions" in text
    assert '"model": "tandem-demo"' in text


def serve_flags() -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


def test_flags_page_names_every_serve_flag() -> None:
    flags = serve_flags()
    assert {"--draft-model", "--max-kv-gb", "--help"} <= flags  # the parser was really read
    text = (ROOT / "docs" / "flags.md").read_text()
    named = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))
    missing = sorted(flag for flag in flags if flag.startswith("--") and flag not in named)
    assert missing == [], f"docs/flags.md does not name {missing}"
