"""EAGLE-3 and P-EAGLE heads in the speculators format, the one vLLM's own training project ships drafts in.

A speculators head is the draft's weights beside a ``config.json`` that says what it is (``speculators_model_type``),
the decoder layer it runs (``transformer_layer_config``, a Llama config), the EAGLE-3 fields (draft vocabulary, the
target layers it reads, where its norms sit) and how it proposes (``speculators_config``: greedy proposals of
``speculative_tokens``, and the verifier it was trained for). vLLM reads that config itself, so the head serves with
``--speculative-config '{"model": HEAD}'`` and no method.

    python -m specdec_kit.export.speculators zoo/eagle3 heads/eagle3-speculators --target zoo/target --tokens 3

The kit's EAGLE-3 layer keeps the hidden state from before its norm as the residual (the official EAGLE-3's choice),
so the config says ``norm_before_residual: false`` explicitly: a speculators config without it means the other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec_kit.runtime.drafts.speculators_format import OFFICIAL_LAYER, SPECULATORS_LAYER

LAYER_KEYS_LEFT_OUT = (
    "draft_vocab_size",
    "eagle_config",
    "architectures",
    "target_hidden_size",
    "mask_token_id",
    "parallel_draft_tokens",
)


def speculators_config(official: dict[str, Any], tokens: int, verifier: str, verifier_architecture: str) -> dict:
    """The speculators config of an EAGLE-3 or P-EAGLE head whose official ``config.json`` is ``official`` (a P-EAGLE
    head proposes at most the tokens one forward was trained for)."""
    if "draft_vocab_size" not in official or "eagle_config" not in official:
        raise ValueError("not an EAGLE-3 head's config: expected draft_vocab_size and eagle_config")
    if tokens < 1:
        raise ValueError(f"--tokens {tokens}: expected at least 1 speculative token")
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
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [verifier_architecture]},
        },
    }
    if official.get("target_hidden_size") is not None:
        out["target_hidden_size"] = official["target_hidden_size"]
    if parallel:
        out.update(mask_token_id=official["mask_token_id"], para_depths=official["parallel_draft_tokens"])
    return out


def write_speculators_head(head: Path, out: Path, target: Path, tokens: int) -> Path:
    """``out``: the head at ``head`` (official EAGLE-3 layout) as a speculators head for the target at ``target``."""
    import torch
    from safetensors.torch import save_file

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
    out.mkdir(parents=True, exist_ok=True)  # speculators' own names: its decoder layers as a list
    renamed = {k.replace(OFFICIAL_LAYER, SPECULATORS_LAYER, 1): v.contiguous() for k, v in state.items()}
    save_file(renamed, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "head", type=Path, help="an EAGLE-3 or P-EAGLE head in the official layout (the kit's trainers write it)"
    )
    p.add_argument("out", type=Path, help="where the speculators head is written")
    p.add_argument("--target", type=Path, required=True, help="the target (verifier) checkpoint the head serves")
    p.add_argument("--tokens", type=int, default=3, help="speculative tokens per proposal (default 3)")
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
