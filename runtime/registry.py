"""The drafter registry: every draft kind, and for each what builds its module, its drafter on each backend, its
engine graphs and its client-server drafter.

A draft kind belongs to a family (feature drafts: EAGLE-1/2, HASS, GRIFFIN; EAGLE-3; Medusa heads; Mixture of
Attentions). The family says how a backend runs that kind of draft; the kind adds its module class, its usual
tree and the engines that cannot run it. The loader, the engine reader, the ONNX build, the CLIs, client-server
drafting and the tests look kinds up here: a new kind is one ``register`` call, a new family one class.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the registry imports without torch (kind names for --help); backends load on use
    from torch import nn

    from specdec_kit.runtime.core.contract import TargetStep
    from specdec_kit.runtime.decoding.drafting import Drafter, Tree
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.runtime.ort.backend import OrtGraph
    from specdec_kit.runtime.ort.graphs import GraphPlan

# the graphs an ONNX Runtime engine holds for a draft, by role; ``graph(role)`` opens one
GraphOpener = Callable[[str], "OrtGraph"]

# the fields of a Llama config that every feature draft's config.json carries (when the module's config has them)
LLAMA_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "head_dim",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
)


@dataclass(frozen=True)
class Ref:
    """An object named by its module and attribute, imported when first used: the registry loads without torch
    (``--help`` lists the kinds at once), and the registry stays below the layers it names (training)."""

    module: str
    name: str

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"


@dataclass(frozen=True)
class EngineForm:
    """How one serving engine runs a draft kind: the names it knows the draft by, and what the kit ships for it."""

    method: str  # the engine's speculative method: vLLM's ``method``, SGLang's algorithm, TensorRT-LLM's decoding
    architecture: str | None = None  # the draft config's ``architectures`` entry (None: the official layout's own)
    plugin: bool = False  # the engine loads the draft through the kit's plugin or drafter package
    official_layout: bool = False  # the engine's own class reads the official layout as the kit writes it
    speculators: bool = False  # the engine also reads the draft in the speculators format (its config names the kind)
    target_head_only: bool = False  # its class scores with the target's LM head alone: no reduced draft vocabulary
    options: dict[str, Any] = field(default_factory=dict)  # further keys of the engine's speculative config


# The engines a kind may have a form for; "tensorrt-llm-legacy" is TensorRT-LLM's engine route of releases <= 1.2.
SERVER_ENGINES = ("vllm", "sglang", "tensorrt-llm", "tensorrt-llm-legacy")


class DraftFamily(ABC):
    """How each backend runs one family of drafts."""

    name: str
    manifest_keys: tuple[str, ...]  # the engine manifest's ``draft`` keys the ONNX Runtime drafter reads
    weight_files: tuple[str, ...] = ("pytorch_model.bin", "model.safetensors")  # the files loading looks for
    saved_files: tuple[str, str] = ("pytorch_model.bin", "model.safetensors")  # what saving writes: torch, safetensors
    saved_prefix: str = ""  # a prefix the official layout's keys lack (saving strips it from the module's keys)
    client_drafting: bool = True  # whether a client-server client can draft with it (``client_drafter``)
    one_call: bool = False  # whether it drafts a whole cycle in one draft call whatever the tree (no level calls)
    tree_graphs: bool = False  # whether an ONNX Runtime engine drafts a dynamic tree's cycle in a graph of its own

    @abstractmethod
    def torch_drafter(self, module: nn.Module, target: TargetModel, tree: Tree) -> Drafter:
        """The drafter over the PyTorch module, drafting for ``target``."""

    @abstractmethod
    def ort_drafter(self, graph: GraphOpener, manifest: dict[str, Any], target: TargetStep, tree: Tree) -> Drafter:
        """The drafter over an ONNX Runtime engine's graphs (``manifest`` is the engine's)."""

    @abstractmethod
    def graph_plans(self, module: nn.Module, target: TargetModel) -> list[GraphPlan]:
        """The draft's ONNX graphs (the target's step is exported for every kind)."""

    def whole_tree_plan(
        self, module: nn.Module, target: TargetModel, tree: Tree, role: str = "draft_tree"
    ) -> GraphPlan | None:
        """A graph (named ``role``) that drafts a whole cycle of ``tree`` in one call, where this family has one."""
        return None

    def client_drafter(self, module: nn.Module, tail: TargetModel, tree: Tree) -> Drafter:
        """The drafter of a client-server client, over the client's target tail (``edge/tail.py``)."""
        raise ValueError(
            f"{self.name} drafts are not offered for client-server drafting "
            "(use an EAGLE-style or Mixture-of-Attentions draft)"
        )

    def check_tree(self, tree: Tree) -> None:
        """Refuse a tree this family cannot draft (with the reason)."""

    @abstractmethod
    def config_dict(self, module: nn.Module, base_model: str = "") -> dict[str, Any]:
        """The config.json of the family's official layout for ``module``."""

    @abstractmethod
    def manifest_spec(self, module: nn.Module) -> dict[str, Any]:
        """The engine manifest's ``draft`` fields for ``module`` (those ``manifest_keys`` name among them)."""

    def feature_layers(self, module: nn.Module) -> tuple[int, ...] | None:
        """The target layers whose entering hidden states the draft reads; None: the last layer's features."""
        return None

    def target_for(self, target: TargetModel, module: nn.Module) -> TargetModel:
        """The target as this family's drafts read it: itself, or a view returning the tapped layers."""
        layers = self.feature_layers(module)
        return target if layers is None else target.tapped(layers)


def llama_fields(module: nn.Module) -> dict[str, Any]:
    """The Llama fields of a draft module's config, as the official layouts write them."""
    cfg = module.config.to_dict()
    out = {k: cfg[k] for k in LLAMA_CONFIG_KEYS if k in cfg and cfg[k] is not None}
    return {**out, **legacy_rope_fields(cfg), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def legacy_rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings as the official EAGLE, EAGLE-3 and GRIFFIN code reads them: top-level ``rope_theta`` and
    ``rope_scaling`` (null, or the scaling with both its ``rope_type`` and older ``type`` names). A config with only
    ``rope_parameters`` (how current transformers writes it) would run there at the default base of 10000."""
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in rope:
        return {}
    kind = rope.get("rope_type", "default")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} | {"type": kind} if kind != "default" else None
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


def attention_spec(module: nn.Module) -> dict[str, Any]:
    """The manifest fields of a draft with its own decoder layers (the shape of its KV cache and of its layers)."""
    layers, heads, dim = module.attention_shape
    cfg = module.config
    return {
        "num_hidden_layers": layers,
        "num_key_value_heads": heads,
        "head_dim": dim,
        "num_attention_heads": cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
    }


class FeatureFamily(DraftFamily):
    """EAGLE-1/2, HASS, GRIFFIN: a draft over the target's last-layer features, ending in the target's LM head."""

    name = "feature"
    manifest_keys = ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size")
    tree_graphs = True

    def config_dict(self, module, base_model=""):
        """EAGLE's config: the Llama fields, the q/k/v and fc biases, a reduced draft vocabulary's size."""
        out = llama_fields(module) | {"qkv_bias": module.layers[0].self_attn.q_proj.bias is not None}
        if hasattr(module.fc, "bias"):  # EAGLE's fc is a linear layer; GRIFFIN's TGF always has its biases
            out["bias"] = module.fc.bias is not None
        if module.draft_vocab_size < module.config.vocab_size:
            out["draft_vocab_size"] = module.draft_vocab_size
        return out

    def manifest_spec(self, module):
        return attention_spec(module)

    def head(self, module: nn.Module, target: TargetModel) -> nn.Module:
        """What turns the draft's prediction feature into logits over the target's vocabulary: the target's LM head,
        or its rows of the draft's reduced vocabulary."""
        if getattr(module, "d2t", None) is None:
            return target.lm_head
        from specdec_kit.runtime.drafts.layers import TargetRowsHead

        return TargetRowsHead(target.lm_head, module)

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter, TorchFeatureStep
        from specdec_kit.runtime.decoding.joined_vocab import JoinedTokens

        head = self.head(module, target)
        joined = JoinedTokens.for_head(head)
        return FeatureTreeDrafter(TorchFeatureStep(module, head), tree, self.feature_layers(module), joined)

    def ort_drafter(self, graph, manifest, target, tree):
        from specdec_kit.runtime.core.trees import tree_from_dict
        from specdec_kit.runtime.decoding.drafting import FeatureTreeDrafter
        from specdec_kit.runtime.decoding.joined_vocab import JoinedTokens
        from specdec_kit.runtime.ort.backend import OrtFeatureDraftStep

        layers = manifest["draft"].get("feature_layers")
        fuse = graph("draft_fuse") if layers else None  # tapped layers are fused by the draft's fc, its own graph
        onnx = manifest.get("onnx", {})
        carried = {"draft_tree": onnx["whole_tree"]} if "whole_tree" in onnx else {}
        carried.update(onnx.get("extra_whole_trees", {}))  # more trees' one-call graphs, by role
        role = next((role for role, spec in carried.items() if tree_from_dict(spec) == tree), None)
        whole = (graph(role), tree) if role else None  # only this tree's graph is opened
        step = OrtFeatureDraftStep(graph("draft_step"), manifest["draft"], target.dtype, fuse=fuse, whole=whole)
        joined = None
        if "joined_vocab" in onnx:  # the engine's draft ids and target rows, beside its graphs (``joined_vocab.py``)
            path = step.graph.path.parent / onnx["joined_vocab"]
            joined = JoinedTokens.of_engine(path, step.graph.device, target.dtype)
        return FeatureTreeDrafter(step, tree, tuple(layers) if layers else None, joined)

    def graph_plans(self, module, target):
        from specdec_kit.runtime.ort.graphs import feature_draft_plans

        return feature_draft_plans(module, self.head(module, target))

    def whole_tree_plan(self, module, target, tree, role="draft_tree"):
        """The draft's whole cycle as one graph, for a dynamic tree (``DraftTreeGraph``)."""
        from specdec_kit.runtime.core.trees import DynamicTreeConfig
        from specdec_kit.runtime.ort.graphs import draft_tree_plan

        if not self.tree_graphs or not isinstance(tree, DynamicTreeConfig):
            return None
        return draft_tree_plan(module, self.head(module, target), tree, role)

    def client_drafter(self, module, tail, tree):
        return self.torch_drafter(module, tail, tree)


class Eagle3Family(FeatureFamily):
    """EAGLE-3: a feature draft over the hidden states entering three target layers (fused by its ``fc``), ending
    in its own head over a reduced vocabulary mapped onto the target's (``DraftVocabHead``)."""

    name = "eagle3"
    manifest_keys = FeatureFamily.manifest_keys + ("draft_vocab_size", "feature_layers")
    client_drafting = False

    def feature_layers(self, module):
        return module.feature_layers

    def config_dict(self, module, base_model=""):
        """The reference's fields, and the layer ids as vLLM and SpecForge write them."""
        out = llama_fields(module) | {"draft_vocab_size": module.draft_vocab_size}
        if module.target_hidden_size != module.hidden_size:
            out["target_hidden_size"] = module.target_hidden_size
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(module.feature_layers),
            "use_aux_hidden_state": True,
        }
        return out

    def manifest_spec(self, module):
        return attention_spec(module) | {
            "draft_vocab_size": module.draft_vocab_size,
            "feature_layers": list(module.feature_layers),
            "target_hidden_size": module.target_hidden_size,
        }

    def head(self, module, target):
        from specdec_kit.runtime.drafts.layers import DraftVocabHead

        return DraftVocabHead(module)

    def graph_plans(self, module, target):
        from specdec_kit.runtime.ort.graphs import fuse_plan

        return [*super().graph_plans(module, target), fuse_plan(module)]

    def client_drafter(self, module, tail, tree):
        raise ValueError(
            "eagle3 drafts are not offered for client-server drafting: they read three target layers "
            "from the server's forward, and the client's tail runs only the last ones "
            "(use an EAGLE-style or Mixture-of-Attentions draft)"
        )


class ParallelEagle3Family(Eagle3Family):
    """P-EAGLE: an EAGLE-3 draft that proposes a cycle's tokens from one forward (``ParallelDrafter``): the context
    pairs, then masked slots (``mask_hidden``, ``mask_token_id``) after each row's last one."""

    name = "peagle"
    one_call = True
    tree_graphs = False  # its one draft call per cycle is already the step graph's
    manifest_keys = Eagle3Family.manifest_keys + ("mask_token_id", "parallel_draft_tokens", "mask_hidden")

    def check_tree(self, tree):
        from specdec_kit.runtime.decoding.parallel_drafting import check_parallel_tree

        check_parallel_tree(tree)

    def config_dict(self, module, base_model=""):
        """EAGLE-3's, with the mask token where vLLM looks for it and the proposals a forward was trained for."""
        return super().config_dict(module, base_model) | {
            "mask_token_id": module.mask_token_id,
            "parallel_draft_tokens": module.parallel_tokens,
        }

    def manifest_spec(self, module):
        """EAGLE-3's, with the masked slots' token and input (``mask_hidden``, a few thousand numbers: the engine's
        drafter feeds it through the ``draft_fuse`` graph like the target's taps)."""
        return super().manifest_spec(module) | {
            "mask_token_id": module.mask_token_id,
            "parallel_draft_tokens": module.parallel_tokens,
            "mask_hidden": module.mask_hidden.detach().float().flatten().tolist(),
        }

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.drafting import TorchFeatureStep
        from specdec_kit.runtime.decoding.parallel_drafting import ParallelDrafter

        step = TorchFeatureStep(module, self.head(module, target))
        mask = module.mask_hidden.detach()
        return ParallelDrafter(step, tree, module.feature_layers, mask, module.mask_token_id, module.parallel_tokens)

    def ort_drafter(self, graph, manifest, target, tree):
        import torch

        from specdec_kit.runtime.decoding.parallel_drafting import ParallelDrafter
        from specdec_kit.runtime.ort.backend import OrtFeatureDraftStep

        spec = manifest["draft"]
        step = OrtFeatureDraftStep(graph("draft_step"), spec, target.dtype, fuse=graph("draft_fuse"))
        mask = torch.tensor(spec["mask_hidden"], dtype=torch.float32)
        layers = tuple(spec["feature_layers"])
        return ParallelDrafter(step, tree, layers, mask, spec["mask_token_id"], spec["parallel_draft_tokens"])


class DFlashFamily(DraftFamily):
    """DFlash: block diffusion drafting (``BlockDrafter``): the context's keys and values projected from the target's
    tapped layers, then one block of the root and masked slots, with the target's embedding and LM head."""

    name = "dflash"
    one_call = True
    manifest_keys = (
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "vocab_size",
        "feature_layers",
        "mask_token_id",
        "block_size",
    )
    weight_files = ("model.safetensors", "pytorch_model.bin")
    saved_files = ("pytorch_model.bin", "model.safetensors")
    client_drafting = False

    def feature_layers(self, module):
        return module.feature_layers

    def check_tree(self, tree):
        from specdec_kit.runtime.decoding.parallel_drafting import check_parallel_tree

        check_parallel_tree(tree)

    def config_dict(self, module, base_model=""):
        """The official ``DFlashDraftModel`` config (a Qwen3 config), as vLLM and SGLang read it."""
        cfg = module.config.to_dict()
        keys = (*LLAMA_CONFIG_KEYS, "attention_bias")
        out = {k: cfg[k] for k in keys if k in cfg and cfg[k] is not None} | legacy_rope_fields(cfg)
        out |= {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": module.block_size,
            "dflash_config": {"mask_token_id": module.mask_token_id, "target_layer_ids": module.target_layer_ids},
        }
        if module.num_target_layers is not None:
            out["num_target_layers"] = module.num_target_layers
        if module.has_own_head:
            out["draft_vocab_size"] = module.draft_vocab_size
        return out

    def manifest_spec(self, module):
        return attention_spec(module) | {
            "feature_layers": list(module.feature_layers),
            "mask_token_id": module.mask_token_id,
            "block_size": module.block_size,
            "draft_vocab_size": module.draft_vocab_size,
        }

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.parallel_drafting import BlockDrafter, TorchBlockStep
        from specdec_kit.runtime.drafts.dflash import dflash_scoring_head

        step = TorchBlockStep(module, target.embed_tokens, dflash_scoring_head(module, target.lm_head))
        return BlockDrafter(step, tree, module.feature_layers, module.mask_token_id, module.block_size)

    def ort_drafter(self, graph, manifest, target, tree):
        from specdec_kit.runtime.decoding.parallel_drafting import BlockDrafter
        from specdec_kit.runtime.ort.backend import OrtBlockStep

        spec = manifest["draft"]
        step = OrtBlockStep(graph("dflash_context"), graph("dflash_block"), spec, target.dtype)
        return BlockDrafter(step, tree, tuple(spec["feature_layers"]), spec["mask_token_id"], spec["block_size"])

    def graph_plans(self, module, target):
        from specdec_kit.runtime.drafts.dflash import dflash_scoring_head
        from specdec_kit.runtime.ort.graphs import dflash_plans

        return dflash_plans(module, target.embed_tokens, dflash_scoring_head(module, target.lm_head))


class MedusaFamily(DraftFamily):
    """Medusa heads: one head per depth over the last verified feature; static trees only."""

    name = "medusa"
    manifest_keys = ("medusa_num_heads", "vocab_size")
    client_drafting = False
    weight_files = ("medusa_lm_head.pt", "medusa_lm_head.safetensors", "model.safetensors", "pytorch_model.bin")
    saved_files = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")  # the legacy layout
    saved_prefix = "medusa_head."

    def check_tree(self, tree):
        from specdec_kit.runtime.core.trees import StaticTree

        if not isinstance(tree, StaticTree):
            raise ValueError("Medusa heads draft static trees only (e.g. static:mc_sim_7b_63)")

    def config_dict(self, module, base_model=""):
        """Medusa's config (version 2 of the reference's)."""
        return {
            "medusa_num_heads": module.num_heads,
            "medusa_num_layers": module.num_layers,
            "base_model_name_or_path": base_model,
            "hidden_size": module.hidden_size,
            "vocab_size": module.vocab_size,
            "version": "2",
        }

    def manifest_spec(self, module):
        return {
            "medusa_num_heads": module.num_heads,
            "medusa_num_layers": module.num_layers,
            "hidden_size": module.hidden_size,
            "vocab_size": module.vocab_size,
        }

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.drafting import MedusaDrafter

        self.check_tree(tree)
        return MedusaDrafter(module, tree)

    def ort_drafter(self, graph, manifest, target, tree):
        from specdec_kit.runtime.decoding.drafting import MedusaDrafter
        from specdec_kit.runtime.ort.backend import OrtMedusaHeads

        self.check_tree(tree)
        return MedusaDrafter(OrtMedusaHeads(graph("medusa_heads"), manifest["draft"], target.dtype), tree)

    def graph_plans(self, module, target):
        from specdec_kit.runtime.ort.graphs import medusa_plans

        return medusa_plans(module, target)


class MoAFamily(DraftFamily):
    """Mixture of Attentions: LSA over the target's K/V of every layer, SA + CA, TLI through the target's last
    layers."""

    name = "moa"
    manifest_keys = ("moa_tli", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size")

    def config_dict(self, module, base_model=""):
        return llama_fields(module) | {
            "moa_tli": module.tli,
            "moa_lsa_heads": module.lsa.heads,
            "target_num_layers": module.target_num_layers,
            "target_kv_dim": module.target_kv_dim,
            "architectures": ["MoADraft"],
        }

    def manifest_spec(self, module):
        return attention_spec(module) | {"moa_tli": module.tli, "target_num_layers": module.target_num_layers}

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter, TorchMoAStep

        return MoATreeDrafter(TorchMoAStep(module, target), tree)

    def ort_drafter(self, graph, manifest, target, tree):
        from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter
        from specdec_kit.runtime.ort.backend import OrtMoAStep

        finish = "lm_head" if int(manifest["draft"].get("moa_tli", 0)) == 0 else "target_tail"
        graphs = {role: graph(role) for role in ("moa_memory", "moa_step", finish)}
        return MoATreeDrafter(OrtMoAStep(graphs, manifest["draft"], manifest["target"], target.dtype), tree)

    def graph_plans(self, module, target):
        from specdec_kit.runtime.ort.graphs import moa_plans

        return moa_plans(module, target)

    def client_drafter(self, module, tail, tree):
        """The client's CA memory arrives from the server (which runs LSA beside the target's layers)."""
        from specdec_kit.runtime.decoding.moa_drafting import MoATreeDrafter, TorchMoAStep

        return MoATreeDrafter(TorchMoAStep(module, tail), tree, lsa_from_target=False)


class LookupFamily(DraftFamily):
    """Model-free drafts (prompt lookup, suffix trees): no module and no graph; a kind's "module" is its settings
    (``core/lookup.py``), read from a config.json when one is given, the defaults otherwise. The tree (dynamic) bounds
    each row's proposal."""

    name = "lookup"
    manifest_keys = ("settings",)
    weight_files = ()
    client_drafting = False

    def check_tree(self, tree):
        from specdec_kit.runtime.decoding.lookup_drafting import lookup_budget

        lookup_budget(tree)

    def config_dict(self, module, base_model=""):
        import dataclasses

        return dataclasses.asdict(module)

    def manifest_spec(self, module):
        return {"settings": self.config_dict(module)}

    def torch_drafter(self, module, target, tree):
        from specdec_kit.runtime.decoding.lookup_drafting import LookupDrafter

        return LookupDrafter.of(module, tree)

    def ort_drafter(self, graph, manifest, target, tree):
        return self.torch_drafter(self.settings_of(manifest), target, tree)

    def settings_of(self, manifest: dict[str, Any]) -> Any:
        """The settings an engine's manifest holds for its kind."""
        kind = draft_kind(manifest["draft"]["kind"])
        return kind.build(manifest["draft"]["settings"], Path("manifest.json"), 0, 0)

    def graph_plans(self, module, target):
        return []


# Why an engine cannot run a family's drafts, by backend (the builder refuses with this text).
MOA_SERVER_ENGINES = (
    "TensorRT-LLM and SGLang would need a drafter that reads the target's KV cache of every layer (LSA) and runs "
    "the target's own last layers with draft-time KV entries (TLI): neither engine's EAGLE worker exposes the "
    "target's per-layer KV pool to the draft model or lets it run target layers, so both need a custom worker, "
    "not just a model class"
)
MOA_VLLM = (
    "vLLM's EAGLE proposer hands a draft model only the target's last hidden states (EAGLE-3: a few layers' "
    "hidden states), never the target's per-layer KV cache that LSA attends over, and it cannot run the target's "
    "own last layers with draft-time KV entries (TLI); it would need a proposer of its own, not just a model class"
)
SGLANG_ALGORITHMS = "EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH, DSPARK"
MEDUSA_SGLANG = f"SGLang has no Medusa decoding (its algorithms: {SGLANG_ALGORITHMS})"
PEAGLE_SGLANG = (
    f"SGLang has no parallel drafting for EAGLE-3 heads (its algorithms: {SGLANG_ALGORITHMS}): its EAGLE3 worker "
    "runs the draft once per token and loads no mask_hidden; its DFLASH and DSPARK workers read other drafts"
)
PEAGLE_TRTLLM = (
    "TensorRT-LLM's Eagle3DecodingConfig has no parallel drafting: its EAGLE-3 drafter runs one forward per draft "
    "token and loads no mask_hidden"
)
DFLASH_TRTLLM = (
    "TensorRT-LLM 1.2.1, the kit's pinned release, has no DFlash decoding config in its llm_args.py (later releases "
    "add DFlashDecodingConfig)"
)
MEDUSA_VLLM = (
    "vLLM's Medusa method proposes each head's top-1 only (a chain), so the kit's Medusa engine, defined by its "
    "tree of choices, would not run as built; vLLM would need tree proposals and tree attention in its verifier"
)


@dataclass(frozen=True)
class DraftKind:
    """One ``--draft`` choice."""

    name: str
    family: DraftFamily
    builder: Ref  # its module builder: (config, file, target hidden, target vocab, target shape) -> module
    description: str
    default_tree: str = "dynamic"
    refused_backends: dict[str, str] = field(default_factory=dict)  # backend -> why it cannot run this kind
    engines: dict[str, EngineForm] = field(default_factory=dict)  # server engine -> how it runs this kind
    trainer: Ref | None = None  # the ``Trainer`` that trains heads of this kind (None: trained as another kind)
    zoo_folder: str = ""  # its head in the demo zoo (default: the kind's name)
    zoo_variants: tuple[str, ...] = ()  # further zoo heads of this kind (folders), e.g. other settings of it

    @property
    def model_free(self) -> bool:
        """Whether it drafts without a trained module (its "module" is its settings)."""
        return self.family.name == "lookup"

    @property
    def sized_for_cpu(self) -> bool:
        """Whether a CPU-sized tree (fewer draft calls) replaces its own: not for a kind that makes no draft calls
        per level (model-free, or one call a cycle)."""
        return not (self.model_free or self.family.one_call)

    def build(
        self,
        config: dict[str, Any],
        file: Path,
        target_hidden: int,
        target_vocab: int,
        target_shape: tuple[int, int] | None = None,
    ) -> nn.Module:
        return self.builder.resolve()(config, file, target_hidden, target_vocab, target_shape)

    def refusal(self, backend: str) -> str | None:
        """Why ``backend`` cannot run this kind, or None when it can."""
        reason = self.refused_backends.get(backend)
        if reason is None:
            return None
        from specdec_kit.runtime.core.manifest import BACKENDS

        runs_on = [b for b in BACKENDS if b not in self.refused_backends]
        return f"--draft {self.name} builds for --backend {' or '.join(runs_on)}. {reason}"

    def engine_form(self, engine: str) -> EngineForm:
        """How ``engine`` runs this kind; a ValueError naming the engines that do when it has no form for it."""
        form = self.engines.get(engine)
        if form is None:
            raise ValueError(
                f"--draft {self.name} has no {engine} form in the kit (it has: {', '.join(self.engines) or 'none'})"
            )
        return form


_KINDS: dict[str, DraftKind] = {}


def register(kind: DraftKind) -> DraftKind:
    if kind.name in _KINDS or kind.name == "none":
        raise ValueError(f"draft kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def zoo_heads() -> dict[str, tuple[str, str]]:
    """The demo zoo's heads: name -> (draft kind, folder under the zoo); each head kind's, then its variants."""
    kinds = {name: _KINDS[name] for name in head_kinds()}
    heads = {name: (name, kind.zoo_folder or name) for name, kind in kinds.items()}
    return heads | {variant: (name, variant) for name, kind in kinds.items() for variant in kind.zoo_variants}


def draft_kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order (``none``, plain decoding, is not one)."""
    return tuple(_KINDS)


def head_kinds() -> tuple[str, ...]:
    """The kinds that draft with a trained module (a checkpoint to load)."""
    return tuple(name for name, kind in _KINDS.items() if not kind.model_free)


def lookup_kinds() -> tuple[str, ...]:
    """The model-free kinds (prompt lookup, suffix trees)."""
    return tuple(name for name, kind in _KINDS.items() if kind.model_free)


def hybrid_parts(spec: str) -> tuple[str, str | None]:
    """``griffin+suffix`` -> ("griffin", "suffix"); a plain kind -> (kind, None). A hybrid is a head kind that drafts
    dynamic trees over a feature draft (GRIFFIN, EAGLE-2, HASS, EAGLE-3) plus a model-free kind."""
    head, plus, lookup = spec.partition("+")
    if not plus:
        draft_kind(spec)
        return spec, None
    if lookup not in lookup_kinds():
        raise ValueError(f"draft {spec!r}: after '+' comes a model-free kind ({', '.join(lookup_kinds())})")
    if head not in hybrid_heads():
        raise ValueError(f"draft {spec!r}: a hybrid's head is one of {', '.join(hybrid_heads())}, not {head!r}")
    return head, lookup


def hybrid_heads() -> tuple[str, ...]:
    """The kinds a hybrid merges with a model-free kind: feature drafts on dynamic trees (the merge ranks the head's
    nodes by their path probabilities)."""
    return tuple(
        name
        for name, kind in _KINDS.items()
        if isinstance(kind.family, FeatureFamily) and kind.default_tree.startswith("dynamic")
    )


def draft_choices() -> tuple[str, ...]:
    """Every ``--draft`` the runtime takes: the kinds, then each hybrid (a head kind + a model-free kind)."""
    return (*draft_kinds(), *(f"{h}+{m}" for h in hybrid_heads() for m in lookup_kinds()))


def client_draft_kinds() -> tuple[str, ...]:
    """The kinds a client-server client can draft with."""
    return tuple(name for name, kind in _KINDS.items() if kind.family.client_drafting)


def draft_kind(name: str) -> DraftKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown draft kind {name!r}; expected one of {list(_KINDS)}") from None


def drafter_for(kind: str, module: nn.Module, target: TargetModel, tree: Tree) -> Drafter:
    """The PyTorch drafter of ``kind`` over a loaded draft module."""
    return draft_kind(kind).family.torch_drafter(module, target, tree)


def lookup_drafter(kind: str, settings: Any = None, tree: Tree | None = None) -> Drafter:
    """A model-free kind's drafter (it reads no target): on ``settings`` (None: the kind's defaults) and ``tree``
    (None: its registered one)."""
    from specdec_kit.runtime.core.trees import parse_tree_spec

    spec = draft_kind(kind)
    if not spec.model_free:
        raise ValueError(f"{kind!r} is not a model-free kind; expected one of {list(lookup_kinds())}")
    settings = default_settings(kind) if settings is None else settings
    return spec.family.torch_drafter(settings, None, tree or parse_tree_spec(spec.default_tree))


def default_settings(kind: str) -> Any:
    """A model-free kind's default settings."""
    return draft_kind(kind).build({}, Path(f"{kind} defaults"), 0, 0)


def kinds_for_engine(engine: str) -> tuple[str, ...]:
    """The kinds ``engine`` has a form for (``SERVER_ENGINES``)."""
    return tuple(name for name, kind in _KINDS.items() if engine in kind.engines)


def trainable_kinds() -> tuple[str, ...]:
    """The kinds the kit trains (``specdec-train-head --method``)."""
    return tuple(name for name, kind in _KINDS.items() if kind.trainer is not None)


def _loader(name: str) -> Ref:
    return Ref("specdec_kit.runtime.drafts.loading", name)


def _trainer(module: str) -> Ref:
    return Ref(f"specdec_kit.train.{module}", "TRAINER")


# How the server engines run the EAGLE-style layout (EAGLE-1/2, HASS): vLLM and TensorRT-LLM through the kit's
# plugin classes (vLLM's own EAGLE class drops fc.bias), SGLang through its own class with the weight map checked.
EAGLE_ENGINES = {
    "vllm": EngineForm("eagle", "EagleSpecdecLlamaForCausalLM", plugin=True),
    "sglang": EngineForm("EAGLE", "LlamaForCausalLMEagle"),
    "tensorrt-llm": EngineForm("Eagle3", "SpecdecEagleLlama", plugin=True),
    "tensorrt-llm-legacy": EngineForm("Eagle", "EagleForCausalLM"),
}


# A model-free kind's tree: up to 24 nodes on paths of up to 16 tokens, 2 children per node (copying pays in long runs).
LOOKUP_TREE = "dynamic:24:15:2"


def _register_builtin() -> None:
    feature, eagle3, medusa, moa = FeatureFamily(), Eagle3Family(), MedusaFamily(), MoAFamily()
    peagle, dflash = ParallelEagle3Family(), DFlashFamily()
    lookup = LookupFamily()
    register(
        DraftKind(
            "griffin",
            feature,
            _loader("build_griffin"),
            "GRIFFIN: TGF + TEH draft, token-alignable training",
            engines={
                "vllm": EngineForm("eagle", "EagleSpecdecGriffinForCausalLM", plugin=True),
                "sglang": EngineForm("EAGLE", "GriffinLlamaForCausalLM", plugin=True),
                "tensorrt-llm": EngineForm("Eagle3", "SpecdecGriffinLlama", plugin=True),
            },
            trainer=_trainer("heads"),
        )
    )
    register(
        DraftKind(
            "eagle",
            feature,
            _loader("build_eagle"),
            "EAGLE-1: feature draft on a static tree",
            default_tree="static:eagle1_default",
            engines=EAGLE_ENGINES,
            trainer=_trainer("heads"),
        )
    )
    register(
        DraftKind(
            "eagle2",
            feature,
            _loader("build_eagle"),
            "EAGLE-2: EAGLE weights on dynamic trees",
            engines=EAGLE_ENGINES,
            zoo_folder="eagle",
        )
    )
    register(
        DraftKind(
            "hass",
            feature,
            _loader("build_eagle"),
            "HASS: EAGLE layout, harmonized training, dynamic trees",
            engines=EAGLE_ENGINES,
            trainer=_trainer("heads"),
        )
    )
    register(
        DraftKind(
            "eagle3",
            eagle3,
            _loader("build_eagle3"),
            "EAGLE-3: three target layers fused, own reduced-vocabulary head, training-time test",
            engines={  # every engine's own EAGLE-3 class reads the official layout
                "vllm": EngineForm("eagle3", "Eagle3LlamaForCausalLM", official_layout=True, speculators=True),
                "sglang": EngineForm("EAGLE3", "LlamaForCausalLMEagle3", official_layout=True),
                "tensorrt-llm": EngineForm("Eagle3", official_layout=True),
            },
            trainer=_trainer("eagle3"),
        )
    )
    register(
        DraftKind(
            "peagle",
            peagle,
            _loader("build_peagle"),
            "P-EAGLE: an EAGLE-3 draft proposing a cycle's tokens from one forward (masked slots)",
            default_tree="dynamic:4:3:1",
            refused_backends={"sglang": PEAGLE_SGLANG, "tensorrt-llm": PEAGLE_TRTLLM},
            engines={  # vLLM's own EAGLE-3 class with parallel drafting on reads mask_hidden and mask_token_id
                "vllm": EngineForm(
                    "eagle3",
                    "Eagle3LlamaForCausalLM",
                    official_layout=True,
                    speculators=True,
                    options={"parallel_drafting": True},
                ),
            },
            trainer=_trainer("eagle3"),
        )
    )
    register(
        DraftKind(
            "dflash",
            dflash,
            _loader("build_dflash"),
            "DFlash: block diffusion, a block of masked slots drafted in one forward over the target's states",
            default_tree="dynamic:8:6:1",
            refused_backends={"tensorrt-llm": DFLASH_TRTLLM},
            engines={  # vLLM's and SGLang's own DFlash classes read the official layout (SGLang's: no draft vocabulary)
                "vllm": EngineForm("dflash", "DFlashDraftModel", official_layout=True, speculators=True),
                "sglang": EngineForm("DFLASH", "DFlashDraftModel", official_layout=True, target_head_only=True),
            },
            trainer=_trainer("dflash"),
        )
    )
    register(
        DraftKind(
            "medusa",
            medusa,
            _loader("build_medusa"),
            "Medusa heads on a static tree",
            default_tree="static:mc_sim_7b_63",
            refused_backends={"vllm": MEDUSA_VLLM, "sglang": MEDUSA_SGLANG},
            engines={"tensorrt-llm-legacy": EngineForm("Medusa", "MedusaForCausalLM")},
            trainer=_trainer("heads"),
        )
    )
    register(
        DraftKind(
            "moa",
            moa,
            _loader("build_moa"),
            "Mixture of Attentions (LSA, SA + CA, TLI)",
            refused_backends={"tensorrt-llm": MOA_SERVER_ENGINES, "sglang": MOA_SERVER_ENGINES, "vllm": MOA_VLLM},
            trainer=_trainer("moa"),
            zoo_variants=("moa_tli0",),
        )
    )
    register(
        DraftKind(
            "ngram",
            lookup,
            Ref("specdec_kit.runtime.core.lookup", "ngram_settings"),
            "prompt lookup: what followed the latest n-gram earlier in the prompt and output (no head)",
            default_tree=LOOKUP_TREE,
            engines={  # no draft weights: each engine's own method (export/servers/lookup.py says how they differ)
                "vllm": EngineForm("ngram"),
                "sglang": EngineForm("NGRAM"),
                "tensorrt-llm": EngineForm("NGram"),
            },
        )
    )
    register(
        DraftKind(
            "suffix",
            lookup,
            Ref("specdec_kit.runtime.core.lookup", "suffix_settings"),
            "SuffixDecoding: frequency-scored suffix trees over this request and earlier responses (no head)",
            default_tree=LOOKUP_TREE,
            engines={"vllm": EngineForm("suffix"), "sglang": EngineForm("NGRAM"), "tensorrt-llm": EngineForm("SA")},
        )
    )


_register_builtin()
