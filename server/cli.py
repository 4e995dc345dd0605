"""The `tandem` command: `tandem serve MODEL | FILE.gguf | --demo`, `tandem convert`.

Parsing builds one frozen `ServerConfig`; nothing below the CLI reads argv or env.
"""

from __future__ import annotations

import argparse
import os
import sys

from engines.platform.blas_preload import ensure_fast_blas
from engines.platform.precision import keep_float32_exact
from server.cli_args import add_serve_arguments
from server.logging_setup import configure_logging


def build_parser() -> argparse.ArgumentParser:
    # `tandem bench` is dispatched by `tandem.cli` before this parser runs (so the server
    # never imports a bench); it is listed here for `--help`.
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the HTTP server"))
    convert = commands.add_parser("convert", help="import a GGUF file into an mlx-lm folder")
    convert.add_argument("gguf", help="a llama or qwen2 GGUF file")
    convert.add_argument("out_dir", help="the mlx-lm model folder to write")
    convert.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    bench = commands.add_parser("bench", help="benchmarks (tandem bench --help)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    keep_float32_exact()  # before anything computes
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        raise SystemExit("tandem bench: run it through the `tandem` command (tandem.cli)")
    if args.command == "convert":
        convert(args)
        return
    configure_logging(args.log_level, args.log_format)
    if args.command == "serve":
        if not (args.no_blas_preload or os.environ.get("TANDEM_NO_BLAS_PRELOAD")):
            ensure_fast_blas()
        from server.serve import serve

        serve(args)


def convert(args: argparse.Namespace) -> None:
    from pathlib import Path

    from engines.model.gguf_import import GGUFImportError, convert_gguf, default_dtype

    dtype = args.dtype or default_dtype()
    try:
        convert_gguf(Path(args.gguf), Path(args.out_dir), dtype)
    except (GGUFImportError, OSError) as exc:
        raise SystemExit(f"tandem convert: {exc}") from exc
    print(f"wrote {args.out_dir} ({dtype}); serve it with: tandem serve {args.out_dir}")
