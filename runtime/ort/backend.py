"""ONNX Runtime backend: the engine's graphs behind the same calls the PyTorch modules answer.

Each class implements a protocol of ``runtime/core/contract.py`` beside its PyTorch counterpart: ``OrtTarget``
(``TargetStep``, like ``TargetModel``), ``OrtFeatureDraftStep`` (``FeatureStep``, like ``TorchFeatureStep``),
``OrtMedusaHeads`` (``MedusaStep``, like ``MedusaHeads``) and ``OrtMoAStep`` (a ``MoAStep``, like
``TorchMoAStep``); the generation loop, tree search and verification are the runtime's own.
The runtime's ``KVCache`` stays the one cache: each call binds every layer's whole key and value buffer as that
layer's input, in place, and writes the graph's present keys/values back into the new tokens' slots. Tensors cross
into ONNX Runtime through I/O binding on their own memory: nothing copies the past, on CPU or CUDA. These caches
grow in ``CACHE_BLOCK``-slot steps, so the slots a graph reads past the longest row stay few.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from specdec_kit.runtime.core.coupling import DrawCoupling
from specdec_kit.runtime.core.cpu import process_threads
from specdec_kit.runtime.core.kv_cache import KVCache
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.moa_drafting import MoAStep
from specdec_kit.runtime.drafts.layers import PromptVocab
from specdec_kit.runtime.models.target import TargetOutput
from specdec_kit.runtime.ort.graphs import VOCAB_INPUTS, cache_names, past_names

CACHE_BLOCK = 64  # slots a cache grows by: reading up to this many spare slots beats copying the past every call
NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_}


def providers_for(device: torch.device) -> list[str | tuple[str, dict[str, int]]]:
    """CUDA execution provider when the device is CUDA (and ONNX Runtime has it), else CPU."""
    import onnxruntime as ort

    if device.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError(
                "device is CUDA but this onnxruntime has no CUDAExecutionProvider; install onnxruntime-gpu "
                f"(available: {ort.get_available_providers()})"
            )
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OrtGraph:
    """One ``InferenceSession``; ``run`` binds torch tensors as inputs and preallocated outputs.

    Each thread keeps one I/O binding and rebinds only the inputs, and the outputs written into given memory, whose
    memory or shape changed: a step's cache buffers (two per layer, the target step's bound as inputs and outputs)
    stay where they are from call to call, so a decoding step binds its few new tensors (SmolLM2's target step: 65
    inputs and 62 outputs, of which 5 and 2 are new each step)."""

    def __init__(self, path: str | Path, device: torch.device, threads: int | None = None, optimize: bool = False):
        self.path = Path(path)
        self.device = device
        self.threads, self.optimize = threads, optimize
        self.packed_matmul = "off"  # whether the session runs the kit's PackedMatMul, and if not, why
        self._open()
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.seconds, self.calls = 0.0, 0  # inside the session's runs: what profiles split by graph

    def _open(self, profile_prefix: str | None = None) -> None:
        """(Re)create the session and forget the bindings; with ``profile_prefix``, ONNX Runtime's profiler records
        every node's time into a JSON file of that prefix."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        # The saved graphs are already optimized at build time; re-running the passes costs load time only.
        options.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL if self.optimize else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        )
        # On a CPU, the cores this process may run on, or OMP_NUM_THREADS (ONNX Runtime's own count is the
        # machine's, whatever cpuset or taskset confines the process).
        if self.threads or self.device.type == "cpu":
            options.intra_op_num_threads = self.threads or process_threads()
        options.log_severity_level = 3
        # Workers spin between one node's parallel work and the next (a decoding step is a few hundred of them, and
        # waking a sleeping worker for each costs SmolLM2-135M about 15% of its step on 2 cores), and stop spinning
        # when the run ends: between runs the runtime's own torch ops (tree search, verification) need the cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        if profile_prefix:
            options.enable_profiling = True
            options.profile_file_prefix = profile_prefix
        self.session_path = self._packed_path(options) or self.path  # the graph the session reads
        self.session = ort.InferenceSession(str(self.session_path), options, providers=providers_for(self.device))
        self._per_thread = threading.local()

    def _packed_path(self, options) -> Path | None:
        """On CPU, the graph with its constant-weight MatMuls as the kit's ``PackedMatMul`` (and its library
        registered in ``options``), where the library builds here and the graph is one the build optimized; else
        None, and the session reads the graph as built (``packed_matmul`` says which and why)."""
        from specdec_kit.runtime.ort.custom_ops import custom_op_library
        from specdec_kit.runtime.ort.packed_graphs import packed_graph

        if self.device.type != "cpu" or self.optimize:
            self.packed_matmul = "off: " + ("not on CPU" if self.device.type != "cpu" else "graph not yet optimized")
            return None
        ops = custom_op_library()
        if ops.library is None:
            self.packed_matmul = f"off: {ops.reason}"
            return None
        packed = packed_graph(self.path)
        if packed is None:
            self.packed_matmul = "off: no MatMul over constant float weights"
            return None
        options.register_custom_ops_library(str(ops.library))
        self.packed_matmul = "on"
        return packed

    def profile_nodes(self, prefix: str) -> None:
        """From now on, record every node's time (``end_node_profile`` returns the file)."""
        self._open(profile_prefix=prefix)

    def end_node_profile(self) -> Path:
        """Stop recording node times; the profiler's JSON file (Chrome trace events)."""
        written = Path(self.session.end_profiling())
        self._open()
        return written

    def _binding(self) -> tuple[Any, dict[str, tuple], dict[str, tuple]]:
        """This thread's I/O binding and what each input and each output name is bound to (address, shape, dtype)."""
        local = self._per_thread
        if not hasattr(local, "binding"):
            local.binding, local.bound, local.bound_out = self.session.io_binding(), {}, {}
        return local.binding, local.bound, local.bound_out

    def run(
        self,
        inputs: dict[str, torch.Tensor],
        outputs: Mapping[str, tuple[Sequence[int], torch.dtype] | torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Run once: ``outputs`` gives each output's (shape, dtype), for a new tensor, or the (contiguous) tensor to
        write it into, which may be an input's own memory (the target step's cache buffers)."""
        binding, bound, bound_out = self._binding()
        dev_type = "cuda" if self.device.type == "cuda" else "cpu"
        dev_id = self.device.index or 0
        keep = []  # the inputs' memory (a contiguous copy's too) must outlive the run
        for name in self.input_names:
            tensor = inputs[name].contiguous()
            keep.append(tensor)
            where = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if bound.get(name) != where:
                binding.bind_input(name, dev_type, dev_id, NUMPY_TYPES[tensor.dtype], list(tensor.shape), where[0])
                bound[name] = where
        result = {}
        for name in self.output_names:
            given = outputs[name]
            if isinstance(given, torch.Tensor):
                if not given.is_contiguous():
                    raise ValueError(f"{self.path.name}: output {name} must be written into contiguous memory")
                tensor = given
            else:  # a new tensor each call: the caller may still hold the last call's
                shape, dtype = given
                tensor = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            result[name] = tensor
            where = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if bound_out.get(name) != where:
                binding.bind_output(name, dev_type, dev_id, NUMPY_TYPES[tensor.dtype], list(tensor.shape), where[0])
                bound_out[name] = where
        started = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return result


def new_block_cache(
    layers: int, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    """A cache for graphs that read it in place: one block to start, grown by blocks as the rows need."""
    return KVCache.allocate(layers, batch, kv_heads, head_dim, CACHE_BLOCK, dtype, device, block=CACHE_BLOCK)


def _run_over_cache(
    graph: OrtGraph,
    cache: KVCache,
    pending_mask: torch.Tensor,
    feeds: dict[str, torch.Tensor],
    outputs: dict,
    first_layer: int = 0,
) -> dict[str, torch.Tensor]:
    """Run a buffer-in/present-out graph over ``cache`` (its layers from ``first_layer`` on): add the mask over
    the buffers + new keys and each layer's buffer to ``feeds``, then write the present keys/values into the new
    tokens' pending slots (``pending_mask`` [B, Q, offset + Q] as for ``KVCache.attention_mask``)."""
    q_len = pending_mask.shape[1]
    offset = pending_mask.shape[2] - q_len
    if offset == 0 and not bool(cache.lengths.any()):  # a prefill: no slot is visible yet, so the buffers go in
        cache.ensure_capacity(q_len)  # empty rather than as slots to mask out
        mask, width = pending_mask, 0
    else:
        mask, width = cache.buffer_and_new_mask(pending_mask), cache.capacity
    layers, bsz, heads, _, dim = cache.keys[first_layer:].shape
    buffers = [cache.keys[first_layer + i, :, :, :width] for i in range(layers)] + [
        cache.values[first_layer + i, :, :, :width] for i in range(layers)
    ]
    present = ((layers, bsz, heads, q_len, dim), cache.keys.dtype)
    out = graph.run(
        dict(feeds, attention_mask=mask, **dict(zip(past_names(layers), buffers))),
        dict(outputs, present_keys=present, present_values=present),
    )
    cache.write_all(out["present_keys"], out["present_values"], cache.slots(q_len, offset), first_layer)
    return out


def _cached_call(
    graph: OrtGraph,
    cache: KVCache,
    pending_mask: torch.Tensor,
    feeds: dict[str, torch.Tensor],
    logits_at: torch.Tensor,
    hidden: int,
    vocab: int,
    feature_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A target or feature-draft step: logits at ``logits_at`` and the features of every new token."""
    bsz, q_len = feeds["input_ids"].shape
    dtype = cache.keys.dtype
    out = _run_over_cache(
        graph,
        cache,
        pending_mask,
        dict(feeds, logits_index=logits_at),
        {"logits": ((bsz, logits_at.shape[1], vocab), dtype), feature_name: ((bsz, q_len, hidden), dtype)},
    )
    return out["logits"], out[feature_name]


def _run_in_place(
    graph: OrtGraph, cache: KVCache, pending_mask: torch.Tensor, feeds: dict[str, torch.Tensor], outputs: dict
) -> dict[str, torch.Tensor]:
    """Run a graph that writes the new tokens' keys/values into each layer's buffer itself (the target step, see
    ``SlotCache``): each buffer is bound as both the layer's input and its written output, so nothing is copied; the
    new tokens land at ``cache.slots(Q, offset)`` as ``_run_over_cache`` would write them."""
    q_len = pending_mask.shape[1]
    offset = pending_mask.shape[2] - q_len
    mask = cache.slot_mask(pending_mask)
    layers = cache.keys.shape[0]
    buffers = [cache.keys[i] for i in range(layers)] + [cache.values[i] for i in range(layers)]
    return graph.run(
        dict(feeds, attention_mask=mask, write_index=cache.lengths + offset, **dict(zip(past_names(layers), buffers))),
        dict(outputs, **dict(zip(cache_names(layers), buffers))),
    )


def _all_positions(bsz: int, q_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(q_len, device=device).expand(bsz, q_len)


class OrtTarget:
    """The target's tree-verification step on ONNX Runtime; see ``TargetModel.forward``."""

    def __init__(self, graph: OrtGraph, spec: dict, dtype: torch.dtype):
        self.graph, self.spec = graph, spec
        self.device, self.dtype = graph.device, dtype
        self.num_layers, self.num_kv_heads = spec["num_hidden_layers"], spec["num_key_value_heads"]
        self.head_dim, self.hidden_size, self.vocab_size = spec["head_dim"], spec["hidden_size"], spec["vocab_size"]
        self.max_context = spec["max_context"]
        self.architecture = spec["architecture"]
        self.feature_layers = tuple(spec["feature_layers"]) if spec.get("feature_layers") else None
        self.feature_size = self.hidden_size * len(self.feature_layers or [None])
        # On CPU the graphs' own pools do the compute; torch's workers, spinning after the loop's small ops, would
        # take their cores (SmolLM2's draft_tree call: 13 ms a cycle beside them, 10 with torch on one thread)
        self.glue_threads: int | None = 1 if self.device.type == "cpu" else None

    def eos_token_ids(self) -> list[int]:
        return list(self.spec.get("eos_token_ids", []))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return new_block_cache(self.num_layers, batch, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def __call__(self, tokens, positions, pending_mask, cache: KVCache, logits_at=None) -> TargetOutput:
        bsz, q_len = tokens.shape
        index = _all_positions(bsz, q_len, tokens.device) if logits_at is None else logits_at
        out = _run_in_place(
            self.graph,
            cache,
            pending_mask,
            {"input_ids": tokens, "position_ids": positions, "logits_index": index},
            {
                "logits": ((bsz, index.shape[1], self.vocab_size), self.dtype),
                "features": ((bsz, q_len, self.feature_size), self.dtype),
            },
        )
        return TargetOutput(logits=out["logits"], features=out["features"])


class OrtFeatureDraftStep:
    """A feature draft's step with the target's LM head folded in; see ``TorchFeatureStep``. EAGLE-3 drafts add a
    ``fuse`` graph (their ``fc``) that turns the target's tapped layers into the step's d-wide feature input. An
    engine built with a dynamic tree adds ``whole``: its ``draft_tree`` graph and that tree, which drafts the cycle
    in one call (``WholeTreeStep``)."""

    def __init__(
        self,
        graph: OrtGraph,
        spec: dict,
        dtype: torch.dtype,
        fuse: OrtGraph | None = None,
        whole: tuple[OrtGraph, DynamicTreeConfig] | None = None,
    ):
        self.graph, self.spec, self.dtype, self.fuse, self.whole = graph, spec, dtype, fuse, whole
        self.layers, self.heads, self.head_dim = (
            spec["num_hidden_layers"],
            spec["num_key_value_heads"],
            spec["head_dim"],
        )
        self.hidden_size, self.vocab_size = spec["hidden_size"], spec["vocab_size"]
        self._greedy_coupling: DrawCoupling | None = None

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return new_block_cache(self.layers, batch, self.heads, self.head_dim, self.dtype, self.graph.device)

    def _step_features(self, features: torch.Tensor) -> torch.Tensor:
        """The step's d-wide feature input (EAGLE-3: the target's tapped layers through the ``fuse`` graph)."""
        features = features.to(self.dtype)
        if self.fuse is not None and features.shape[-1] != self.hidden_size:
            shape = (*features.shape[:2], self.hidden_size)
            features = self.fuse.run({"hidden_states": features}, {"fused": (shape, self.dtype)})["fused"]
        return features

    @torch.inference_mode()
    def __call__(self, features, tokens, positions, pending_mask, cache, logits_at=None, vocab=None):
        bsz, q_len = tokens.shape
        index = _all_positions(bsz, q_len, tokens.device) if logits_at is None else logits_at
        feeds = {"input_ids": tokens, "hidden_states": self._step_features(features), "position_ids": positions}
        feeds.update(self._vocab_feeds(self.graph, bsz, vocab))
        return _cached_call(
            self.graph, cache, pending_mask, feeds, index, self.hidden_size, self.vocab_size, "hidden_states_out"
        )

    def _vocab_feeds(self, graph: OrtGraph, bsz: int, vocab: PromptVocab | None) -> dict:
        """A graph's joined-token inputs, where it takes them (a reduced vocabulary over the target's rows): the
        rows' own, or one padding slot each."""
        if VOCAB_INPUTS[0] not in graph.input_names:
            return {}
        if vocab is None:
            ids = torch.full((bsz, 1), -1, dtype=torch.long, device=graph.device)
            vocab = PromptVocab(ids, torch.zeros(bsz, 1, self.hidden_size, dtype=self.dtype, device=graph.device))
        return dict(zip(VOCAB_INPUTS, (vocab.ids, vocab.rows.to(self.dtype))))

    def drafts_whole(self, tree: object) -> bool:
        return self.whole is not None and tree == self.whole[1]

    @torch.inference_mode()
    def whole_tree(self, features, tokens, positions, pending_mask, cache, root_index, coupling=None, vocab=None):
        if self.whole is None:
            raise RuntimeError("this engine has no draft_tree graph for its tree (drafts_whole says so)")
        graph, tree = self.whole
        bsz = tokens.shape[0]
        nodes = (bsz, tree.total_tokens)  # a dynamic tree always fills its budget
        if coupling is None:  # every row greedy: inverse temperatures 0, and the noise is not read
            coupling = self._uncoupled(bsz, tree.depth + 1)
        feeds = {
            "input_ids": tokens,
            "hidden_states": self._step_features(features),
            "position_ids": positions,
            "root_index": root_index,
            "draw_noise": coupling.noise[:, : tree.depth + 1],
            "draw_inv_temperature": coupling.inv_temperature,
            **self._vocab_feeds(graph, bsz, vocab),
        }
        out = _run_over_cache(
            graph,
            cache,
            pending_mask,
            feeds,
            {
                "tree_tokens": (nodes, torch.int64),
                "tree_parents": (nodes, torch.int64),
                "tree_scores": (nodes, torch.float32),
            },
        )
        return out["tree_tokens"], out["tree_parents"], out["tree_scores"]

    def _uncoupled(self, batch: int, levels: int) -> DrawCoupling:
        """A greedy batch's coupling inputs, kept between calls (a graph without them never reads them)."""
        kept = self._greedy_coupling
        if kept is None or kept.noise.shape[:2] != (batch, levels):
            dev = self.graph.device
            kept = DrawCoupling(torch.zeros(batch, levels, self.vocab_size, device=dev), torch.zeros(batch, device=dev))
            self._greedy_coupling = kept
        return kept


class OrtBlockStep:
    """A DFlash draft on ONNX Runtime (``BlockStep``; see ``TorchBlockStep``): the ``dflash_context`` graph projects
    the context into keys and values, the ``dflash_block`` graph runs a block over the cache in place."""

    def __init__(self, context: OrtGraph, block: OrtGraph, spec: dict, dtype: torch.dtype):
        self.context_graph, self.block_graph, self.spec, self.dtype = context, block, spec, dtype
        self.layers, self.heads, self.head_dim = (
            spec["num_hidden_layers"],
            spec["num_key_value_heads"],
            spec["head_dim"],
        )
        self.vocab_size = spec["vocab_size"]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return new_block_cache(self.layers, batch, self.heads, self.head_dim, self.dtype, self.block_graph.device)

    @torch.inference_mode()
    def context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        bsz, width = positions.shape
        shape = ((self.layers, bsz, self.heads, width, self.head_dim), self.dtype)
        out = self.context_graph.run(
            {"hidden_states": features.to(self.dtype), "position_ids": positions},
            {"context_keys": shape, "context_values": shape},
        )
        cache.ensure_capacity(cache.key_length(width))
        cache.write_all(out["context_keys"], out["context_values"], cache.slots(width))

    @torch.inference_mode()
    def __call__(self, tokens, positions, pending_mask, cache, logits_at=None):
        bsz, q_len = tokens.shape
        index = _all_positions(bsz, q_len, tokens.device) if logits_at is None else logits_at
        out = _run_over_cache(
            self.block_graph,
            cache,
            pending_mask,
            {"input_ids": tokens, "position_ids": positions, "logits_index": index},
            {"logits": ((bsz, index.shape[1], self.vocab_size), self.dtype)},
        )
        return out["logits"]


class OrtMedusaHeads:
    """Medusa heads on ONNX Runtime; see ``MedusaHeads.forward`` (features [B, d] -> logits [B, heads, V])."""

    def __init__(self, graph: OrtGraph, spec: dict, dtype: torch.dtype):
        self.graph, self.dtype = graph, dtype
        self.num_heads, self.vocab_size = spec["medusa_num_heads"], spec["vocab_size"]

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        shape = (features.shape[0], self.num_heads, self.vocab_size)
        return self.graph.run({"hidden_states": features.to(self.dtype)}, {"logits": (shape, self.dtype)})["logits"]


class OrtMoAStep(MoAStep):
    """A Mixture-of-Attentions step on ONNX Runtime: the LSA memory update, the SA + CA body and its finish (the
    target's last TLI layers, or the LM head) are graphs; the tree search and caches are the runtime's."""

    def __init__(self, graphs: dict[str, OrtGraph], spec: dict, target_spec: dict, dtype: torch.dtype):
        super().__init__()
        self.graphs, self.spec, self.target_spec, self._dtype = graphs, spec, target_spec, dtype
        self.tli = int(spec["moa_tli"])

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.spec
        return new_block_cache(
            1, batch, s["num_key_value_heads"], s["head_dim"], self._dtype, self.graphs["moa_step"].device
        )

    def memory_update(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        shape = (kv.shape[0], s["num_key_value_heads"], kv.shape[1], s["head_dim"])
        out = self.graphs["moa_memory"].run(
            {"target_kv": kv.to(self._dtype), "position_ids": positions},
            {"memory_keys": (shape, self._dtype), "memory_values": (shape, self._dtype)},
        )
        return out["memory_keys"], out["memory_values"]

    def hidden(self, tokens, positions, pending_mask, cache: KVCache) -> torch.Tensor:
        bsz, q_len = tokens.shape
        mem = self.memory_cache()
        m_len, visible = self.memory_visible(tokens.device)
        feeds = {
            "input_ids": tokens,
            "position_ids": positions,
            "memory_keys": mem.keys[0, :, :, :m_len],
            "memory_values": mem.values[0, :, :, :m_len],
            "memory_mask": visible,
        }
        out = _run_over_cache(
            self.graphs["moa_step"],
            cache,
            pending_mask,
            feeds,
            {"o_hat": ((bsz, q_len, self.spec["hidden_size"]), self._dtype)},
        )
        return out["o_hat"]

    def logits(self, o_hat, target_positions, target_pending) -> torch.Tensor:
        bsz, q_len, _ = o_hat.shape
        index = _all_positions(bsz, q_len, o_hat.device)
        logits = {"logits": ((bsz, q_len, self.target_spec["vocab_size"]), self._dtype)}
        if self.tli == 0:
            return self.graphs["lm_head"].run({"hidden_states": o_hat, "logits_index": index}, logits)["logits"]
        first = self.target_spec["num_hidden_layers"] - self.tli
        feeds = {"hidden_states": o_hat, "position_ids": target_positions, "logits_index": index}
        return _run_over_cache(
            self.graphs["target_tail"], self.bound_target_cache(), target_pending, feeds, logits, first
        )["logits"]


if TYPE_CHECKING:  # the type checker (basic mode, in the tests) holds each class to its protocol of the contract
    from specdec_kit.runtime.core.contract import FeatureStep, MedusaStep, TargetStep, WholeTreeStep

    def _implements_the_contract(
        target: OrtTarget, draft: OrtFeatureDraftStep, medusa: OrtMedusaHeads
    ) -> tuple[TargetStep, FeatureStep, WholeTreeStep, MedusaStep]:
        return target, draft, draft, medusa
