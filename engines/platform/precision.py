"""Full-precision float32 matrix products, so a verify step's logits equal plain decoding's.

MLX computes float32 matrix products in TF32 on hardware that has it (NVIDIA tensor
cores; Apple's M5 class) unless `MLX_ENABLE_TF32=0`. A speculative verify over k+1
tokens takes the matrix-matrix path, which TF32 rounds to a 10-bit mantissa, while a
one-token plain step takes the matrix-vector path, which stays float32: the two disagree
at near-ties and greedy speculation stops being token-identical to plain decoding.
Measured on an H200 with mlx-cuda 0.32.4 (tiny float32 models): verify against plain
logits differ by ~5e-3 with TF32 and ~5e-6 without, and 84 exactness tests of the
default suite failed with TF32 against none without.

Half-precision weights never use TF32, so turning it off costs them nothing; a user who
wants TF32's speed for float32 weights sets `MLX_ENABLE_TF32=1` and gives up that
equality.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

TF32_VARIABLE = "MLX_ENABLE_TF32"


def keep_float32_exact(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn TF32 off unless the user chose. MLX reads the variable at its first matrix
    product, so this runs before any model is loaded."""
    environ.setdefault(TF32_VARIABLE, "0")


def float32_matmuls(environ: MutableMapping[str, str] = os.environ) -> str:
    """For the startup line: "full" or "tf32 where the hardware has it"."""
    if environ.get(TF32_VARIABLE, "1").strip() == "0":
        return "full"
    return "tf32 where the hardware has it"
