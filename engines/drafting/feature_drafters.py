"""Drafters fed the target's hidden states: DFlash (a block per forward) and EAGLE-3
(a chain with a reduced vocabulary), loaded from the checkpoints people download.

`--draft-model PATH` names a folder; its `config.json` says which kind it is
(`drafter_kind`), `--draft-kind` forces one. The target's forwards keep the states
of the layers the drafter's config names (`engines.model.taps`), and each request's
`MTPState` (`engines.drafting.mtp`) holds them until the next proposal, with the
drafter's own cache -- the same per-request state, hand-over and restart rules as the
MTP head, so the engines feed all three the same way.

DFlash (`engines.drafting.dflash_model`): its cache holds the context K/V of every
position the target holds; a proposal is one forward over the pending context and the
block [newest token, mask x K], whose K/V are never kept, so nothing is ever rolled
back: the context it caches is committed by construction. The block's logits come from
the target's head; each position's token is chosen (argmax, or sampled from its q)
as a chained drafter's would be, so verification, the stop rule and seeded coupling
are those of every model drafter.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engines.drafting.draft import ASSISTANT, DFLASH, EAGLE3, Draft, DraftStopRule
from engines.drafting.draft_model import chain_drafts
from engines.drafting.mtp import MTPDrafter, MTPState
from engines.model.taps import FINAL, INPUT, OUTPUT, LayerTaps, decoder_layers
from engines.request import SamplingParams
from engines.sample.sampling import RandomStream

log = logging.getLogger(__name__)

KINDS = ("model", DFLASH, EAGLE3, ASSISTANT)  # --draft-kind; "auto" reads the drafter's config


class DrafterRefused(ValueError):
    """A drafter that does not fit the target (refused at start, with the field)."""


def drafter_kind(path: str, forced: str | None = None) -> str:
    """ "model" (a draft language model) or a feature drafter's kind, from the
    drafter's `config.json`: a local folder's, or a hub id's (fetched alone; a GGUF file,
    a packaged name, or a config that cannot be had is a draft model's)."""
    if forced and forced != "auto":
        return forced
    config_file = _config_file(path)
    if config_file is None:
        return "model"
    from engines.drafting.dflash_model import is_dflash_config
    from engines.drafting.eagle3_model import is_eagle3_config
    from engines.drafting.gemma4_assistant_model import is_gemma4_assistant_config

    config = json.loads(config_file.read_text())
    if is_dflash_config(config):
        return DFLASH
    if is_eagle3_config(config):
        return EAGLE3
    if is_gemma4_assistant_config(config):
        return ASSISTANT
    return "model"


def _config_file(path: str) -> Path | None:
    local = Path(path).expanduser()
    if local.exists() or path.startswith(("/", "./", "../", "~")) or path.count("/") != 1:
        return local / "config.json" if (local / "config.json").is_file() else None
    try:  # a hub id: its config alone, from the local hub cache or the hub
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(path, "config.json"))
    except Exception:  # noqa: BLE001 - offline or not there: mlx-lm's load will say
        return None


def drafter_folder(path: str) -> Path:
    """The drafter's files: a local folder, or a hub id's snapshot (fetched once)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))


@dataclass
class FeatureDrafter:
    """A loaded feature drafter: its kind, module and what it reads of the target."""

    kind: str
    module: Any
    taps: LayerTaps
    block_size: int  # DFlash's trained block (drafts per forward + 1); 0: a chain
    path: str
    feature_width: int  # the tapped states' width: taps x the target's hidden size
    # the assistant's: {layer type: target cache index} of the K/V it reads
    shared: dict[str, int] | None = None

    def describe(self) -> str:
        taps = ", ".join(f"{where} of layer {index}" for index, where in self.taps.points)
        block = f", blocks of up to {self.block_size} tokens" if self.block_size else ""
        return f"{self.kind} drafter {self.path}: reads the target's {taps}{block}"


def load_feature_drafter(path: str, kind: str, target: Any) -> FeatureDrafter:
    """Load the `kind` drafter at `path` for `target` (a `LoadedModel`); refuse one that
    does not fit it, naming the field."""
    folder = drafter_folder(path)
    if not (folder / "config.json").is_file():
        raise DrafterRefused(f"--draft-model {path}: a {kind} drafter is a folder with config.json")
    model = target.model
    layers = len(decoder_layers(model))
    text = target.config.get("text_config", target.config)
    hidden, rows = int(text["hidden_size"]), TapsInfo.embedding_rows(model)
    try:
        if kind == DFLASH:
            module, points, block = _load_dflash(folder, model, hidden, layers, rows)
        elif kind == EAGLE3:
            module, points, block = _load_eagle3(folder, model, hidden, layers, rows)
        elif kind == ASSISTANT:
            module, points, block = _load_assistant(folder, model)
        else:
            raise DrafterRefused(f"--draft-kind {kind}: not a feature drafter ({KINDS})")
        taps = LayerTaps(model, points)
        if kind == DFLASH:
            module.bind(taps.embed_tokens, taps.logits)
        elif kind == EAGLE3:  # the target's embedding, unless the checkpoint has its own
            module.bind(taps.embed_tokens)
        else:  # checks the target's layers and takes its embedding
            module.bind(model)
    except ValueError as exc:  # each module's DrafterMismatch names the field
        if isinstance(exc, DrafterRefused):
            raise
        raise DrafterRefused(f"--draft-model {path} does not fit {target.path}: {exc}") from exc
    shared = module.shared_layers(model) if kind == ASSISTANT else None
    return FeatureDrafter(kind, module, taps, block, path, len(points) * hidden, shared)


def _load_dflash(folder: Path, model: Any, hidden: int, layers: int, rows: int):
    from engines.drafting import dflash_model

    module = dflash_model.load_dflash(folder, TapsInfo.dtype(model))
    dflash_model.check_fits(module.config, hidden, layers, rows)
    points = tuple((i, OUTPUT) for i in dflash_model.tap_layers(module.config))
    return module, points, int(module.config.block_size)


def _load_assistant(folder: Path, model: Any):
    """Gemma-4's assistant reads the final-norm state; its K/V come from the cache."""
    from engines.drafting import gemma4_assistant_model

    module = gemma4_assistant_model.load_gemma4_assistant(folder, TapsInfo.dtype(model))
    return module, ((-1, FINAL),), 0


def _load_eagle3(folder: Path, model: Any, hidden: int, layers: int, rows: int):
    """Aux id k is the input of target layer k; k = L (the last layer's output)."""
    from engines.drafting import eagle3_model

    module = eagle3_model.load_eagle3(folder, layers, TapsInfo.dtype(model))
    module.check_fits(hidden, layers, rows)
    points = tuple(
        (k, INPUT) if k < layers else (layers - 1, OUTPUT) for k in module.config.aux_layer_ids
    )
    return module, points, 0


class TapsInfo:
    """What a feature drafter checks of the target: its embedding rows and dtype."""

    @staticmethod
    def embedding_rows(model: Any) -> int:
        text = getattr(model, "language_model", model)
        return int(text.model.embed_tokens.weight.shape[0])

    @staticmethod
    def dtype(model: Any) -> mx.Dtype:
        text = getattr(model, "language_model", model)
        return text.model.norm.weight.dtype


class DFlashDrafter:
    """Proposes up to k tokens (k < block size) in one DFlash forward."""

    method = DFLASH
    fed_with_target = True
    entry_ahead = 0  # prefix-cache entries keep its context K/V (`engines.drafting.entries`)

    def __init__(self, loaded: FeatureDrafter, vocab_size: int) -> None:
        self.loaded = loaded
        self.module = loaded.module
        self.mask_token = int(loaded.module.config.mask_token_id)
        self.block_size = loaded.block_size
        self.feature_width = loaded.feature_width
        self.vocab_size = vocab_size

    def feed(self, state: MTPState) -> mx.array | None:
        """Write the pending context to the drafter's cache (a long prompt's states
        are large: fed as they come). Returns None: DFlash keeps no output state."""
        self._forward(state, [])
        return None

    def _forward(self, state: MTPState, block: list[int]) -> mx.array | None:
        """One drafter forward over the pending context and `block` (its logits for
        block positions 1.., or None for a context-only feed)."""
        if state.cache is None:
            state.cache = self.module.make_cache()
        state.caught_up = state.pending
        if not state.pending and not block:
            return None
        features = (
            mx.concatenate(state.pending_hidden, axis=0)[None]
            if state.pending
            else mx.zeros((1, 0, self.feature_width))
        )
        tokens = mx.array([block or [self.mask_token]], dtype=mx.int32)
        logits = self.module.draft_logits(features, [state.pending], tokens, state.cache)
        state.length += state.pending
        state.pending_hidden, state.pending_tokens, state.pending = [], [], 0
        return logits if block else None

    def propose(
        self,
        state: MTPState,
        context: list[int],
        k: int,
        params: SamplingParams,
        rng: RandomStream,
        processors: list | None = None,
        position: int = 0,
        stop: DraftStopRule | None = None,
    ) -> Draft | None:
        """Up to k drafts after `context`, whose positions but the newest the state
        holds or has pending; None when it has not seen them (a restart)."""
        k = min(k, self.block_size - 1)
        if k <= 0 or state.start + state.length + state.pending != len(context) - 1:
            return None
        logits = self._forward(state, [context[-1]] + [self.mask_token] * k)
        rows = logits[0, :, : self.vocab_size].astype(mx.float32)
        steps = iter(range(1, k))

        def advance(_token: mx.array) -> mx.array:
            """The block's next position: drafted in the same forward, not after the token."""
            return rows[next(steps)][None]

        draft, _ = chain_drafts(
            DFLASH, rows[0][None], advance, k, params, rng, processors, context, position, stop
        )
        return draft


class DFlashStepModel:
    """One DFlash proposal shaped like a model for the start-up cost measurement: a
    block of the tokens given, context-free (what a steady proposal costs)."""

    def __init__(self, loaded: FeatureDrafter) -> None:
        self.module = loaded.module
        self.width = loaded.feature_width

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        features = mx.zeros((tokens.shape[0], 0, self.width))
        block = mx.concatenate([tokens, tokens], axis=1)
        return self.module.draft_logits(features, [0] * tokens.shape[0], block, cache)

    def make_cache(self) -> list:
        return self.module.make_cache()


class Eagle3Drafter(MTPDrafter):
    """An EAGLE-3 speculator: chained as the MTP head is (pair i = fused target states
    at i with token i+1; its own output state is the next pair's), drafting over its
    reduced vocabulary mapped onto the target's (`id + d2t[id]`): its q over the
    target's vocabulary is zero off the mapped ids, so exact verification is the same
    rule as every drafter's."""

    method = EAGLE3
    fed_with_target = True
    entry_ahead = 1  # entries keep its chain's pairs, each with the token after it

    def __init__(self, loaded: FeatureDrafter, vocab_size: int) -> None:
        self.module = loaded.module
        self.target = loaded.taps
        self.vocab_size = vocab_size

    def pairs(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        return self.module.step(tokens, self.module.fuse(hidden), cache)[1]

    def chained(self, tokens: mx.array, out: mx.array, cache: list) -> mx.array:
        return self.module.step(tokens, out, cache)[1]

    def make_cache(self) -> list:
        return self.module.make_cache()

    def batch_logits(self, out: mx.array) -> mx.array:
        draft = self.module.lm_head(self.module.norm(out))
        return self.module.target_logprobs(draft, self.vocab_size)


class Eagle3StepModel:
    """One chained EAGLE-3 step shaped like a model, for the start-up cost measurement."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        out = self.drafter.module.embed(tokens)
        return self.drafter.batch_logits(self.drafter.chained(tokens, out, cache))

    def make_cache(self) -> list:
        return self.drafter.make_cache()
