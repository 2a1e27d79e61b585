"""``python -m specdec_kit.train.recipe train/recipes/smollm2.json``: the heads of a real target, reproduced by one
command from a recipe file: the target (a named one, obtained from its package), self-distilled data (the target's
own answers to the recipe's prompts, with its features, ``train/distill.py``) and one head per entry of the recipe,
trained on that data (GRIFFIN, EAGLE, HASS with ``train/heads.py``; EAGLE-3 with ``train/eagle3.py``).

A recipe's ``learning_curve`` section ({"heads": [...], "answer_tokens": [N, ...], other head settings}) trains
those heads again on the first shards holding N answer tokens each (``<out>/curve/<head>-<N>``), measured on the same
held-out prompts as the full heads, and writes ``learning_curve.json`` and ``learning_curve.png``: how a head's
held-out acceptance grows with data.

Every head with ``eval_every`` is measured while it trains on the same held-out samples: a fixed bucket of prompt ids
in the first shards holding the recipe's ``heldout_answer_tokens`` (``heldout_split``).

A head's ``init_from`` naming another head of the recipe starts from that head's folder, trained first: one schedule
in two runs (SmolLM2's GRIFFIN: a constant rate over all the data, then its decay from that head). A head's
``shards_from`` trains it on the pool's shards from that chunk number on: a run continued over the data its start
had not read (``--chunks`` regenerates just those and the held-out bucket's first shards); its ``passes`` ([1]: the
shards ``answers-p1-*``) trains it on those passes over the pool alone: a head continued over a new sampled pass. The
held-out samples stay those of the first pass either way.

Every stage resumes: the data generation skips the shards it has, each head continues from its
``training_state.pt``, and a finished head is left alone unless the recipe now asks more steps of it (more epochs:
it goes on from its state); ``--force`` retrains it from the start. The output holds the heads
(float16, without the target's embedding, which they take from it), ``training_log.json`` (the data's fingerprint and
size, each head's settings, minutes and loss history) and ``training_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specdec_kit.train.regenerate import chunk_ranges

if TYPE_CHECKING:
    from specdec_kit.train.distilled import DistilledData, ShardSelection

RECIPES = Path(__file__).resolve().parent / "recipes"


def data_dir(recipe: dict, given: Path | None) -> Path:
    from specdec_kit.runtime.models.pretrained import cache_root

    return given or cache_root() / "data" / recipe["name"]


def training_data(recipe: dict, data: Path) -> Path:
    """What the heads train on: a regenerated recipe's teacher-forced features, else the distilled data itself."""
    return data / "features" if "regenerate" in recipe else data


def minutes_left(deadline: float | None) -> float | None:
    """Minutes until ``deadline`` (a ``time.monotonic()`` value; None: no limit)."""
    return None if deadline is None else (deadline - time.monotonic()) / 60


def run_distill(
    recipe: dict,
    recipe_dir: Path,
    data: Path,
    backend: dict | None = None,
    deadline: float | None = None,
    chunks: set[int] | None = None,
) -> dict:
    """The training data: regenerated from a prompt pool when the recipe has a ``regenerate`` section (pool, answers
    turn by turn, then teacher-forced features: ``data/pool``, ``data/answers``, ``data/features``), else distilled
    from the recipe's prompt file with features written while generating (``chunks`` is for a pool's)."""
    from specdec_kit.runtime.models.pretrained import resolve_target

    if "regenerate" in recipe:
        return run_regenerate(recipe, data, resolve_target(recipe["target"]), backend or {}, deadline, chunks)
    from specdec_kit.train.distill import DistillSpec, distill

    return distill(
        resolve_target(recipe["target"]),
        recipe_dir / recipe["prompts"],
        data,
        DistillSpec.from_dict(recipe["distill"]),
        limit=recipe.get("limit"),
    )


def run_regenerate(
    recipe: dict,
    data: Path,
    target: Path,
    backend: dict,
    deadline: float | None = None,
    chunks: set[int] | None = None,
) -> dict:
    """``backend``: fields of ``BackendSpec`` over the recipe's (how answers are generated is not part of the data's
    identity: greedy float32 answers are the same from each). ``deadline``: no answers are started after it; the
    features follow over the answers written. ``chunks``: only these chunks of the pool are answered, all of them
    (the recipe's milestones then do not apply)."""
    from specdec_kit.data.prompts import DEFAULT_SPEC_BENCH
    from specdec_kit.train.prompt_pool import MANIFEST_FILE, RECIPE_PROMPTS, PoolSpec, build_pool, write_pool
    from specdec_kit.train.regenerate import BackendSpec, RegenSpec, regenerate
    from specdec_kit.train.teacher_features import FeatureSpec, teacher_features

    section = recipe["regenerate"]
    pool_spec = PoolSpec(**section.get("pool", {}))
    manifest = data / "pool" / MANIFEST_FILE
    if not manifest.is_file() or json.loads(manifest.read_text())["spec"] != asdict(pool_spec):
        write_pool(*build_pool(pool_spec, RECIPE_PROMPTS, DEFAULT_SPEC_BENCH), data / "pool")
    # answer_tokens: one goal, or milestones: the features follow each, so a part of the data can be trained on
    # (and a learning curve drawn) while the rest is generated
    goals = section.get("answer_tokens")
    for goal in [None] if chunks else goals if isinstance(goals, list) else [goals]:
        answers = regenerate(
            target,
            data / "pool",
            data / "answers",
            RegenSpec(**section.get("answers", {})),
            BackendSpec(**{**section.get("backend", {}), **backend}),
            goal,
            deadline=deadline,
            chunks=chunks,
        )
        index = teacher_features(
            target, data / "answers", data / "features", FeatureSpec(**section.get("features", {}))
        )
    return {
        **index,
        "pool": json.loads(manifest.read_text()),
        "answers_regenerated": answers["answer_tokens"],
        "complete": answers["complete"],
    }


def trained_steps(folder: Path) -> int:
    """Steps behind the head saved in ``folder`` (0 when none is saved)."""
    spec = folder / "training_spec.json"
    if not ((folder / "config.json").is_file() and spec.is_file()):
        return 0
    return int(json.loads(spec.read_text())["steps"])


def data_fingerprint(data: Path, shards: ShardSelection | None = None) -> str:
    """The fingerprint of the distilled data in ``data`` (written by the distill stage); with a selection of its
    ``shards``, of the shards a head so limited reads (e.g. the first ones holding some answer tokens): a regeneration
    writing more shards after them leaves it unchanged, so such a head goes on training while the data grows."""
    path = data / "index.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no distilled data there; run the distill stage first")
    return index_fingerprint(json.loads(path.read_text()), shards)


def index_fingerprint(index: dict, shards: ShardSelection | None = None) -> str:
    """``data_fingerprint`` of an index already read."""
    from specdec_kit.train.distill import fingerprint

    if shards is None or shards.everything:
        return index["fingerprint"]
    return fingerprint({**index, "shards": shards.pick(index["shards"])})


@dataclass(frozen=True)
class HeadSettings:
    """A recipe head's entry: what the recipe itself reads, and the rest, the trainer's spec fields."""

    method: str
    tokens_per_batch: int
    epochs: float | None  # passes over the data, in place of a step count
    variants: tuple[str, ...] | None
    heldout_percent: int | None  # of the prompt ids (default: heldout's), with eval_every
    answer_tokens: int | None  # train on the first shards holding this many answer tokens (None: all the data)
    shards_from: int  # train on the shards of the pool's chunks from this number on (0: from the first)
    passes: tuple[int, ...] | None  # train on these passes over the pool (0: the first; None: every pass)
    schedule: dict

    @classmethod
    def of(cls, name: str, settings: dict) -> "HeadSettings":
        rest = dict(settings)
        return cls(
            method=rest.pop("method", name),
            tokens_per_batch=rest.pop("tokens_per_batch", 4096),
            epochs=rest.pop("epochs", None),
            variants=tuple(rest.pop("variants")) if "variants" in rest else None,
            heldout_percent=rest.pop("heldout_percent", None),
            answer_tokens=rest.pop("answer_tokens", None),
            shards_from=int(rest.pop("shards_from", 0)),
            passes=pass_numbers(name, rest.pop("passes", None)),
            schedule=rest,
        )

    def shards(self, answer_tokens: int | None = None) -> ShardSelection:
        """The shards this head reads (``answer_tokens``: the first ones holding that many, in place of its own
        setting: a learning curve's point)."""
        from specdec_kit.train.distilled import ShardSelection

        limit = self.answer_tokens if answer_tokens is None else answer_tokens
        return ShardSelection(limit, self.shards_from, self.passes)


def pass_numbers(name: str, passes: object) -> tuple[int, ...] | None:
    """A head's ``passes`` setting: the numbers of the passes over the pool it reads (0: the first)."""
    if passes is None:
        return None
    if not isinstance(passes, list) or not passes or not all(type(p) is int and p >= 0 for p in passes):
        raise ValueError(
            f"heads.{name}.passes: {passes!r}; expected a list of pass numbers over the pool, e.g. [1] "
            "(0: the first pass, answers-NNNNN; 1: answers-p1-NNNNN, ...)"
        )
    return tuple(passes)


def heldout_split(
    recipe: dict, data: Path, layers: list[int], head: HeadSettings
) -> tuple[Callable[[dict], bool], DistilledData]:
    """(the selector of the samples a head trains on, the held-out samples measured while it trains). The held-out
    samples are a fixed bucket of prompt ids in the first pass's first shards holding the recipe's
    ``heldout_answer_tokens`` (all of its shards without it), so a head's numbers compare with every other head's
    however much data has been regenerated since, other passes over the pool included."""
    from specdec_kit.train.distilled import DistilledData, ShardSelection
    from specdec_kit.train.heldout import split

    for_training, for_evaluation = split() if head.heldout_percent is None else split(head.heldout_percent)
    heldout = DistilledData(
        data,
        layers,
        tokens_per_batch=head.tokens_per_batch,
        variants=head.variants,
        select=for_evaluation,
        shards=ShardSelection(answer_tokens=recipe.get("heldout_answer_tokens"), passes=(0,)),
    )
    return for_training, heldout


def run_head(
    name: str,
    settings: dict,
    recipe: dict,
    data: Path,
    out: Path,
    force: bool,
    trained_on: str | None = None,
    answer_tokens: int | None = None,
    deadline: float | None = None,
) -> dict | None:
    """Train one head, or go on training it when the recipe now asks more steps than it has (from its
    ``training_state.pt``); None when it is already trained as far as the recipe asks. A head goes on only over
    the data it was trained on (``trained_on``, the fingerprint of the shards it reads): other data means another
    draft vocabulary and another batch plan, which its state does not fit; shards written after those do not count.
    ``answer_tokens``: train on the first shards holding that many (default: the head's own ``answer_tokens``
    setting, else all; the held-out prompts are the same either way: ``heldout_split``). ``deadline``: the head
    trains until then at most (the schedule's time limit), and is not started when it has passed."""
    import torch

    from specdec_kit.runtime.core.device import resolve_dtype
    from specdec_kit.runtime.models.pretrained import resolve_target
    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.train.distilled import DistilledData

    folder = out / name
    done = trained_steps(folder)
    if done and not force and not (folder / "training_state.pt").is_file():
        print(
            f"{name}: {folder} holds a head of {done} steps and no training_state.pt to go on from (trained "
            "elsewhere, e.g. the committed one); --force retrains it",
            file=sys.stderr,
        )
        return None
    shards = HeadSettings.of(name, settings).shards(answer_tokens)
    current = data_fingerprint(data, shards) if done and not force else None
    if current is not None and trained_on != current:
        print(
            f"{name}: {folder} was trained on distilled data {str(trained_on)[:12]}, the data now is "
            f"{current[:12]}; --force retrains it on this data",
            file=sys.stderr,
        )
        return None
    left = minutes_left(deadline)
    if left is not None and left <= 0:
        print(f"{name}: not started: the time limit has passed", file=sys.stderr)
        return None
    head = HeadSettings.of(name, settings if left is None else {**settings, "time_limit": left})
    start = head.schedule.get("init_from")
    if start in recipe["heads"]:  # another head of the recipe, trained before this one: its folder
        head.schedule["init_from"] = str(out / start)
    target_path = resolve_target(recipe["target"])
    target = TargetModel.from_pretrained(target_path, dtype="float32", device="cpu")
    save_dtype = resolve_dtype(recipe.get("save_dtype", "float16"), torch.device("cpu"))
    shared = bool(recipe.get("embedding_from_target", True))
    base = recipe["target"]
    from specdec_kit.train.methods import trainer_for

    trainer = trainer_for(head.method)
    if trainer.distilled_layers is None:
        raise ValueError(
            f"{name}: the {head.method} trainer streams its own target passes; it does not read distilled data"
        )
    spec = trainer.make_spec(head.method, **head.schedule)
    layers = trainer.distilled_layers(spec, target.num_layers)
    heldout, for_training = None, None
    if spec.eval_every:  # a fixed bucket of prompts is held out from training and measured every eval_every steps
        for_training, heldout = heldout_split(recipe, data, layers, head)
    source = DistilledData(
        data,
        layers,
        tokens_per_batch=head.tokens_per_batch,
        seed=spec.seed,
        variants=head.variants,
        select=for_training,
        shards=shards,
    )
    spec.steps = round(head.epochs * len(source)) if head.epochs else spec.steps
    if done >= spec.steps and not force:
        print(f"{name}: already trained in {folder} ({done} steps; --force retrains)", file=sys.stderr)
        return None
    if force:
        (folder / "training_state.pt").unlink(missing_ok=True)  # the trainer would otherwise resume from it
    start = f"from step {done}, " if done and not force else ""
    print(f"{name}: {len(source)} batches of distilled data, {start}{spec.steps} steps", file=sys.stderr)
    return trainer.train(
        target,
        source,
        spec,
        folder,
        base_model=base,
        save_dtype=save_dtype,
        embedding_from_target=shared,
        heldout=heldout,
    )


def run_learning_curve(
    recipe: dict, data: Path, out: Path, force: bool, deadline: float | None = None, only: set[int] | None = None
) -> list[dict]:
    """Each head of the recipe's ``learning_curve`` trained on the first shards holding each of its answer-token
    counts; returns one point a run (head, answer tokens in the shards trained on, steps, best held-out tau and
    acceptance). A finished point is read back from its folder's ``curve_point.json``. ``only``: train those counts
    alone (the others' finished points are still read back, so the curve stays whole)."""
    from specdec_kit.train.distill import INDEX

    section = dict(recipe["learning_curve"])
    heads, sizes = section.pop("heads"), section.pop("answer_tokens")
    shards = json.loads((data / INDEX).read_text())["shards"]
    points = []
    for name in heads:
        for size in sizes:
            folder = out / "curve" / f"{name}-{size}"
            saved = folder / "curve_point.json"
            settings = {**recipe["heads"][name], **section}
            settings.pop("init_from", None)  # each point a new head: what that much data alone teaches
            point_head = {"method": name, **settings}  # a head named otherwise (griffin-stable) says its method
            read = HeadSettings.of(folder.name, point_head).shards(size)  # the shards run_head reads for it
            result = None
            if only is None or size in only:
                result = run_head(
                    folder.name,
                    point_head,
                    recipe,
                    data,
                    folder.parent,
                    force,
                    trained_on=data_fingerprint(data, read),
                    answer_tokens=size,
                    deadline=deadline,
                )
            if result is not None:
                held = result.get("heldout_best", {})
                point = {
                    "head": name,
                    "answer_tokens": shards_answer_tokens(shards, read),
                    "epochs": settings.get("epochs"),
                    "steps": result["steps"],
                    "heldout_best": held,
                    "per_position": best_per_position(saved_history(folder)),
                }
                saved.write_text(json.dumps(point, indent=1))
            if saved.is_file():
                points.append(json.loads(saved.read_text()))
    return points


def curve_sizes(arg: str | None, recipe: dict, path: Path) -> set[int] | None:
    """``--curve-sizes`` as a set of the recipe's learning-curve answer-token counts (None: every one)."""
    if not arg:
        return None
    named = recipe.get("learning_curve", {}).get("answer_tokens", [])
    try:
        sizes = {int(s) for s in arg.split(",")}
    except ValueError:
        raise ValueError(f"--curve-sizes {arg!r}: expected answer-token counts, comma-separated") from None
    unknown = sorted(sizes - set(named))
    if unknown:
        raise ValueError(f"--curve-sizes: {unknown} not among {path.name}'s learning_curve answer_tokens {named}")
    return sizes


def best_per_position(history: list[dict]) -> list[float] | None:
    """The per-position held-out acceptance of a head's best measurement (by tau per cycle) in its training history:
    the count the learning curve draws, its earliest points having been measured so."""
    measured = [r["heldout"] for r in history if "per_position" in r.get("heldout", {})]
    return max(measured, key=lambda h: h["tau"])["per_position"] if measured else None


def saved_history(folder: Path) -> list[dict]:
    """A trained head's step records, from its ``training_state.pt``."""
    import torch

    return torch.load(folder / "training_state.pt", weights_only=True, map_location="cpu")["history"]


def shards_answer_tokens(shards: list[dict], selection: ShardSelection) -> int:
    """Answer tokens in the ``selection`` of ``shards``: what a head limited so trains on."""
    return sum(x["answer_tokens"] for shard in selection.pick(shards) for x in shard["samples"])


def update_log(path: Path, recipe_name: str, change: Callable[[dict], None]) -> dict:
    """The training log as it is now with ``change`` applied, written back under a lock: heads of one recipe trained
    by separate processes at once (one a head, on a GPU machine) each add their own entry."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        log = json.loads(text) if text.strip() else {"recipe": recipe_name, "heads": {}}
        change(log)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(log, indent=1))
    return log


def record_data(log_path: Path, recipe_name: str, index: dict) -> dict:
    """The training log with its ``data`` record set to the distilled data's summary, when that data is complete:
    a run of chosen chunks, or one a time limit cut short, leaves the record of the whole data as it was (the heads'
    own entries say what each trained on)."""
    if not index.get("complete", True):
        print(
            f"distill: the data is partial so far ({index['answer_tokens']} answer tokens: chosen chunks, or the time "
            f"limit); {log_path}'s data record is left as it was",
            file=sys.stderr,
        )
        return update_log(log_path, recipe_name, lambda log: None)
    summary = {
        "fingerprint": index["fingerprint"],
        "tokens": index["tokens"],
        "answer_tokens": index["answer_tokens"],
        "samples": sum(len(s["samples"]) for s in index["shards"]),
        "skipped_prompts": len(index["skipped"]),
        "spec": index["spec"],
        "prompts_sha256": index["prompts_sha256"],
    }
    if "pool" in index:
        summary["pool"] = {k: index["pool"][k] for k in ("fingerprint", "conversations", "user_turns", "mix")}
    return update_log(log_path, recipe_name, lambda log: log.update(data=summary))


def curve_acceptance(point: dict) -> list[float]:
    """A learning-curve point's held-out acceptance per depth counted over every answer position: its
    ``per_position``, or, for a point measured before the count per decoding cycle (none recorded beside it), its
    ``heldout_best``, which then counted so."""
    return point.get("per_position") or point.get("heldout_best", {}).get("acceptance") or []


def plot_learning_curve(points: list[dict], path: Path) -> None:
    """Held-out tau (and first-draft acceptance) per answer position against the answer tokens a head was trained
    on, one line a head and number of epochs."""
    from specdec_kit.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (name, epochs) in enumerate(dict.fromkeys((p["head"], p.get("epochs")) for p in points)):
        mine = sorted(
            (p for p in points if (p["head"], p.get("epochs")) == (name, epochs) and curve_acceptance(p)),
            key=lambda p: p["answer_tokens"],
        )
        tokens = [p["answer_tokens"] for p in mine]
        label = f"{name}, {epochs} epochs" if epochs else name
        taus = [1 + sum(curve_acceptance(p)) for p in mine]
        ax.plot(tokens, taus, marker="o", color=f"C{n}", label=f"{label}: tau")
        ax.plot(
            tokens,
            [1 + curve_acceptance(p)[0] for p in mine],
            marker=".",
            linestyle="--",
            color=f"C{n}",
            label=f"{label}: 1 + first-draft acceptance",
        )
    ax.set_xscale("log")
    ax.set_xlabel("answer tokens trained on")
    ax.set_ylabel("held-out tau per answer position (chain of 3, greedy)")
    ax.legend(fontsize=8)
    ax.set_title("learning curve: held-out acceptance against data")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def started_at(heads: dict, name: str) -> int:
    """The steps before a head's own run: those of the logged head it started from (``init_from`` naming one), and
    of the one that one started from; 0 for a new head."""
    start = heads.get(name, {}).get("settings", {}).get("init_from")
    return heads[start]["steps"] + started_at(heads, start) if start in heads and start != name else 0


def heldout_records(head: dict, history: list[dict]) -> list[dict]:
    """A head's held-out measurements in step order: the head it started from (``heldout_start``), then its own."""
    start = [{"step": -1, "heldout": head["heldout_start"]}] if "heldout_start" in head else []
    return start + [r for r in history if "heldout" in r]


def plot_curves(log: dict, path: Path) -> None:
    """The training loss of each head (moving mean) and, where it was measured, its held-out acceptance per depth
    beside it."""
    from specdec_kit.plots import pyplot

    plt = pyplot()
    histories = {name: h for name, h in log.get("histories", {}).items() if h}
    heads = log.get("heads", {})
    offsets = {name: started_at(heads, name) for name in histories}  # a head continued from another goes on from it
    measured = {name: heldout_records(heads.get(name, {}), h) for name, h in histories.items()}
    panels = 2 if any(measured.values()) else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False)
    loss_ax = axes[0][0]
    for name, history in histories.items():
        steps = [offsets[name] + h["step"] for h in history]
        losses = [h["loss"] for h in history]
        window = max(1, len(losses) // 50)
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        loss_ax.plot(steps, smooth, label=name)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss (moving mean)")
    loss_ax.set_yscale("log")
    loss_ax.legend()
    loss_ax.set_title(f"{log['recipe']}: draft heads on self-distilled data")
    if panels == 2:
        ax = axes[0][1]
        for n, (name, records) in enumerate(item for item in measured.items() if item[1]):
            steps = [offsets[name] + r["step"] + 1 for r in records]
            for depth in range(len(records[0]["heldout"]["acceptance"])):
                ax.plot(
                    steps,
                    [r["heldout"]["acceptance"][depth] for r in records],
                    color=f"C{n}",
                    linestyle=("-", "--", ":")[depth % 3],
                    label=name if depth == 0 else None,  # one entry a head; the depths' line styles below
                )
        for depth, style in enumerate(("-", "--", ":")):
            ax.plot([], [], color="grey", linestyle=style, label=f"depth {depth + 1}")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out acceptance (chain, greedy)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        ax.set_title("held-out prompts: share of cycles accepting d drafts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.recipe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", type=Path, help="recipe file, or the name of one in train/recipes (e.g. smollm2)")
    p.add_argument("--out", type=Path, help="where the heads go (default: the recipe's out)")
    p.add_argument("--data", type=Path, help="distilled data directory (default: $SPECDEC_CACHE/data/<name>)")
    p.add_argument(
        "--stages",
        default="distill,heads,curve",
        help="distill, heads, curve (the recipe's learning curve, where it has one), comma-separated (default: all)",
    )
    p.add_argument(
        "--backend",
        help="how answers are regenerated, in place of the recipe's: kit, engine, vllm or "
        "transformers (e.g. on a GPU machine without vLLM)",
    )
    p.add_argument("--batch", type=int, help="rows per batch of the kit, engine and transformers backends")
    p.add_argument("--group", type=int, help="chunks of the pool answered together (bigger batches on a GPU)")
    p.add_argument(
        "--chunks",
        type=chunk_ranges,
        help="regenerate only these chunks of the prompt pool (shard numbers, ranges comma-separated, e.g. "
        "0-15,112-164: the held-out bucket's shards and those a head continues over), all of them, in place of the "
        "recipe's milestones; the others stay for a later run",
    )
    p.add_argument("--heads", help="only these heads, comma-separated (default: every head of the recipe)")
    p.add_argument("--force", action="store_true", help="retrain heads from the start (their saved state discarded)")
    p.add_argument(
        "--time-limit",
        type=float,
        help="minutes this run may take (e.g. a lent GPU's): regeneration starts no new answers after them (the "
        "features follow over what is written), a head stops training then and keeps its best held-out weights, "
        "and later heads are not started; a rerun goes on from there",
    )
    p.add_argument(
        "--curve-sizes",
        help="train only these points of the learning curve, answer-token counts comma-separated as the recipe names "
        "them (e.g. 1000000); the others' finished points stay in the curve",
    )
    args = p.parse_args(argv)
    path = args.recipe if args.recipe.suffix == ".json" else RECIPES / f"{args.recipe}.json"
    if not path.is_file():
        print(
            f"error: {path}: no such recipe (the kit's: {sorted(q.stem for q in RECIPES.glob('*.json'))})",
            file=sys.stderr,
        )
        return 2
    recipe = json.loads(path.read_text())
    try:
        only = curve_sizes(args.curve_sizes, recipe, path)
        for name, settings in recipe.get("heads", {}).items():
            HeadSettings.of(name, settings)
    except ValueError as exc:  # before any stage: a typo must not surface after hours of regeneration
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.train.background import exit_cleanly_on_signals, nice_own_session_and_say

    set_threads()
    nice_own_session_and_say()
    exit_cleanly_on_signals()
    out = args.out or Path(recipe["out"])
    data = data_dir(recipe, args.data)
    features = training_data(recipe, data)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "training_log.json"
    log = update_log(log_path, recipe["name"], lambda log: None)
    stages = set(args.stages.split(","))
    deadline = None if args.time_limit is None else time.monotonic() + 60 * args.time_limit
    try:
        if "distill" in stages:
            backend = {
                k: v for k, v in (("name", args.backend), ("batch", args.batch), ("group", args.group)) if v is not None
            }
            index = run_distill(recipe, path.parent, data, backend, deadline, args.chunks)
            log = record_data(log_path, recipe["name"], index)
        if "heads" in stages:
            wanted = args.heads.split(",") if args.heads else list(recipe["heads"])
            for name in wanted:
                before = (
                    log["heads"].get(name, {}).get("minutes", 0) if trained_steps(out / name) and not args.force else 0
                )
                trained_on = log["heads"].get(name, {}).get("data_fingerprint")
                result = run_head(
                    name, recipe["heads"][name], recipe, features, out, args.force, trained_on, deadline=deadline
                )
                if result is None:
                    continue
                result["minutes"] = round(before + result["minutes"], 2)  # a continued head's minutes add up
                index = json.loads((features / "index.json").read_text())
                read = HeadSettings.of(name, recipe["heads"][name]).shards()
                entry = {
                    "settings": recipe["heads"][name],
                    "data_fingerprint": index_fingerprint(index, read),
                    "answer_tokens": shards_answer_tokens(index["shards"], read),
                    **{k: v for k, v in result.items() if k != "last"},
                }
                history = saved_history(out / name)

                def add_head(log: dict, name=name, entry=entry, history=history) -> None:
                    log["heads"][name] = entry
                    log.setdefault("histories", {})[name] = history

                log = update_log(log_path, recipe["name"], add_head)
                plot_curves(log, out / "training_curves.png")
        if "curve" in stages and "learning_curve" in recipe:
            points = run_learning_curve(recipe, features, out, args.force, deadline, only)
            log = update_log(log_path, recipe["name"], lambda log: None)  # heads trained meanwhile elsewhere
            everything = json.loads((features / "index.json").read_text())["answer_tokens"]
            for name, head in log["heads"].items():  # the full heads are the curve's last points
                if "heldout_best" in head and name in recipe["learning_curve"]["heads"]:
                    points.append(
                        {
                            "head": name,
                            "answer_tokens": head.get("answer_tokens", everything),
                            "epochs": head["settings"].get("epochs"),
                            "steps": head["steps"],
                            "heldout_best": head["heldout_best"],
                            "per_position": best_per_position(log.get("histories", {}).get(name, [])),
                        }
                    )
            (out / "learning_curve.json").write_text(json.dumps(points, indent=1))
            plot_learning_curve(points, out / "learning_curve.png")
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in log.items() if k != "histories"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
