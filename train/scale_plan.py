"""Plans for training the heads of large targets (8B-70B) on GPU clusters, checked without weights.

A plan (``train/recipes/scale/*.json``) names the target by its config (shapes are all a plan needs), the head, the
data, the GPUs and the batch. ``check_plan`` builds the target and the head on the meta device, shards the head's
training step with FSDP2 exactly as the trainer does (``train/sharding.py``, over a fake process group of the
plan's world size, so no GPU and no weights are needed), and reports per GPU what the shards, the gathered weights,
the AdamW state, the frozen LM-head rows, the target (when its hidden states are online: whole, or its decoder
layers sharded by the trainer's own code) and the step's tensors take, whether that fits, how much disk offline hidden
states take, and the expected time (the step's FLOPs over the GPUs' bf16 peak at a stated utilisation: an estimate,
not a measurement).

    python -m specdec_kit.train.scale_plan train/recipes/scale/llama-3.1-8b-griffin-8xa100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1 << 30
RESERVE = 0.1  # of a GPU's memory kept free: the allocator's fragmentation, NCCL's buffers, the CUDA context
PLANS = Path(__file__).resolve().parent / "recipes" / "scale"
HIDDEN_STATES = ("online", "online-sharded", "offline")


@dataclass
class Plan:
    name: str
    target: dict  # a Hugging Face Llama config's fields
    method: str  # griffin, hass, eagle or eagle3
    passes: int  # forward passes per batch (GRIFFIN/HASS 3; EAGLE-3: its training-time-test steps)
    draft_vocab: int
    conversations: int
    answer_tokens: int  # per conversation, as the target regenerates them
    epochs: int
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float
    gpu_bf16_tflops: float
    utilization: float  # the share of the bf16 peak the step reaches (an assumption the plan states)
    tokens_per_gpu: int  # per micro-batch
    # online (the target in the loop, replicated on every GPU), online-sharded (its decoder layers sharded across the
    # GPUs with FSDP2, ``train/sharded_target.py``) or offline (cached shards)
    hidden_states: str
    why: str  # why this mode and this size fit this target

    @classmethod
    def read(cls, path: Path) -> "Plan":
        try:
            raw = json.loads(path.read_text())
            return cls(**raw)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the plan ({exc})") from None
        except TypeError as exc:
            raise ValueError(f"{path}: {exc} (expected the keys {list(cls.__dataclass_fields__)})") from None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Check:
    """What a plan needs, per GPU (bytes) and in all."""

    target_params: int
    head_params: int
    head_trainable: int
    shard_params: int  # this rank's share of the head's weights under FSDP2
    shard_shapes: dict  # a few parameters: whole shape -> local shape
    memory: dict  # per GPU, bytes, by part
    fits: bool
    offline_disk_bytes: int
    training_tokens: int
    hours: float

    def table(self, plan: Plan) -> str:
        lines = [f"{plan.name}: {plan.method} head for a {self.target_params / 1e9:.1f}B target on {plan.world} GPUs"]
        lines.append(
            f"  head: {self.head_params / 1e6:.0f}M parameters ({self.head_trainable / 1e6:.0f}M trained); "
            f"FSDP2 over {plan.world} ranks: {self.shard_params / 1e6:.1f}M on each"
        )
        for name, shapes in self.shard_shapes.items():
            lines.append(f"    {name}: {shapes[0]} -> {shapes[1]} on each rank")
        lines.append(f"  memory per GPU (of {plan.gpu_memory_gib:.0f} GiB, {RESERVE:.0%} kept free):")
        for part, size in self.memory.items():
            lines.append(f"    {part:<34} {size / GIB:8.2f} GiB")
        lines.append(
            f"    {'total':<34} {sum(self.memory.values()) / GIB:8.2f} GiB: {'fits' if self.fits else 'DOES NOT FIT'}"
        )
        lines.append(
            f"  data: {plan.conversations:,} conversations x {plan.answer_tokens} answer tokens = "
            f"{self.training_tokens / 1e6:.0f}M tokens, {plan.epochs} epochs; hidden states {plan.hidden_states}"
            + (
                f" ({self.offline_disk_bytes / 2**40:.2f} TiB of fp16 shards)"
                if plan.hidden_states == "offline"
                else ""
            )
        )
        lines.append(
            f"  expected time: {self.hours:.1f} h at {plan.utilization:.0%} of {plan.gpu_bf16_tflops:.0f} bf16 "
            "TFLOP/s per GPU (an estimate from the step's FLOPs)"
        )
        lines.append(f"  why: {plan.why}")
        return "\n".join(lines)


def fake_process_group(world: int) -> None:
    """A process group of ``world`` ranks in this one process, for sharding on the meta device (no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def meta_models(plan: Plan):
    """The target and the head (with its step module and frozen LM-head rows) on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_kit.runtime.models.target import TargetModel

    with torch.device("meta"):
        target = TargetModel(LlamaForCausalLM(LlamaConfig(**plan.target)))
        if plan.method == "eagle3":
            from specdec_kit.train.eagle3 import Eagle3Spec, Eagle3TrainingStep, new_eagle3

            spec = Eagle3Spec(ttt_length=plan.passes, draft_vocab=plan.draft_vocab)
            d2t = torch.zeros(plan.draft_vocab, dtype=torch.long)
            head = new_eagle3(target, spec, d2t, torch.zeros(target.vocab_size, dtype=torch.bool))
            rows = torch.nn.Module()  # its own LM head over the draft vocabulary is trained; nothing frozen beside it
            step = Eagle3TrainingStep(head, spec)
        else:
            from specdec_kit.train.heads import FeatureTrainingStep, HeadSpec, head_vocab, new_head

            spec = HeadSpec.defaults(plan.method, passes=plan.passes)
            vocab = (torch.zeros(plan.draft_vocab, dtype=torch.long), torch.zeros(target.vocab_size, dtype=torch.bool))
            head = new_head(plan.method, target, spec, vocab if plan.draft_vocab else None)
            rows, to_head = head_vocab(head, target)
            step = FeatureTrainingStep(head, rows, spec, to_head)
    for p in rows.parameters():
        p.requires_grad_(False)
    return target, head, rows, step


def check_plan(plan: Plan) -> Check:
    """Shard the plan's head on the meta device as the trainer does and size what every GPU holds."""
    import torch.distributed as dist

    from specdec_kit.train.sharded_target import shard_target
    from specdec_kit.train.sharding import ShardedStep

    if plan.hidden_states not in HIDDEN_STATES:
        raise ValueError(f"{plan.name}: hidden_states {plan.hidden_states!r}: expected one of {list(HIDDEN_STATES)}")
    target, head, rows, step = meta_models(plan)
    layers = target.hf_model.model.layers
    layer_params = sum(p.numel() for p in layers.parameters())
    local_layers = layer_params
    fake_process_group(plan.world)
    try:
        ShardedStep(step, head, rows, main=False)
        sharded = [(n, p) for n, p in step.named_parameters() if not n.startswith("lm_head.")]
        local = {n: tuple(p.to_local().shape) for n, p in sharded}
        if plan.hidden_states == "online-sharded":  # the trainer's own sharding of the target
            local_layers, _ = shard_target(target)
    finally:
        dist.destroy_process_group()
    trainable = sum(p.numel() for _, p in sharded if p.requires_grad)
    local_trainable = sum(p.to_local().numel() for _, p in sharded if p.requires_grad)
    local_all = sum(p.to_local().numel() for _, p in sharded)
    head_params = sum(p.numel() for _, p in sharded)
    target_params = sum(p.numel() for p in target.hf_model.parameters())
    if plan.hidden_states == "online":
        target_memory = {"target weights (bf16, online)": 2 * target_params}
    elif plan.hidden_states == "online-sharded":  # layer shards, two layers gathered (one running, one prefetched)
        target_memory = {
            "target layer shards (bf16)": 2 * local_layers,
            "target layers gathered (bf16, two)": 2 * 2 * layer_params // len(layers),
            "target embed, norm, LM head (bf16)": 2 * (target_params - layer_params),
        }
    else:
        target_memory = {}
    hidden, vocab = target.hidden_size, target.vocab_size
    tokens = plan.tokens_per_gpu
    memory = {
        "head shards (fp32 weights)": 4 * local_all,
        "gradient shards (fp32)": 4 * local_trainable,
        "AdamW state shards (2 x fp32)": 8 * local_trainable,
        "head gathered for the step (fp32)": 4 * (head_params - local_all),
        "frozen LM-head rows (fp32)": 4 * sum(p.numel() for p in rows.parameters()),
        **target_memory,
        "target logits and softmax (fp32)": 2 * 4 * tokens * vocab,
        "step activations (bf16, estimate)": tokens * plan.passes * (24 * hidden + 6 * target.config.intermediate_size)
        + tokens * plan.passes * 2 * 4 * plan.draft_vocab,
    }
    training_tokens = plan.conversations * plan.answer_tokens
    taps = 3 if plan.method == "eagle3" else 0
    head_flops = 6 * (trainable + hidden * plan.draft_vocab) * plan.passes  # forward and backward, each pass
    target_flops = 2 * target_params  # a forward per token: every epoch online, once offline
    total = training_tokens * (
        plan.epochs * head_flops + target_flops * (1 if plan.hidden_states == "offline" else plan.epochs)
    )
    seconds = total / (plan.world * plan.gpu_bf16_tflops * 1e12 * plan.utilization)
    names = [n for n, _ in sharded if n.endswith(("embed_tokens.weight", "fc.weight", "q_proj.weight"))][:3]
    return Check(
        target_params=target_params,
        head_params=head_params,
        head_trainable=trainable,
        shard_params=local_all,
        shard_shapes={n: (tuple(dict(sharded)[n].shape), local[n]) for n in names},
        memory=memory,
        fits=sum(memory.values()) <= (1 - RESERVE) * plan.gpu_memory_gib * GIB,
        offline_disk_bytes=training_tokens * (1 + taps) * hidden * 2,
        training_tokens=training_tokens,
        hours=seconds / 3600,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="*", type=Path, help=f"plan files (default: every plan in {PLANS})")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = p.parse_args(argv)
    out = {}
    try:
        for path in args.plans or sorted(PLANS.glob("*.json")):
            plan = Plan.read(path)
            check = check_plan(plan)
            out[plan.name] = asdict(check)
            if not args.json:
                print(check.table(plan), end="\n\n")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
