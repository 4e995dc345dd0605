"""Wheels for a lent GPU machine, cut into parts that each fit one device call.

The device machine has no network: what `bench/device_check.sh` installs travels in the
working tree, at most 64 MiB a call with the tree itself. `mlx-cuda-13` alone is a
~90 MB wheel, so `pack` (run here, with a registry) downloads the wheels the image
lacks for the device's Python, cuts them into pieces and files the pieces into parts
of at most `--part-mib` (`.device-wheels/p1`, `p2`, ...), each with the same manifest.
On the device, `stage` copies the part it was carried with into a folder outside the
tree (kept while the machine stays warm), joins every wheel whose pieces are all there
and checks its sha256: one call per part, the last one runs the check.

    python -m bench.device_wheels pack [--dest .device-wheels] [--part-mib 55]
    python -m bench.device_wheels stage [--src .device-wheels] [--dest DIR]
    python -m bench.device_wheels requirements

Standard library only: `stage` runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

MLX_VERSION = "0.32.4"
# What the project needs on a CUDA machine: pyproject's dependencies with MLX's CUDA
# backend instead of mlx[cpu] (no mkl: the GPU needs no CPU BLAS), and the test runner's.
REQUIREMENTS = (
    f"mlx[cuda13]=={MLX_VERSION}",
    "mlx-lm==0.32.2",
    "tokenizers>=0.21",
    "starlette>=0.40",
    "uvicorn>=0.30",
    "pydantic>=2.6,<3",
    "prometheus-client>=0.20",
    "llguidance>=1.9,<2",
    "jsonschema-rs>=0.60,<1",
    "gguf>=0.17,<1",
    "cryptography>=42",
    "pytest>=8",
    "pytest-asyncio>=0.24",
    "pytest-timeout>=2.3",
    "httpx>=0.27",
)
# Large wheels the device image already holds in versions that satisfy the above
# (/work/.library/device/KINDS.md: CUDA 13 libraries, numpy, tokenizers, transformers
# 5.17 -- below pyproject's 5.18, which only GGUF import needs; the project is
# installed without its dependency list).
IMAGE_HAS = ("nvidia", "numpy", "hf_xet", "huggingface_hub", "tokenizers", "sentencepiece",
             "transformers", "httpx2", "httpcore2", "pygments", "torch")  # fmt: skip
PYTHON = "3.12"
MANIFEST = "MANIFEST.json"


def platforms() -> list[str]:
    """pip download matches platform tags exactly: every manylinux the image runs."""
    tags = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def download(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
               "--python-version", PYTHON, "--implementation", "cp", "-d", str(folder)]  # fmt: skip
    for tag in platforms():
        command += ["--platform", tag]
    subprocess.run([*command, *REQUIREMENTS], check=True)
    return sorted(folder.glob("*.whl"))


def carried(wheels: list[Path]) -> list[Path]:
    return [w for w in wheels if not w.name.lower().startswith(IMAGE_HAS)]


def pack(dest: Path, part_mib: float) -> list[Path]:
    """Download the wheels the image lacks, cut and file them into parts."""
    folder = dest / "download"  # the whole closure, CUDA libraries too: 2 GB, dropped after
    parts = file_parts(carried(download(folder)), dest, int(part_mib * 2**20))
    shutil.rmtree(folder)
    return parts


def file_parts(wheels: list[Path], dest: Path, limit: int) -> list[Path]:
    """`wheels` cut into pieces of at most `limit` bytes, filed first-fit into part
    folders `dest/p1`, `p2`, ... of at most `limit` bytes, each with the manifest."""
    pieces: list[tuple[str, bytes | Path, int]] = []  # (name, data or path, size)
    manifest: dict = {"wheels": {}}
    for wheel in wheels:
        size = wheel.stat().st_size
        entry = {"sha256": sha256(wheel), "pieces": []}
        if size <= limit:
            pieces.append((wheel.name, wheel, size))
            entry["pieces"].append(wheel.name)
        else:
            data = wheel.read_bytes()
            for index, start in enumerate(range(0, size, limit)):
                name = f"{wheel.name}.piece{index:02d}"
                chunk = data[start : start + limit]
                pieces.append((name, chunk, len(chunk)))
                entry["pieces"].append(name)
        manifest["wheels"][wheel.name] = entry
    parts: list[list[tuple[str, bytes | Path, int]]] = []
    for piece in sorted(pieces, key=lambda p: -p[2]):  # first fit, largest first
        home = next((p for p in parts if sum(x[2] for x in p) + piece[2] <= limit), None)
        if home is None:
            parts.append(home := [])
        home.append(piece)
    manifest["parts"] = len(parts)
    manifest["part_of"] = {
        piece[0]: f"p{number}" for number, part in enumerate(parts, start=1) for piece in part
    }
    folders = []
    for number, part in enumerate(parts, start=1):
        folder = dest / f"p{number}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, content, _ in part:
            target = folder / name
            if isinstance(content, Path):
                shutil.copy(content, target)
            else:
                target.write_bytes(content)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
        folders.append(folder)
        mib = sum(x[2] for x in part) / 2**20
        print(f"{folder}: {len(part)} files, {mib:.1f} MiB")
    return folders


def stage(src: Path, dest: Path) -> bool:
    """Copy the carried part(s) into `dest`, join the wheels whose pieces are all
    there; True when every wheel of the manifest is ready in `dest / "wheels"`."""
    dest.mkdir(parents=True, exist_ok=True)
    for manifest in sorted(src.glob(f"*/{MANIFEST}")):
        for item in manifest.parent.iterdir():
            shutil.copy(item, dest / item.name)
        print(f"staged {manifest.parent.name}")
    if not (dest / MANIFEST).exists():
        print(f"no wheel parts under {src} (run `python -m bench.device_wheels pack` here)")
        return False
    manifest = json.loads((dest / MANIFEST).read_text())
    ready = dest / "wheels"
    ready.mkdir(exist_ok=True)
    missing = []
    for wheel, entry in manifest["wheels"].items():
        if (ready / wheel).exists():
            continue
        absent = [p for p in entry["pieces"] if not (dest / p).exists()]
        if absent:
            missing += absent
            continue
        with (ready / wheel).open("wb") as out:
            for piece in entry["pieces"]:
                out.write((dest / piece).read_bytes())
        if sha256(ready / wheel) != entry["sha256"]:
            (ready / wheel).unlink()
            raise SystemExit(f"{wheel}: sha256 differs after joining its pieces")
    if missing:
        waiting = sorted({manifest["part_of"][piece] for piece in missing})
        print(f"waiting for part(s) {', '.join(waiting)} of {manifest['parts']} "
              f"({len(missing)} pieces): call again at once carrying the next part")  # fmt: skip
        return False
    print(f"all {len(manifest['wheels'])} wheels ready in {ready}")
    return True


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack")
    packing.add_argument("--dest", type=Path, default=Path(".device-wheels"))
    packing.add_argument("--part-mib", type=float, default=55.0)
    staging = commands.add_parser("stage")
    staging.add_argument("--src", type=Path, default=Path(".device-wheels"))
    staging.add_argument("--dest", type=Path, default=Path("/tmp/tandem-device-wheels"))
    commands.add_parser("requirements")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args.dest, args.part_mib)
    elif args.command == "stage":
        raise SystemExit(0 if stage(args.src, args.dest) else 3)
    else:
        print("\n".join(REQUIREMENTS))


if __name__ == "__main__":
    main()
