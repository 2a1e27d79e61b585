"""ONNX Runtime engines: export the graphs, check them, optimize them, prove them against PyTorch.

A build fails rather than ship a graph whose logits or features drift from the PyTorch modules
beyond tolerance, or whose greedy generation differs from the PyTorch backend's by one token.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specdec_kit.export.export_cache import OFF_HINT, cached_export
from specdec_kit.export.graph_fusions import fuse_graph
from specdec_kit.export.inputs import BuildError
from specdec_kit.export.onnx_graphs import export_plan
from specdec_kit.export.quantize import WeightFormat, quantize_graph
from specdec_kit.runtime.core.manifest import ONNX_GRAPH_INTERFACE
from specdec_kit.runtime.core.trees import tree_to_dict
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.decoding.joined_vocab import JOINED_VOCAB_FILE, joins_request_tokens, write_joined_vocab
from specdec_kit.runtime.models.target import TargetModel
from specdec_kit.runtime.ort.graphs import extra_tree_role, target_plan
from specdec_kit.runtime.registry import draft_kind

# float32 on CPU: the parity bound for logits/features (graph fusions reorder float sums).
PARITY_ATOL = {torch.float32: 2e-3, torch.float16: 5e-2}


@contextlib.contextmanager
def quiet_export():
    """The dynamo exporter reports every skipped optional op set; keep the build's own output readable."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def check_graph(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # onnx raises several types; all mean the same: the graph is invalid
        raise BuildError(f"{path}: onnx.checker rejected the exported graph ({exc})") from exc


def optimize_graph(raw: Path, optimized: Path, providers: list) -> None:
    """Run ONNX Runtime's graph optimizations once at build time and save the result.

    ``ORT_ENABLE_EXTENDED``, not ``ALL``: the layout transforms of ``ALL`` are specific to the build
    machine's CPU, and ONNX Runtime's documentation advises against saving them."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(optimized)
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", optimized.name + ".data"
    )
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.log_severity_level = 3
    ort.InferenceSession(str(raw), options, providers=providers)


def _example_tree(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A small branching tree (root, two children, a grandchild) as the parity test's pending block."""
    parents = [-1, 0, 0, 1, 3]
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return mask.expand(batch, n, n).to(device), (torch.tensor(depth) + length).expand(batch, n).to(device)


def target_parity(target: TargetModel, ort_target, vocab: int, seed: int = 0) -> dict[str, float]:
    """Max |difference| of logits and features (``<name>``), and the same over the PyTorch tensor's largest
    magnitude when that exceeds 1 (``<name>_relative``: deep layers' features reach hundreds): a prompt prefill,
    then a tree over rows of unequal length."""
    gen = torch.Generator().manual_seed(seed)
    dev = target.device
    lens = torch.tensor([7, 4])
    tokens = torch.randint(0, vocab, (2, 7), generator=gen).to(dev)
    ar = torch.arange(7, device=dev)
    causal = (ar[None, :] <= ar[:, None]).expand(2, 7, 7)
    worst = {"logits": 0.0, "features": 0.0, "logits_relative": 0.0, "features_relative": 0.0}
    caches = [target.new_cache(2, 32), ort_target.new_cache(2, 32)]
    outs = [m(tokens, ar.expand(2, 7), causal, c) for m, c in zip((target, ort_target), caches)]
    for c in caches:
        c.commit(ar.expand(2, 7), lens.to(dev))
    mask, pos = _example_tree(2, 0, dev)
    tree_tokens = torch.randint(0, vocab, (2, mask.shape[1]), generator=gen).to(dev)
    pos = pos + caches[0].lengths[:, None]
    outs += [m(tree_tokens, pos, mask, c) for m, c in zip((target, ort_target), caches)]
    for a, b in (outs[0:2], outs[2:4]):
        for name in ("logits", "features"):
            ref, got = getattr(a, name).float(), getattr(b, name).float()
            diff = float((ref - got).abs().max())
            worst[name] = max(worst[name], diff)
            worst[f"{name}_relative"] = max(worst[f"{name}_relative"], diff / max(1.0, float(ref.abs().max())))
    return worst


def greedy_identity(
    target: TargetModel, torch_drafter, ort_target, ort_drafter, prompts: list[list[int]], max_new_tokens: int = 24
) -> bool:
    """Greedy generation through the ONNX graphs equals the PyTorch backend's, token for token."""
    ref = SpeculativeGenerator(target, torch_drafter).generate(prompts, max_new_tokens)
    got = SpeculativeGenerator(ort_target, ort_drafter).generate(prompts, max_new_tokens)
    return all(a.tokens == b.tokens for a, b in zip(ref, got))


def quantized_greedy_checks(
    target: TargetModel, ort_target, ort_drafter, prompts: list[list[int]], max_new_tokens: int = 24
) -> dict[str, Any]:
    """A quantized engine's lossless check and its distance from the float model: speculation through the graphs
    equals the same graphs' plain decoding token for token (the engine's own target is the reference), and the share
    of greedy tokens plain decoding produces identically to the float PyTorch model's (position by position)."""
    speculative = SpeculativeGenerator(ort_target, ort_drafter).generate(prompts, max_new_tokens)
    plain = SpeculativeGenerator(ort_target, None).generate(prompts, max_new_tokens)
    floating = SpeculativeGenerator(target, None).generate(prompts, max_new_tokens)
    pairs = [(a, b) for p, f in zip(plain, floating) for a, b in zip(p.tokens, f.tokens)]
    return {
        "greedy_identical_to_plain": all(a.tokens == b.tokens for a, b in zip(speculative, plain)),
        "greedy_agreement_with_float": round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 4),
    }


def export_graph(plan, graphs: Path, step: Callable[[str], None]) -> None:
    """``graphs/<role>.onnx``: from the export cache where the same graph was exported before, else exported now."""
    with quiet_export():
        _, reused = cached_export(plan, graphs, export_plan)
    if reused:
        step(f"{plan.role}.onnx: exported before, taken from the export cache ({OFF_HINT})")


def build_onnx(
    staging: Path,
    target: TargetModel,
    draft_kind_name: str,
    draft_module,
    tree,
    manifest_target: dict,
    manifest_draft: dict,
    prompts: list[list[int]],
    step: Callable[[str], None],
    draft_tree: bool = True,
    target_weights: WeightFormat | None = None,
    draft_weights: WeightFormat | None = None,
    extra_trees: Sequence[Any] = (),
) -> dict[str, Any]:
    """Write graphs/ under ``staging``; return the manifest's ``artifacts`` and ``onnx`` sections. ``draft_tree``:
    add the draft's whole cycle as one graph where the kind and tree allow it (its export takes longer than the
    step's: the tree search is unrolled), and one more such graph for each of ``extra_trees`` (so that a drafter on
    any of them drafts in one call, as a tree search must compare them). ``target_weights`` / ``draft_weights``: the
    constant MatMuls of the target's / the draft's graphs quantized in that format (None: float). A quantized target
    is its own reference: the build proves speculation against the quantized graphs' plain decoding and reports,
    without bounding, the distance from PyTorch's float model."""
    import onnxruntime as ort

    from specdec_kit.runtime.ort.backend import OrtGraph, OrtTarget, providers_for

    family = draft_kind(draft_kind_name).family
    graphs = staging / "graphs"
    graphs.mkdir(parents=True)
    device = target.device
    providers = providers_for(device)
    step("exporting the target's tree-verification step to ONNX")
    target_graph = target_plan(target)
    export_graph(target_graph, graphs, step)
    step(f"exporting the {draft_kind_name} draft to ONNX")
    plans = family.graph_plans(draft_module, target)
    whole = family.whole_tree_plan(draft_module, target, tree) if draft_tree else None
    extras = {}  # role -> tree
    if whole is not None:
        plans.append(whole)
        for extra in extra_trees:  # the builder checked the kind has them and left out the engine's own tree
            plans.append(family.whole_tree_plan(draft_module, target, extra, extra_tree_role(extra)))
            extras[plans[-1].role] = extra
    for plan in plans:
        export_graph(plan, graphs, step)
    roles = [plan.role for plan in plans]
    opsets = {plan.role: plan.opset for plan in (target_graph, *plans)}
    joins = {}
    head = family.head(draft_module, target) if hasattr(family, "head") else None
    if joins_request_tokens(head):  # the drafter joins each request's tokens to the draft vocabulary
        write_joined_vocab(graphs / JOINED_VOCAB_FILE, head.ids, head.target_rows)
        joins = {"joined_vocab": JOINED_VOCAB_FILE}
    artifacts, quantized, fused = {}, {}, {}
    for role in ("target_step", *roles):
        step(f"fusing {role}.onnx's shared-input weight products, norms and rotary embeddings")
        fused[role] = fuse_graph(graphs / f"{role}.onnx")
        fmt = target_weights if role == "target_step" else draft_weights
        if fmt is not None:
            step(f"quantizing {role}.onnx's weights to {fmt.name} (MatMulNBits)")
            quantized[role] = quantize_graph(graphs / f"{role}.onnx", fmt)
        step(f"checking and optimizing {role}.onnx")
        raw, opt = graphs / f"{role}.onnx", graphs / f"{role}.optimized.onnx"
        check_graph(raw)
        optimize_graph(raw, opt, providers)
        artifacts[role], artifacts[f"{role}_optimized"] = (
            raw.relative_to(staging).as_posix(),
            opt.relative_to(staging).as_posix(),
        )

    step("checking ONNX Runtime against PyTorch (logits, features, greedy generation)")
    dtype = target.dtype
    ort_target = OrtTarget(OrtGraph(graphs / "target_step.optimized.onnx", device), manifest_target, dtype)
    parity = target_parity(target, ort_target, manifest_target["vocab_size"])
    whole_tree = {"whole_tree": tree_to_dict(tree)} if whole is not None else {}
    if extras:
        whole_tree["extra_whole_trees"] = {role: tree_to_dict(t) for role, t in extras.items()}
    manifest = {"target": manifest_target, "draft": manifest_draft, "onnx": {**whole_tree, **joins}}
    opened = functools.cache(lambda role: OrtGraph(graphs / f"{role}.optimized.onnx", device))  # one session a graph
    drafters = [
        (family.torch_drafter(draft_module, target, t), family.ort_drafter(opened, manifest, ort_target, t))
        for t in (tree, *extras.values())
    ]
    bound = None if target_weights else PARITY_ATOL.get(dtype, 5e-2)
    if bound is not None and max(parity["logits_relative"], parity["features_relative"]) > bound:
        raise BuildError(
            f"ONNX graph drifts from PyTorch: max |logits diff| {parity['logits']:.2e} "
            f"({parity['logits_relative']:.2e} of their largest magnitude), |features diff| "
            f"{parity['features']:.2e} ({parity['features_relative']:.2e}), bound {bound:.0e} relative"
        )
    for torch_drafter, ort_drafter in drafters:  # the engine's tree, then each extra tree's one-call graph
        if target_weights:
            checks = quantized_greedy_checks(target, ort_target, ort_drafter, prompts)
            if not checks["greedy_identical_to_plain"]:
                raise BuildError(
                    f"greedy speculation through the {target_weights.name} target differs from its own plain decoding"
                )
        else:
            checks = {
                "greedy_identical_to_torch": greedy_identity(target, torch_drafter, ort_target, ort_drafter, prompts)
            }
            if not checks["greedy_identical_to_torch"]:
                raise BuildError("greedy generation through the ONNX graphs differs from the PyTorch backend")
    weight_section = {}
    if target_weights:
        found = quantized["target_step"]
        weight_section["target"] = {
            **target_weights.manifest(),
            "quantized_matmuls": found["matmuls"],
            **({"stored_from_grid": found["on_grid"], "kept_float": found["kept_float"]} if "on_grid" in found else {}),
        }
    if draft_weights:
        counts = {role: n["matmuls"] for role, n in quantized.items() if role != "target_step"}
        weight_section["draft"] = {**draft_weights.manifest(), "quantized_matmuls": counts}
    provider_names = [p[0] if isinstance(p, tuple) else p for p in providers]
    return {
        "artifacts": artifacts,
        "onnx": {
            "opset": opsets,
            "graph_interface": ONNX_GRAPH_INTERFACE,
            "onnxruntime_version": ort.__version__,
            "optimized_for": provider_names[:1],
            "optimization_level": "ORT_ENABLE_EXTENDED",
            "fusions": fused,
            "parity_max_abs": {k: float(f"{parity[k]:.3e}") for k in ("logits", "features")},
            "parity_max_relative": {k: float(f"{parity[f'{k}_relative']:.3e}") for k in ("logits", "features")},
            "parity_bound": bound,
            **checks,
            **({"weights": weight_section} if weight_section else {}),
            **whole_tree,  # the tree the draft_tree graph drafts in one call
            **joins,  # beside the graphs: what a request's tokens join the draft vocabulary with
        },
    }
