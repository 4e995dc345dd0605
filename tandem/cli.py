"""The `tandem` command: `tandem serve` and `tandem convert` (`server.cli`), `tandem bench`
(`bench.cli`), `tandem draft train` (`training.cli`) and `tandem draft eval`
(`bench.draft_eval`).

The one module that knows both packages, so that neither imports the other to dispatch:
the benches may use the server's own prompt rendering, and the server never imports a
bench.
"""

from __future__ import annotations

import sys

from engines.platform.precision import keep_float32_exact


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    keep_float32_exact()  # before anything computes: benches check equality too
    if argv[:1] == ["bench"]:  # bench parses its own arguments, --help included
        from bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    if argv[:2] == ["draft", "train"]:  # training a drafter (`training.cli`)
        from training.cli import main as train_main

        train_main(argv[2:])
        return
    if argv[:2] == ["draft", "eval"]:  # measuring one (`bench.draft_eval`)
        from bench.draft_eval import main as eval_main

        eval_main(argv[2:])
        return
    from server.cli import main as server_main

    server_main(argv)


if __name__ == "__main__":
    main()
