"""EAGLE-3, P-EAGLE and DFlash heads in the speculators format, the one vLLM's own training project ships drafts in.

A speculators head is the draft's weights beside a ``config.json`` that says what it is (``speculators_model_type``),
the decoder layer it runs (``transformer_layer_config``: a Llama config, a Qwen3 one for DFlash), the method's own
fields (EAGLE-3's draft vocabulary, the target layers it reads, where its norms sit; DFlash's block size, mask token
and tapped layers) and how it proposes (``speculators_config``: greedy proposals of ``speculative_tokens``, and the
verifier it was trained for). vLLM reads that config itself, so the head serves with
``--speculative-config '{"model": HEAD}'`` and no method.

    python -m specdec_kit.export.speculators zoo/eagle3 heads/eagle3-speculators --target zoo/target --tokens 3
    python -m specdec_kit.export.speculators zoo/dflash heads/dflash-speculators --target zoo/target --tokens 7

The kit's EAGLE-3 layer keeps the hidden state from before its norm as the residual (the official EAGLE-3's choice),
so the config says ``norm_before_residual: false`` explicitly: a speculators config without it means the other.
A DFlash head's tapped layers are named as speculators names them, the hidden states entering a layer
(``aux_hidden_state_layer_ids``: the official ``target_layer_ids`` + 1), and its weights keep their official names,
which are speculators' too; it has no embedding and no LM head (the target's), as speculators saves a draft over the
target's whole vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec_kit.runtime.drafts.speculators_format import (
    DFLASH_LAYOUT_KEYS,
    OFFICIAL_LAYER,
    SPECULATORS_LAYER,
    is_official_dflash,
)

LAYER_KEYS_LEFT_OUT = (
    "draft_vocab_size",
    "eagle_config",
    "architectures",
    "target_hidden_size",
    "mask_token_id",
    "parallel_draft_tokens",
)


def proposal(kind: str, tokens: int, verifier: str, verifier_architecture: str) -> dict[str, Any]:
    """``speculators_config``: greedy proposals of ``tokens`` tokens for the verifier at ``verifier``."""
    return {
        "algorithm": kind,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": [verifier_architecture]},
    }


def speculators_config(official: dict[str, Any], tokens: int, verifier: str, verifier_architecture: str) -> dict:
    """The speculators config of an EAGLE-3, P-EAGLE or DFlash head whose official ``config.json`` is ``official`` (a
    P-EAGLE head proposes at most the tokens one forward was trained for, a DFlash head at most its masked slots)."""
    if tokens < 1:
        raise ValueError(f"--tokens {tokens}: expected at least 1 speculative token")
    if is_official_dflash(official):
        return dflash_speculators_config(official, tokens, verifier, verifier_architecture)
    if "draft_vocab_size" not in official or "eagle_config" not in official:
        raise ValueError(
            "not an EAGLE-3 or DFlash head's config: expected draft_vocab_size and eagle_config (EAGLE-3, P-EAGLE) "
            "or block_size and dflash_config (DFlash)"
        )
    parallel = "mask_token_id" in official
    kind = "peagle" if parallel else "eagle3"
    if parallel:
        tokens = min(tokens, int(official["parallel_draft_tokens"]))
    layer = {k: v for k, v in official.items() if k not in LAYER_KEYS_LEFT_OUT}
    out = {
        "architectures": ["PEagleSpeculator" if parallel else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "transformer_layer_config": dict(layer, model_type=layer.get("model_type", "llama")),
        "draft_vocab_size": official["draft_vocab_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(official["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        "speculators_config": proposal(kind, tokens, verifier, verifier_architecture),
    }
    if official.get("target_hidden_size") is not None:
        out["target_hidden_size"] = official["target_hidden_size"]
    if parallel:
        out.update(mask_token_id=official["mask_token_id"], para_depths=official["parallel_draft_tokens"])
    return out


def dflash_speculators_config(official: dict[str, Any], tokens: int, verifier: str, verifier_architecture: str) -> dict:
    """The speculators config of the official DFlash config ``official``.

    ``sliding_window_non_causal`` is written true: to speculators it only concerns sliding-window layers (a DFlash
    head's full-attention layers are non-causal within the block whatever it says), but vLLM makes every layer of
    the draft causal from its negation, which would be another model than the one trained."""
    dflash = official["dflash_config"]
    block = int(official["block_size"])
    layer = {k: v for k, v in official.items() if k not in DFLASH_LAYOUT_KEYS}  # the decoder layer's own keys
    out = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": dict(layer, model_type=official.get("model_type", "qwen3")),
        "draft_vocab_size": official.get("draft_vocab_size", official["vocab_size"]),
        "block_size": block,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in dflash["target_layer_ids"]],
        "mask_token_id": dflash["mask_token_id"],
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": proposal("dflash", min(tokens, block - 1), verifier, verifier_architecture),
    }
    if official.get("target_hidden_size") is not None:
        out["target_hidden_size"] = official["target_hidden_size"]
    return out


def speculators_weights(state: dict) -> dict:
    """An official head's weights under speculators' names: EAGLE-3's decoder layer in a list, as DFlash's already is."""
    return {k.replace(OFFICIAL_LAYER, SPECULATORS_LAYER, 1): v.contiguous() for k, v in state.items()}


def write_speculators_files(out: Path, config: dict[str, Any], state: dict) -> None:
    """``out``/config.json and model.safetensors of a speculators head (``config`` as ``speculators_config`` gives it,
    ``state`` under the official names)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(speculators_weights(state), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_speculators_head(head: Path, out: Path, target: Path, tokens: int) -> Path:
    """``out``: the head at ``head`` (official EAGLE-3 or DFlash layout) as a speculators head for the target at
    ``target``."""
    import torch

    official = json.loads((head / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    config = speculators_config(official, tokens, str(target), target_config["architectures"][0])
    weights = head / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (head / "pytorch_model.bin").is_file():
        state = torch.load(head / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{head}: no model.safetensors or pytorch_model.bin")
    write_speculators_files(out, config, state)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "head",
        type=Path,
        help="an EAGLE-3, P-EAGLE or DFlash head in the official layout (the kit's trainers write it)",
    )
    p.add_argument("out", type=Path, help="where the speculators head is written")
    p.add_argument("--target", type=Path, required=True, help="the target (verifier) checkpoint the head serves")
    p.add_argument(
        "--tokens",
        type=int,
        default=3,
        help="speculative tokens per proposal (default 3; at most a DFlash block's masked slots)",
    )
    args = p.parse_args(argv)
    try:
        write_speculators_head(args.head, args.out, args.target, args.tokens)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f'wrote {args.out} (serve: vllm serve {args.target} --speculative-config \'{{"model": "{args.out}"}}\')')
    return 0


if __name__ == "__main__":
    sys.exit(main())
