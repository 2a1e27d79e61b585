"""EAGLE-3, P-EAGLE and DFlash heads written in the speculators format (vLLM's training project) read as the
official layout.

A speculators head keeps its decoder layer's config in ``transformer_layer_config`` and the method's fields beside
it. EAGLE-3's (``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``,
``norm_before_residual``) name its decoder layers as a list (``layers.0.``) where the official EAGLE-3 says
``midlayer.``. Only one layer order exists in the kit's EAGLE-3 layer (the residual is the hidden state before its
norm): a head trained with the other (``norm_before_residual: true``, speculators' default when unset) is refused,
since it would compute something else. DFlash's (``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids``:
the hidden states *entering* those layers, so the official ``target_layer_ids`` are one less) keep the official
weight names (a reduced ``draft_vocab_size`` with its own ``lm_head`` and ``d2t``/``t2d``, as speculators trains by
default, included); the kit refuses speculators' variants that compute something else (a slot for the anchor's own
token, Domino's correction head, shifted labels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OFFICIAL_LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."
FROM_SPECULATORS = "specdec_from_speculators"  # set on the converted config: the weights use speculators' names


def is_speculators(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config


# the official DFlash config's keys beside its Qwen3 decoder layer's
DFLASH_LAYOUT_KEYS = (
    "architectures",
    "model_type",
    "block_size",
    "num_target_layers",
    "dflash_config",
    "auto_map",
    "draft_vocab_size",
)


def is_official_dflash(config: dict[str, Any]) -> bool:
    """Whether ``config`` is the official DFlash layout's (a Qwen3 config with ``dflash_config``)."""
    return "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or [])


def official_config(config: dict[str, Any], file: Path) -> dict[str, Any]:
    """The official config (EAGLE-3's, P-EAGLE's or DFlash's) of a speculators head's ``config``; ValueError naming
    what does not fit."""
    kind = config["speculators_model_type"]
    if kind == "dflash":
        return official_dflash_config(config, file)
    if kind not in ("eagle3", "peagle"):
        raise ValueError(
            f"{file}: a speculators head of type {kind!r}; the kit reads speculators' eagle3, peagle and dflash heads"
        )
    unset = kind == "eagle3"  # what speculators (and vLLM) take when the key is missing: eagle3 true, peagle false
    if config.get("norm_before_residual", unset):
        raise ValueError(
            f"{file}: norm_before_residual is {config.get('norm_before_residual', f'unset ({str(unset).lower()})')}; "
            "the kit's EAGLE-3 layer keeps the hidden state before its norm as the residual (false), as the official "
            "EAGLE-3"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{file}: key 'transformer_layer_config' is missing or not an object")
    out = dict(
        layer, draft_vocab_size=config.get("draft_vocab_size", layer.get("vocab_size")), **{FROM_SPECULATORS: True}
    )
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}
    if config.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config["target_hidden_size"]
    if kind == "peagle":  # its proposals a forward: the depths it was trained for, else what it proposes
        out["mask_token_id"] = config.get("mask_token_id")
        proposal = config.get("speculators_config", {}).get("proposal_methods", [{}])[0]
        out["parallel_draft_tokens"] = config.get("para_depths") or proposal.get("speculative_tokens")
    return out


# speculators' DFlash options the kit's DFlash does not compute, with the value it does
DFLASH_VARIANTS = {"sample_from_anchor": False, "projector_type": "dflash", "shift_label": False}


def official_dflash_config(config: dict[str, Any], file: Path) -> dict[str, Any]:
    """The official DFlash config of a speculators DFlash head's ``config``; ValueError naming what does not fit."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{file}: key 'transformer_layer_config' is missing or not an object")
    for key, plain in DFLASH_VARIANTS.items():
        if config.get(key) not in (None, plain):
            raise ValueError(f"{file}: {key} is {config[key]!r}; the kit runs plain DFlash ({key}: {plain!r})")
    aux = config.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise ValueError(
            f"{file}: aux_hidden_state_layer_ids is {aux!r}, expected the ids (1 or more) of the target layers whose "
            "entering hidden states the draft reads"
        )
    out = dict(layer, architectures=["DFlashDraftModel"], model_type=layer.get("model_type", "qwen3"))
    out["block_size"] = config.get("block_size")
    out["dflash_config"] = {"mask_token_id": config.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]}
    if config.get("draft_vocab_size") is not None:  # below the vocabulary: the head's own LM head and d2t/t2d
        out["draft_vocab_size"] = config["draft_vocab_size"]
    if config.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config["target_hidden_size"]
    return out


def official_weights(config: dict[str, Any], state: dict) -> dict:
    """The weights under the official names: a speculators head's one decoder layer as ``midlayer.`` (``config`` as
    ``official_config`` returns it); any other head's unchanged."""
    if not config.get(FROM_SPECULATORS):
        return state
    renamed = {
        k.replace(SPECULATORS_LAYER, OFFICIAL_LAYER, 1) if k.startswith(SPECULATORS_LAYER) else k: v
        for k, v in state.items()
    }
    if "mask_hidden" in renamed:  # speculators keeps it [1, 1, 3 d_target], vLLM and the kit [1, 3 d_target]
        renamed["mask_hidden"] = renamed["mask_hidden"].reshape(1, -1)
    return renamed
