"""Loading and saving a draft checkpoint of a registered kind: the registry says which module to build, which weight
files to read and what the config says; ``loading.py`` builds and loads it strictly. (Kept apart from ``loading.py``,
which the registry's builders live in, so the registry sits above the draft modules and below this.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec_kit.runtime.drafts.loading import (
    DraftLoadError,
    check_vocab_maps,
    find_weight_file,
    official_key_map,
    read_config,
    read_config_file,
    read_weights,
    strict_load,
)
from specdec_kit.runtime.drafts.speculators_format import official_weights
from specdec_kit.runtime.registry import default_settings, draft_kind


def build_draft(
    kind: str,
    config: dict[str, Any],
    file: Path,
    target_hidden: int,
    target_vocab: int,
    target_shape: tuple[int, int] | None = None,
) -> nn.Module:
    """An uninitialised draft module of ``kind`` shaped by ``config`` (validated against the target;
    ``target_shape`` = (layers, 2 x kv_heads x head_dim) for drafts that read the target's KV cache)."""
    return registered(kind).build(config, file, target_hidden, target_vocab, target_shape)


def registered(kind: str):
    """The registry's kind, or a DraftLoadError naming the kinds there are."""
    try:
        return draft_kind(kind)
    except ValueError as exc:
        raise DraftLoadError(str(exc)) from None


def load_lookup_settings(path: str | Path | None, kind: str) -> Any:
    """A model-free kind's settings: from ``path`` (a settings JSON file, or a folder with config.json) or, without
    one, the kind's defaults."""
    if path is None:
        return default_settings(kind)
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise DraftLoadError(f"{file}: no {kind} settings file there (a JSON object of settings)")
    config = read_config_file(file)
    try:
        return draft_kind(kind).build(config, file, 0, 0)
    except ValueError as exc:
        raise DraftLoadError(str(exc)) from None


def load_draft(
    path: str | Path | None,
    kind: str,
    target_hidden: int,
    target_vocab: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    target_shape: tuple[int, int] | None = None,
    embedding: torch.Tensor | None = None,
) -> nn.Module:
    """Load an official-layout draft checkpoint strictly; refuse one that does not fit the target. ``embedding``:
    the target's token embedding, for a head that takes it from the target (``embedding_from_target``)."""
    if registered(kind).model_free:
        return load_lookup_settings(path, kind)
    path = Path(path)
    if not path.is_dir():
        raise DraftLoadError(f"{path}: draft checkpoint directory does not exist")
    config_file, config = path / "config.json", read_config(path)
    module = build_draft(kind, config, config_file, target_hidden, target_vocab, target_shape)
    file = find_weight_file(path, draft_kind(kind).family.weight_files)
    state = official_key_map(module, file, official_weights(config, read_weights(file)))
    state = with_target_embedding(module, state, config, config_file, file, embedding)
    strict_load(module, state, file)
    if getattr(module, "d2t", None) is not None:
        check_vocab_maps(module, file)
    return module.to(device=device, dtype=dtype).eval()


def with_target_embedding(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    config_file: Path,
    file: Path,
    embedding: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The target's token embedding put in where the draft takes it from the target: a head saved with
    ``embedding_from_target``, or a file an official trainer wrote with its trainable parameters only (EAGLE-3's
    DeepSpeed save leaves out the embedding, which it froze as the target's)."""
    key = "embed_tokens.weight"
    declared = bool(config.get("embedding_from_target"))
    if declared and key in state:
        raise DraftLoadError(f"{file}: holds {key}, but {config_file} says embedding_from_target")
    if key in state or key not in module.state_dict():
        return state
    if embedding is None:
        why = "embedding_from_target is set" if declared else f"{file} has no {key} (a trainer left out the frozen one)"
        raise DraftLoadError(
            f"{config_file}: {why}, so the draft takes the target's embedding; load it against its "
            "target (load_draft_for)"
        )
    return dict(state, **{key: embedding.detach().to("cpu", module.embed_tokens.weight.dtype)})


def save_draft(
    module: nn.Module,
    path: str | Path,
    kind: str,
    safetensors: bool = False,
    base_model: str = "",
    embedding_from_target: bool = False,
) -> Path:
    """Write ``module`` in the official layout of ``kind`` (so the reference code could load it too);
    ``embedding_from_target`` leaves out the token embedding (the target's), which loading then takes from it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family = draft_kind(kind).family
    config = family.config_dict(module, base_model)
    if draft_kind(kind).model_free:  # settings alone
        (path / "config.json").write_text(json.dumps(config, indent=2))
        return path / "config.json"
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    if embedding_from_target and "embed_tokens.weight" in state:  # a draft without an embedding has none to leave
        config["embedding_from_target"] = True
        state.pop("embed_tokens.weight")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k.removeprefix(family.saved_prefix): v for k, v in state.items()}
    file = path / family.saved_files[1 if safetensors else 0]
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(file))
    else:
        torch.save(state, file)
    return file
