"""The target's hidden states at named layers, kept from the forwards that verify.

A feature drafter (DFlash, EAGLE-3) drafts from the hidden states of a few target
layers. They must come from the target forwards the engines run anyway -- prefill
chunks, plain steps, verifies -- never from an extra pass. `LayerTaps` changes the
class of each tapped layer instance to a subclass that, while the taps are armed,
keeps what flows out of (or into) the layer: every architecture that loops over its
`layers` is tapped the same way, and the forward's ops and logits are unchanged (the
subclass calls the layer's own `__call__`; the parameter tree is untouched).

Points are `(layer index, "output" | "input")`: DFlash's `target_layer_ids` name
layer outputs, EAGLE-3's aux ids name layer inputs (off by one from each other);
`(-1, "final")` is the backbone's final norm output (what Gemma-4's assistant reads:
the state the LM head projects, without splitting the forward, so logits keep the
model's own final softcap).

Owned by the engine thread, like the model: `forward` arms, runs, disarms.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engines.model.mtp import TargetParts

OUTPUT, INPUT, FINAL = "output", "input", "final"


def decoder_layers(model: Any) -> list:
    """The target's decoder layers, as mlx-lm's text models hold them."""
    text = getattr(model, "language_model", model)
    return text.model.layers


class LayerTaps:
    """The target's forward that also returns the tapped states, concatenated in the
    order of `points` (shape (B, n, len(points) * D)) -- the layout a drafter's `fc`
    reads. `forward` has `TargetParts.forward`'s contract, so the engines feed a
    feature drafter exactly where they feed the MTP head."""

    def __init__(self, model: Any, points: tuple[tuple[int, str], ...]) -> None:
        self.model = model
        self.points = points
        self.parts = TargetParts(model)  # the embedding and LM head a drafter shares
        self.embed_tokens = self.parts.embed_tokens
        self.captured: dict[tuple[int, str], mx.array] = {}
        self.armed = False
        layers = decoder_layers(model)
        for index in sorted({index for index, where in points if where != FINAL}):
            _install(layers[index], index, self)
        if any(where == FINAL for _, where in points):
            text = getattr(model, "language_model", model)
            _install(text.model.norm, -1, self)

    def record(self, index: int, inputs: mx.array, output: Any) -> None:
        if not self.armed:
            return
        if (index, INPUT) in self.points:
            self.captured[(index, INPUT)] = inputs
        for where in (OUTPUT, FINAL):
            if (index, where) in self.points:
                self.captured[(index, where)] = output[0] if isinstance(output, tuple) else output

    def forward(
        self, tokens: mx.array, cache: list, input_embeddings: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """(logits, tapped states) of one target forward over `tokens` (B, n), or over
        `input_embeddings` where given (a prompt chunk with images)."""
        self.captured, self.armed = {}, True
        try:
            if input_embeddings is None:
                logits = self.model(tokens, cache=cache)
            else:
                logits = self.model(tokens, cache=cache, input_embeddings=input_embeddings)
        finally:
            self.armed = False
        features = mx.concatenate([self.captured[point] for point in self.points], axis=-1)
        self.captured = {}
        return logits, features

    def logits(self, hidden: mx.array) -> mx.array:
        return self.parts.logits(hidden)

    @property
    def dtype(self) -> mx.Dtype:
        return self.parts.dtype


def _install(layer: Any, index: int, taps: LayerTaps) -> None:
    """Make `layer` report to `taps`: its class becomes a subclass whose `__call__`
    runs the original and hands the input and output over. Installed once per layer
    (a second `LayerTaps` on the same model replaces the first)."""
    base = getattr(type(layer), "_tapped_base", type(layer))

    def __call__(self, x, *args, **kwargs):
        output = base.__call__(self, x, *args, **kwargs)
        taps.record(index, x, output)
        return output

    layer.__class__ = type(
        f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_tapped_base": base}
    )
