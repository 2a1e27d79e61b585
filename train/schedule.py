"""The optimisation schedule every trainer shares (steps, batch shape, learning rate, warm-up, seed)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specdec_kit.runtime.core.cpu import cpu_flags
from specdec_kit.train.host_memory import release_freed_host_memory


@dataclass(kw_only=True)
class Schedule:
    steps: int = 500
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 30
    # the last share of the planned steps over which the learning rate falls linearly to zero (0: constant after
    # warm-up): warm-up, stable, decay, whose last phase takes the loss down where a constant rate levels off
    decay: float = 0.0
    seed: int = 0
    eval_every: int = 0  # held-out acceptance every this many steps (0: never; needs held-out data)
    eval_depth: int = 3  # draft depths it counts
    # the head's forward and backward: float32, bfloat16 (autocast; weights stay float32), or auto (bfloat16 where the
    # device computes it natively)
    precision: str = "float32"
    sharding: str = "ddp"  # under torchrun: ddp (each rank a whole copy) or fsdp (FSDP2: weights, grads, AdamW sharded)
    # under torchrun with online hidden states: the frozen target replicated on every rank, or its decoder layers
    # sharded across them (fsdp: a target too large for one device beside the head; ``train/sharded_target.py``)
    target_sharding: str = "replicated"
    accumulate: int = 1  # micro-batches per optimizer step: ``batch`` rows in all, batch / accumulate at a time
    # minutes this run may train (0: no limit): a lent machine's hour, a CI budget; see ``step_bar``
    time_limit: float = 0.0
    # a saved head (official layout) the run starts from instead of a seeded new one: a head continued on more or
    # other data, or fine-tuned (``train/warm_start.py``); "" starts a new head
    init_from: str = ""

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step``: a linear warm-up, constant, then with ``decay`` a linear fall to zero over
        the last share of ``steps``."""
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay {self.decay}: expected a share of the steps, 0 to 1")
        lr = self.lr * min(1.0, (step + 1) / self.warmup)
        decay_steps = self.decay * self.steps
        if decay_steps > 0 and step >= self.steps - decay_steps:
            lr *= max(0.0, (self.steps - step) / decay_steps)
        return lr

    def micro_batches(self, rows: int) -> list[slice]:
        """The consecutive row ranges of a step's micro-batches (``accumulate`` of them, as even as the rows allow)."""
        if not 1 <= self.accumulate <= rows:
            raise ValueError(f"accumulate {self.accumulate}: expected 1 to the batch's {rows} rows")
        return [slice(rows * i // self.accumulate, rows * (i + 1) // self.accumulate) for i in range(self.accumulate)]

    def autocast(self, device: torch.device) -> torch.autocast:
        """The training step's autocast: bfloat16 matrix products where asked, or with ``auto`` where the device
        computes them natively (a CUDA GPU with bfloat16, a CPU with AVX-512 BF16 or AMX: there about half a float32
        step's time; a CPU without emulates them, about 70x slower than float32 on an AVX2 machine); the weights, the
        optimizer and the held-out measurement stay float32."""
        return bfloat16_autocast(self.precision, device)

    def batch_rows(self, step: int, num_blocks: int) -> torch.Tensor:
        """The blocks of ``step``: consecutive, wrapping around (so a resumed run sees the same data)."""
        return torch.arange(step * self.batch, (step + 1) * self.batch) % num_blocks

    def check_finite(self, loss: torch.Tensor, what: str, step: int) -> None:
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"{what}: loss is {float(loss)} at step {step}; lower the learning rate ({self.lr})"
            )


def resolved_precision(precision: str, device: torch.device, what: str = "precision") -> str:
    """``float32`` or ``bfloat16``: ``auto`` is bfloat16 where ``device`` computes it natively (``native_bfloat16``),
    float32 where it would be emulated. ``what`` names the setting in the error."""
    if precision not in ("float32", "bfloat16", "auto"):
        raise ValueError(f"{what} {precision!r}: expected float32, bfloat16 or auto")
    native = precision == "auto" and native_bfloat16(device)
    return "bfloat16" if precision == "bfloat16" or native else "float32"


def bfloat16_autocast(precision: str, device: torch.device) -> torch.autocast:
    """Autocast to bfloat16 on ``device`` where ``precision`` resolves to it, else a disabled one."""
    wanted = resolved_precision(precision, device) == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=wanted)


def native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively: a CUDA GPU that supports it, a CPU with AVX-512 BF16
    or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def optimizer_and_state(
    module: torch.nn.Module, schedule: Schedule, state_path, sharded=None
) -> tuple[list, torch.optim.Optimizer, int, list]:
    """AdamW over ``module``'s trainable parameters, resumed from ``state_path`` when it exists:
    (params, optimizer, first step, history so far). ``sharded`` (a ``train.sharding.ShardedStep``): the module is
    sharded, and the plain state on disk is loaded into its shards."""
    if schedule.sharding not in ("ddp", "fsdp"):
        raise ValueError(f"sharding {schedule.sharding!r}: expected ddp or fsdp")
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, history = 0, []
    if state_path.is_file():  # loaded to the host: a state saved on a GPU resumes anywhere
        state = torch.load(state_path, weights_only=True, map_location="cpu")
        if sharded is not None:
            sharded.load(opt, state["head"], state["optimizer"])
        else:
            module.load_state_dict(state["head"])
            opt.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    return params, opt, start, history


def save_state(
    module: torch.nn.Module, opt: torch.optim.Optimizer, step: int, history: list, state_path, extra: dict | None = None
) -> None:
    """``extra``: what else a resumed run needs (the held-out tracker's best weights)."""
    save_state_dicts(module.state_dict(), opt.state_dict(), step, history, state_path, extra)


def save_state_dicts(
    head: dict, optimizer: dict, step: int, history: list, state_path, extra: dict | None = None
) -> None:
    """The training state from the head's and the optimizer's (plain, one-process) state dicts."""
    torch.save(
        {"head": head, "optimizer": optimizer, "step": step, "history": history, **({"extra": extra} if extra else {})},
        state_path,
    )


def saved_extra(state_path) -> dict | None:
    return torch.load(state_path, weights_only=True, map_location="cpu").get("extra") if state_path.is_file() else None


def accumulated_step(
    schedule: Schedule,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    params: list,
    ranks,
    device: torch.device,
    step: int,
    what: str,
    rows: int,
    forward: Callable[[slice], tuple[torch.Tensor, Any]],
) -> tuple[list[float], list]:
    """One optimizer step of every trainer: the warm-up learning rate, then each micro-batch's loss (``forward`` of
    its rows, under the schedule's autocast; the ranks' gradients synchronised on the last one) backward at its share,
    then clipping and the step -> (each micro-batch's loss, each one's statistics as ``forward`` returned them)."""
    for group in opt.param_groups:
        group["lr"] = schedule.lr_at(step)
    opt.zero_grad(set_to_none=True)
    pieces = schedule.micro_batches(rows)
    losses, parts = [], []
    for i, piece in enumerate(pieces):  # each micro-batch's backward adds its share to the gradients
        with ranks.syncing(model, sync=i == len(pieces) - 1):
            with schedule.autocast(device):
                part, stats = forward(piece)
            schedule.check_finite(part, what, step)
            (part / len(pieces)).backward()
        losses.append(float(part.detach()))
        parts.append(stats)
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt.step()
    if device.type == "cpu":  # the step's freed activations back to the system, not kept by the heap
        release_freed_host_memory()
    return losses, parts


class TimedSteps:
    """The steps of ``step_bar`` under a time limit: the first step that begins past the limit is the last one (every
    rank agrees, so none waits on a collective another has left). ``schedule.steps`` becomes the steps run before
    that step's body, so the trainer treats it as a planned last step (measured on the held-out set, its state
    saved) and what it writes after its loop (the saved spec, the steps it reports) is what happened. Without a
    decay the learning rate is constant after warm-up, so a shortened run is the longer run's first steps, and a rerun
    goes on from it; with one, a run cut before its decay has not decayed (its last step's rate is the cut plan's)."""

    def __init__(self, bar, schedule: Schedule, ranks):
        self.bar, self.schedule, self.ranks = bar, schedule, ranks
        self.began = time.monotonic()

    def out_of_time(self) -> bool:
        return self.ranks.any(time.monotonic() - self.began > 60 * self.schedule.time_limit)

    def __iter__(self):
        for step in self.bar:
            if self.out_of_time():
                self.schedule.steps = step + 1
                yield step
                self.bar.close()
                print(
                    f"time limit ({self.schedule.time_limit:g} min) reached: step {step + 1} was the last",
                    file=sys.stderr,
                )
                return
            yield step

    def set_postfix(self, **values) -> None:
        self.bar.set_postfix(**values)


def step_bar(schedule: Schedule, start: int, desc: str, progress: bool = True, ranks=None):
    """The training steps from ``start`` (a resumed run starts there) under a tqdm bar on stderr; with a time
    limit, ``TimedSteps`` over them (``ranks``, a ``train.parallel.Ranks``: who must stop at the same step)."""
    from tqdm import tqdm

    bar = tqdm(
        range(start, schedule.steps),
        desc=desc,
        initial=start,
        total=schedule.steps,
        disable=not progress,
        file=sys.stderr,
    )
    if schedule.time_limit <= 0:
        return bar
    from specdec_kit.train.parallel import Ranks

    return TimedSteps(bar, schedule, ranks or Ranks())
