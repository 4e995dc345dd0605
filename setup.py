"""The one compiled part: MLX's CPU softmax, bit for bit, on every core.

Everything else is in pyproject.toml. The extension is optional: where it does not build
(no C compiler), Tandem runs MLX's own softmax (`engines/platform/cpu_softmax.py`).
-ffp-contract=off: MLX's build fuses no multiply-add it did not write, so neither may we.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engines.platform._cpu_softmax",
            ["engines/platform/cpu_softmax.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
