"""Strict loading (and writing) of draft checkpoints in their official layouts.

Layouts (as the reference implementations write them):

* EAGLE-1/2, HASS, GRIFFIN: ``config.json`` (a Llama config with ``num_hidden_layers`` 1 and the
  optional ``bias`` / ``qkv_bias`` keys) + ``pytorch_model.bin`` (or ``model.safetensors``). The kit's extension:
  with ``draft_vocab_size`` below ``vocab_size`` the head proposes a reduced vocabulary (its ``d2t`` / ``t2d`` maps
  as EAGLE-3's, scored by the target's own LM-head rows).
* Any of these with ``embedding_from_target: true`` in its config (the kit's extension) leaves out
  ``embed_tokens.weight``, which is the target's (frozen in training): loading takes it from the target.
* EAGLE-3: ``config.json`` (a Llama config with ``draft_vocab_size`` and, when the draft is narrower or wider than
  the target, ``target_hidden_size``) + ``pytorch_model.bin`` (or ``model.safetensors``), 16 tensors
  including the ``d2t`` / ``t2d`` vocabulary maps (optional when the draft vocabulary is the target's).
* DFlash: the official ``DFlashDraftModel`` layout: ``config.json`` (a Qwen3 config with ``block_size`` and
  ``dflash_config`` {``mask_token_id``, ``target_layer_ids``}) + ``model.safetensors`` (or ``pytorch_model.bin``),
  no embedding and no LM head (the target's), or, with a reduced ``draft_vocab_size``, an LM head of its own and
  ``d2t``/``t2d``.
* Medusa: ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers`` + ``medusa_lm_head.pt`` or
  ``medusa_lm_head.safetensors`` whose keys lack the ``medusa_head.`` prefix (the legacy layout), or a
  ``model.safetensors`` / ``pytorch_model.bin`` holding ``medusa_head.*`` keys beside base weights.

The single key map per format lives in ``official_key_map``; everything else is a strict ``load_state_dict``
preceded by checks that name the file, the key and the expected and found values. Which builder and which
weight files a kind uses is the drafter registry's (``runtime/registry.py``); ``runtime/checkpoint.py`` loads a checkpoint
of a registered kind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import LlamaConfig, Qwen3Config

from specdec_kit.runtime.drafts.dflash import DFlashDraft
from specdec_kit.runtime.drafts.eagle import EagleDraft
from specdec_kit.runtime.drafts.eagle3 import Eagle3Draft, default_feature_layers
from specdec_kit.runtime.drafts.griffin import GriffinDraft
from specdec_kit.runtime.drafts.layers import FeatureDraft
from specdec_kit.runtime.drafts.medusa import MedusaHeads
from specdec_kit.runtime.drafts.moa import MoADraft
from specdec_kit.runtime.drafts.peagle import PEagleDraft
from specdec_kit.runtime.drafts.speculators_format import DFLASH_LAYOUT_KEYS, is_speculators, official_config

if TYPE_CHECKING:
    from specdec_kit.runtime.models.target import TargetModel

MEDUSA_PREFIX = "medusa_head."


class DraftLoadError(ValueError):
    """A draft checkpoint that cannot be used with this target; the message says where and why."""


def read_config(path: Path) -> dict[str, Any]:
    """A draft's config; a speculators head's (EAGLE-3) as the official one it describes."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DraftLoadError(f"{config_file}: missing; a draft checkpoint directory needs config.json")
    config = read_config_file(config_file)
    if is_speculators(config):
        try:
            return official_config(config, config_file)
        except ValueError as exc:
            raise DraftLoadError(str(exc)) from None
    return config


def read_config_file(config_file: Path) -> dict[str, Any]:
    """A JSON object from ``config_file``, or a DraftLoadError naming the file."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DraftLoadError(f"{config_file}: unreadable or not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise DraftLoadError(f"{config_file}: expected a JSON object, found {type(config).__name__}")
    return config


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    """safetensors, or a pickle loaded with ``weights_only=True`` (never executes code from the file)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupted, truncated or foreign files all land here
        raise DraftLoadError(f"{file}: cannot read weights ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DraftLoadError(f"{file}: expected a mapping of parameter names to tensors")
    return state


def find_weight_file(path: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        if (path / name).is_file():
            return path / name
    raise DraftLoadError(f"{path}: no weights file; expected one of {list(names)}")


def _require(config: dict[str, Any], key: str, file: Path) -> Any:
    if key not in config:
        raise DraftLoadError(f"{file}: key {key!r} is missing")
    return config[key]


def _check_fits(file: Path, key: str, expected: Any, found: Any) -> None:
    if expected != found:
        raise DraftLoadError(f"{file}: {key} does not fit the target: expected {expected}, found {found}")


def new_draft_fields(target: TargetModel, intermediate: int | None = None) -> dict[str, Any]:
    """The config fields of a new one-layer draft sized for ``target`` (width, heads, vocabulary, and its rotary
    settings, as the reference derives a draft's config from the base model's)."""
    cfg = target.config
    rope = getattr(cfg, "rope_parameters", None)
    return dict(
        **({"rope_parameters": dict(rope)} if rope else {}),
        hidden_size=cfg.hidden_size,
        intermediate_size=intermediate or cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_hidden_layers=1,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def draft_config(target: TargetModel, intermediate: int | None = None) -> LlamaConfig:
    """The Llama config of a new one-layer draft sized for ``target`` (``new_draft_fields``), as trainers start one."""
    return LlamaConfig(**new_draft_fields(target, intermediate))


def dflash_config(target: TargetModel, layers: int = 1) -> Qwen3Config:
    """The Qwen3 config of a new DFlash draft of ``layers`` layers sized for ``target`` (``new_draft_fields``, the
    target's head width too: the draft embeds with the target's embedding and scores with its LM head)."""
    cfg = target.config
    return Qwen3Config(
        **new_draft_fields(target)
        | dict(
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            num_hidden_layers=layers,
            attention_bias=False,
            tie_word_embeddings=False,
        )
    )


def llama_config(config: dict[str, Any], file: Path) -> LlamaConfig:
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        _require(config, key, file)
    fields = {
        k: v
        for k, v in config.items()
        if k
        not in (
            "architectures",
            "model_type",
            "bias",
            "qkv_bias",
            "draft_vocab_size",
            "eagle_config",
            "mask_token_id",
            "parallel_draft_tokens",
        )
        and not k.startswith(("moa_", "target_", "eagle_", "specdec_"))  # the kit's own markers are no Llama fields
    }
    if "rope_parameters" in fields:  # the canonical form; the top-level keys beside it are for older readers
        fields.pop("rope_theta", None)
        fields.pop("rope_scaling", None)
    fields.setdefault("num_hidden_layers", 1)
    return LlamaConfig(**fields)


def official_key_map(module: nn.Module, file: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The one documented renaming per layout: Medusa's legacy files lack the ``medusa_head.`` prefix,
    and a full Medusa model file also carries base-model weights, which the draft does not own; an EAGLE-3 file
    whose draft vocabulary is the target's may lack the (identity) vocabulary maps. Files the official trainers
    write through DeepSpeed also carry the frozen target's rotary buffers (``target_model.*.rotary_emb.inv_freq``,
    recomputed from the config, never weights), which are left out."""
    state = {
        k: v for k, v in state.items() if not (k.startswith("target_model.") and k.endswith("rotary_emb.inv_freq"))
    }
    if isinstance(module, Eagle3Draft):
        return _identity_vocab_maps(module, state)
    if isinstance(module, DFlashDraft):
        return _derived_t2d(module, state)
    if not isinstance(module, MedusaHeads):  # the other layouts store the module's own keys
        return state
    if file.name.startswith("medusa_lm_head"):
        return {MEDUSA_PREFIX + k: v for k, v in state.items()}
    return {k: v for k, v in state.items() if k.startswith(MEDUSA_PREFIX)}


def strict_load(module: nn.Module, state: dict[str, torch.Tensor], file: Path) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        raise DraftLoadError(
            f"{file}: key {missing[0]!r} is missing (expected shape {list(expected[missing[0]].shape)})"
            + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else "")
        )
    if extra:
        raise DraftLoadError(
            f"{file}: unexpected key {extra[0]!r} (shape {list(state[extra[0]].shape)}) not in this draft format"
            + (f"; {len(extra) - 1} more unexpected" if len(extra) > 1 else "")
        )
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise DraftLoadError(
                f"{file}: key {key!r} has shape {list(state[key].shape)}, expected {list(tensor.shape)}"
            )
    module.load_state_dict(state, strict=True)


def build_medusa(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> MedusaHeads:
    heads = int(_require(config, "medusa_num_heads", file))
    layers = int(config.get("medusa_num_layers", 1))
    if heads < 1 or layers < 0:
        raise DraftLoadError(
            f"{file}: medusa_num_heads must be >= 1 and medusa_num_layers >= 0, found {heads}, {layers}"
        )
    if "hidden_size" in config:
        _check_fits(file, "hidden_size", target_hidden, config["hidden_size"])
    return MedusaHeads(target_hidden, target_vocab, heads, layers)


def _fitting_llama_config(config: dict[str, Any], file: Path, target_hidden: int, target_vocab: int) -> LlamaConfig:
    cfg = llama_config(config, file)
    _check_fits(file, "hidden_size", target_hidden, cfg.hidden_size)
    _check_fits(file, "vocab_size", target_vocab, cfg.vocab_size)
    return cfg


def build_moa(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> MoADraft:
    cfg = _fitting_llama_config(config, file, target_hidden, target_vocab)
    layers, kv_dim = int(_require(config, "target_num_layers", file)), int(_require(config, "target_kv_dim", file))
    if target_shape is not None:
        _check_fits(file, "target_num_layers", target_shape[0], layers)
        _check_fits(file, "target_kv_dim", target_shape[1], kv_dim)
    tli = int(config.get("moa_tli", 0))
    if not 0 <= tli <= layers:
        raise DraftLoadError(f"{file}: moa_tli = {tli}, expected 0..{layers} (the target's layers)")
    return MoADraft(cfg, layers, kv_dim, tli=tli, lsa_heads=int(config.get("moa_lsa_heads", 4)))


def build_griffin(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> GriffinDraft:
    cfg = _fitting_llama_config(config, file, target_hidden, target_vocab)
    if cfg.num_hidden_layers != 1:
        raise DraftLoadError(f"{file}: key 'num_hidden_layers' is {cfg.num_hidden_layers}, expected 1 for GRIFFIN")
    return GriffinDraft(
        cfg, qkv_bias=bool(config.get("qkv_bias", False)), draft_vocab_size=_draft_vocab(config, file, cfg)
    )


def build_eagle(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> EagleDraft:
    cfg = _fitting_llama_config(config, file, target_hidden, target_vocab)
    return EagleDraft(
        cfg,
        fc_bias=bool(config.get("bias", True)),
        qkv_bias=bool(config.get("qkv_bias", False)),
        draft_vocab_size=_draft_vocab(config, file, cfg),
    )


def feature_layers_of(config: dict[str, Any], file: Path, target_layers: int | None) -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft fuses: ``eagle_aux_hidden_state_layer_ids`` (top level, or inside
    ``eagle_config`` as vLLM and SpecForge write it), else the reference's defaults for the target's depth."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids is None:
        if target_layers is None:
            raise DraftLoadError(f"{file}: no eagle_aux_hidden_state_layer_ids, and the target's depth is unknown")
        return default_feature_layers(target_layers)
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) for i in ids)
        or ids != sorted(set(ids))
        or (target_layers is not None and not 0 <= ids[0] <= ids[-1] < target_layers)
    ):
        raise DraftLoadError(
            f"{file}: eagle_aux_hidden_state_layer_ids is {ids!r}, expected distinct ascending layer ids"
            + (f" in 0..{target_layers - 1} of the target" if target_layers is not None else "")
        )
    return tuple(ids)


def build_eagle3(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> Eagle3Draft:
    return Eagle3Draft(*eagle3_arguments(config, file, target_hidden, target_vocab, target_shape))


def eagle3_arguments(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None,
) -> tuple[LlamaConfig, int, int, tuple[int, ...]]:
    """An EAGLE-3 layout's (config, target width, draft vocabulary, tapped layers), checked against the target. The
    reference reads ``target_hidden_size`` when present (fc takes 3 x that), else 3 x ``hidden_size``."""
    cfg = llama_config(config, file)
    _check_fits(file, "vocab_size", target_vocab, cfg.vocab_size)
    width_key = "target_hidden_size" if "target_hidden_size" in config else "hidden_size"
    _check_fits(file, width_key, target_hidden, int(config[width_key]))
    if cfg.num_hidden_layers != 1:
        raise DraftLoadError(f"{file}: key 'num_hidden_layers' is {cfg.num_hidden_layers}, expected 1 for EAGLE-3")
    layers = feature_layers_of(config, file, target_shape[0] if target_shape else None)
    return cfg, target_hidden, _draft_vocab(config, file, cfg), layers


def build_peagle(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> PEagleDraft:
    """EAGLE-3's layout with ``mask_token_id`` (as vLLM reads it) and ``parallel_draft_tokens`` in the config and
    ``mask_hidden`` among the weights."""
    arguments = eagle3_arguments(config, file, target_hidden, target_vocab, target_shape)
    vocab = arguments[0].vocab_size
    mask = _require(config, "mask_token_id", file)
    tokens = _require(config, "parallel_draft_tokens", file)
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise DraftLoadError(f"{file}: mask_token_id is {mask!r}, expected a token id in 0..{vocab - 1}")
    if not isinstance(tokens, int) or tokens < 2:
        raise DraftLoadError(f"{file}: parallel_draft_tokens is {tokens!r}, expected an integer >= 2")
    return PEagleDraft(*arguments, mask, tokens)


def build_dflash(
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> DFlashDraft:
    """The official DFlash layout, checked against the target: the draft is as wide as the target (it embeds with the
    target's embedding and scores with its LM head), its tapped layers exist in it and feed a decoder layer, and its
    attention is what the kit runs (full, non-causal within a block)."""
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_hidden_layers"):
        _require(config, key, file)
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise DraftLoadError(f"{file}: dflash_config is {dflash!r}, expected an object")
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    block = config.get("block_size", dflash.get("block_size"))
    for key, value in (("dflash_config.mask_token_id", mask), ("dflash_config.target_layer_ids", ids)):
        if value is None:
            raise DraftLoadError(f"{file}: key {key!r} is missing")
    if block is None:
        raise DraftLoadError(f"{file}: key 'block_size' is missing (the root slot plus the masked slots)")
    if "sliding_attention" in (config.get("layer_types") or []) or dflash.get("use_swa") or config.get("is_causal"):
        raise DraftLoadError(
            f"{file}: sliding-window or causal DFlash layers (layer_types, dflash_config.use_swa, is_causal); the kit "
            "runs DFlash's full attention, non-causal within a block"
        )
    fields = {k: v for k, v in config.items() if k not in DFLASH_LAYOUT_KEYS and not k.startswith("specdec_")}
    if "rope_parameters" in fields:
        fields.pop("rope_theta", None)
        fields.pop("rope_scaling", None)
    cfg = Qwen3Config(**fields)
    _check_fits(file, "hidden_size", target_hidden, cfg.hidden_size)
    _check_fits(file, "vocab_size", target_vocab, cfg.vocab_size)
    layers = target_shape[0] if target_shape else config.get("num_target_layers")
    if target_shape and "num_target_layers" in config:
        _check_fits(file, "num_target_layers", target_shape[0], config["num_target_layers"])
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) for i in ids)
        or ids != sorted(set(ids))
        or ids[0] < 0
        or (layers is not None and ids[-1] > layers - 2)
    ):
        raise DraftLoadError(
            f"{file}: dflash_config.target_layer_ids is {ids!r}, expected distinct ascending ids of decoder layers "
            + (f"0..{layers - 2} (the output of the last of the {layers} layers is not tapped)" if layers else "")
        )
    if not isinstance(mask, int) or not 0 <= mask < cfg.vocab_size:
        raise DraftLoadError(
            f"{file}: dflash_config.mask_token_id is {mask!r}, expected a token id in 0..{cfg.vocab_size - 1}"
        )
    if not isinstance(block, int) or block < 2:
        raise DraftLoadError(f"{file}: block_size is {block!r}, expected an integer >= 2")
    vocab = config.get("draft_vocab_size", cfg.vocab_size)
    if not isinstance(vocab, int) or not 1 <= vocab <= cfg.vocab_size:
        raise DraftLoadError(f"{file}: draft_vocab_size is {vocab!r}, expected 1..{cfg.vocab_size} (vocab_size)")
    draft = DFlashDraft(cfg, target_hidden, tuple(i + 1 for i in ids), mask, block, vocab)
    draft.num_target_layers = layers
    return draft


def _draft_vocab(config: dict[str, Any], file: Path, cfg: LlamaConfig) -> int:
    draft_vocab = int(config.get("draft_vocab_size", cfg.vocab_size))
    if not 1 <= draft_vocab <= cfg.vocab_size:
        raise DraftLoadError(f"{file}: draft_vocab_size is {draft_vocab}, expected 1..{cfg.vocab_size} (vocab_size)")
    return draft_vocab


def _identity_vocab_maps(module: Eagle3Draft, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference drops ``d2t``/``t2d`` when the draft vocabulary is the target's: fill in the identity."""
    if module.draft_vocab_size == module.config.vocab_size and not {"d2t", "t2d"} & set(state):
        state = dict(state, d2t=torch.zeros_like(module.d2t), t2d=torch.ones_like(module.t2d))
    return state


def _derived_t2d(module: DFlashDraft, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reduced-vocabulary DFlash file may carry ``d2t`` alone (vLLM reads nothing else): ``t2d`` is what it maps to."""
    if module.has_own_head and "d2t" in state and "t2d" not in state:
        t2d = torch.zeros(module.config.vocab_size, dtype=torch.bool)
        mapped = torch.arange(len(state["d2t"])) + state["d2t"].long()
        if len(mapped) and 0 <= int(mapped.min()) and int(mapped.max()) < len(t2d):  # else check_vocab_maps says
            t2d[mapped] = True
        state = dict(state, t2d=t2d)
    return state


def check_vocab_maps(module: FeatureDraft, file: Path) -> None:
    """Every draft id must map into the target vocabulary, and ``t2d`` must mark exactly the ids it maps to."""
    mapped = torch.arange(module.draft_vocab_size) + module.d2t
    if int(mapped.min()) < 0 or int(mapped.max()) >= module.config.vocab_size:
        raise DraftLoadError(
            f"{file}: d2t maps draft ids outside the target vocabulary 0..{module.config.vocab_size - 1} "
            f"(found {int(mapped.min())}..{int(mapped.max())})"
        )
    marked = torch.zeros_like(module.t2d)
    marked[mapped] = True
    if not torch.equal(marked, module.t2d):
        raise DraftLoadError(
            f"{file}: t2d marks {int(module.t2d.sum())} target ids, d2t maps to "
            f"{int(marked.sum())} distinct ones; expected the same set"
        )
