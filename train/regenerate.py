"""Regenerate chat training data with the target itself: every conversation of a prompt pool
(``train/prompt_pool.py``) answered turn by turn, each follow-up asked after the target's own answer to the turn
before, through the chat template the target serves with. Only token ids are written here; the target's features
come after, from one teacher-forced pass over the finished samples (``train/teacher_features.py``), which is
cheaper than carrying hidden states through generation.

Five ways to generate, greedy by default (the same answers from each, float32):

- ``kit``: the kit's own batched runtime (``SpeculativeGenerator`` without a draft) on the PyTorch target, in batches;
- ``engine``: the same on an ONNX Runtime engine of the target (what the kit's server runs);
- ``vllm``: vLLM's offline engine (``vllm.LLM``, continuous batching with prefix caching) in a worker process
  started with vLLM's interpreter (``SPECDEC_VLLM_PYTHON``, else ``.venv-vllm`` as the vLLM tier's set-up makes it);
- ``sglang``: SGLang's offline engine (``sglang.Engine``) the same way (GPUs only); for either, ``--replicas N``
  data-parallel workers (``--tp`` GPUs each) answer parts of every request at once (``train/engine_workers.py``);
- ``transformers``: Hugging Face's batched ``generate`` (left-padded rows of similar length), on CUDA when present:
  the way for a GPU machine that has PyTorch and transformers but no vLLM.

Resumable: the pool is cut into fixed chunks of conversations, one shard file a chunk (``answers-NNNNN.jsonl``,
written whole and atomically), listed in ``answers.json`` with the pool's fingerprint and the settings; a rerun
skips the shards it has, and ``--answer-tokens`` stops once that many answer tokens are written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from specdec_kit.train.engine_workers import EngineAnswers
from specdec_kit.train.prompt_pool import MANIFEST_FILE, Conversation, read_pool

ANSWERS_INDEX = "answers.json"


@dataclass
class RegenSpec:
    max_prompt_tokens: int = 768  # a turn whose templated history is longer ends its conversation
    max_new_tokens: int = 256
    max_turns: int = 3
    chunk: int = 128  # conversations per shard
    temperature: float = 0.0
    seed: int = 0
    # further passes over the whole pool, each {"temperature": T, "seed": S}: every conversation answered again, its
    # shards (answers-p1-NNNNN.jsonl, ...) written after the first pass's; sampled answers put the head on the text a
    # sampling request walks, which greedy answers never reach
    passes: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i, extra in enumerate(self.passes, 1):
            unknown = set(extra) - {"temperature", "seed"}
            if unknown or "temperature" not in extra:
                raise ValueError(
                    f"answers: passes[{i - 1}] is {extra!r}; expected a temperature and optionally a seed, e.g. "
                    '{"temperature": 0.7, "seed": 1}'
                )

    def answer_passes(self) -> list[tuple[float, int]]:
        """(temperature, seed) of each pass over the pool: the spec's own first, then ``passes`` in order."""
        return [(self.temperature, self.seed)] + [
            (float(extra["temperature"]), int(extra.get("seed", i))) for i, extra in enumerate(self.passes, 1)
        ]


def shard_name(answer_pass: int, chunk: int) -> str:
    """The answers shard of a pass's chunk (the first pass's names are those written before passes existed)."""
    return f"answers-{chunk:05d}.jsonl" if answer_pass == 0 else f"answers-p{answer_pass}-{chunk:05d}.jsonl"


def shard_pass(shard: dict) -> int:
    """Which pass over the pool an answers shard (its ``answers.json`` entry) belongs to."""
    return int(shard.get("pass", 0))


def settings_differ(stored: dict, now: dict) -> str | None:
    """The first setting an answers index was written with that this run's differs in (None: it may go on). A spec
    key the index predates counts at its default, and ``passes`` may grow: a run adding passes goes on from the
    shards written."""
    for key in now:
        if key != "spec":
            if stored[key] != now[key]:
                return key
            continue
        old = {**asdict(RegenSpec()), **stored[key]}
        new = now[key]
        if {k: v for k, v in old.items() if k != "passes"} != {k: v for k, v in new.items() if k != "passes"}:
            return key
        if new["passes"][: len(old["passes"])] != old["passes"]:
            return key
    return None


@dataclass
class BackendSpec:
    """How answers are generated (not part of the data's identity: greedy float32 answers are the same from each)."""

    name: str = "vllm"  # kit, engine, vllm, sglang or transformers
    batch: int = 32  # kit, engine and transformers: rows per batch (vLLM and SGLang batch by themselves)
    dtype: str = "float32"  # vllm, sglang: the engine's dtype
    engine: Path | None = None  # engine: the ONNX Runtime engine folder
    eager: bool = False  # vllm: skip torch.compile (starts in seconds instead of minutes, decodes slower)
    group: int = 1  # chunks answered together, each still its own shard (bigger batches; vLLM-CPU's stay full longer)
    tp: int = 1  # vllm, sglang: tensor-parallel GPUs per replica
    replicas: int = 1  # vllm, sglang: data-parallel workers, each answering part of every request


class KitAnswers:
    """The kit's batched runtime, plain decoding: on the PyTorch target, or on an ONNX Runtime engine's target (what
    the kit's server runs)."""

    def __init__(self, target_path: Path, batch: int = 32, engine: Path | None = None):
        from specdec_kit.runtime.decoding.generate import SpeculativeGenerator

        if engine is not None:
            from specdec_kit.runtime.engine import open_engine

            self.generator = open_engine(engine).generator(speculative=False)
        else:
            from specdec_kit.runtime.models.target import TargetModel

            self.generator = SpeculativeGenerator(TargetModel.from_pretrained(target_path, dtype="float32"))
        self.eos = set(self.generator.eos)
        self.batch = batch

    def answer(
        self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seed: int
    ) -> list[tuple[list[int], str]]:
        from specdec_kit.runtime.core.sampling import SamplingParams

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        answers: dict[int, tuple[list[int], str]] = {}
        for b in range(0, len(order), self.batch):
            rows = order[b : b + self.batch]
            params = [SamplingParams(temperature=temperature, seed=seed + i) for i in rows]
            results = self.generator.generate([prompts[i] for i in rows], [max_tokens[i] for i in rows], params)
            for i, r in zip(rows, results):
                answers[i] = (list(r.tokens), r.finish_reason)
        return [answers[i] for i in range(len(prompts))]

    def close(self, graceful: bool = True) -> None:
        pass


class TransformersAnswers:
    """Hugging Face's ``generate`` over left-padded batches of similar length, float32 (TF32 off, so a GPU's answers
    are the float32 model's), on CUDA when present."""

    def __init__(self, target_path: Path, eos: set[int], batch: int = 32, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from specdec_kit.runtime.core.device import resolve_device

        if not eos:
            raise ValueError(
                f"{target_path}: no eos_token_id in generation_config.json or config.json: answers would never end"
            )
        self.device = resolve_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).to(self.device).eval()
        self.eos, self.batch = sorted(eos), batch

    def answer(
        self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seed: int
    ) -> list[tuple[list[int], str]]:
        import torch
        from transformers import GenerationConfig

        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        answers: dict[int, tuple[list[int], str]] = {}
        pad, stops = self.eos[0], set(self.eos)
        sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else {}
        for b in range(0, len(order), self.batch):
            rows = order[b : b + self.batch]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=self.device)
            mask = torch.tensor(
                [[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows], device=self.device
            )
            torch.manual_seed(seed + rows[0])  # sampled answers: one seeded stream per batch
            config = GenerationConfig(
                max_new_tokens=max(max_tokens[i] for i in rows), eos_token_id=self.eos, pad_token_id=pad, **sampling
            )
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, generation_config=config)
            for r, i in enumerate(rows):
                answers[i] = cut_at_eos(out[r, width:].tolist()[: max_tokens[i]], stops)
        return [answers[i] for i in range(len(prompts))]

    def close(self, graceful: bool = True) -> None:
        pass


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], str]:
    """A generated row up to and with its first end-of-turn token ("stop"), else whole ("length")."""
    for n, token in enumerate(tokens):
        if token in eos:
            return tokens[: n + 1], "stop"
    return tokens, "length"


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def answer_conversations(
    convs: list[Conversation], tokenizer, backend, spec: RegenSpec, eos: set[int], answer_pass: int = 0
) -> list[dict]:
    """Every conversation turn by turn: round t asks the t-th user turn of each conversation still going (its
    previous answer ended by itself and the templated history fits); at the temperature and seed of ``answer_pass``
    (a later pass's samples say which they are)."""
    temperature, seed = spec.answer_passes()[answer_pass]
    histories: dict[int, list[dict]] = {i: [] for i in range(len(convs))}
    samples = []
    going = list(range(len(convs)))
    for turn in range(spec.max_turns):
        asked, prompts = [], []
        for i in going:
            if turn >= len(convs[i].turns):
                continue
            messages = histories[i] + [{"role": "user", "content": convs[i].turns[turn]}]
            ids = template_ids(tokenizer, messages)
            if len(ids) <= spec.max_prompt_tokens:
                asked.append(i)
                prompts.append(ids)
                histories[i] = messages
        if not asked:
            break
        answers = backend.answer(prompts, [spec.max_new_tokens] * len(prompts), temperature, seed * 1_000_003 + turn)
        going = []
        for i, ids, (answer, finish) in zip(asked, prompts, answers):
            samples.append(
                {
                    "conversation": convs[i].id,
                    "source": convs[i].source,
                    "turn": turn,
                    "prompt": ids,
                    "answer": answer,
                    "finish": finish,
                    **({"pass": answer_pass} if answer_pass else {}),
                }
            )
            if finish == "stop":
                text = tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": text})
                going.append(i)
    return samples


def write_answers(samples: list[dict], path: Path) -> dict:
    tmp = path.with_suffix(".tmp")
    text = "".join(json.dumps(s) + "\n" for s in samples)
    tmp.write_text(text)
    os.replace(tmp, path)
    return {
        "file": path.name,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "samples": len(samples),
        "answer_tokens": sum(len(s["answer"]) for s in samples),
        "prompt_tokens": sum(len(s["prompt"]) for s in samples),
    }


def read_answers(path: Path) -> list[dict]:
    """The samples of one answers shard."""
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def regenerate(
    target_path: Path,
    pool_dir: Path,
    out: Path,
    spec: RegenSpec,
    how: BackendSpec,
    answer_tokens: int | None = None,
    progress: bool = True,
    deadline: float | None = None,
    chunks: set[int] | None = None,
) -> dict:
    """Write (or go on writing) answer shards into ``out`` until the pool is done or ``answer_tokens`` are written;
    ``deadline`` (a ``time.monotonic()`` value): no new group is started after it (a later run goes on from there).
    ``chunks``: answer only these chunks of the pool (e.g. the held-out bucket's first shards and those a run has not
    read yet); the others stay for a later run, and a shard is the same whichever run writes it. The index returned
    says whether the data is ``complete`` (the goal or the whole pool written) beside what the index file holds."""
    from specdec_kit.runtime.loader import load_tokenizer

    pool = read_pool(pool_dir)
    pool_manifest = json.loads((pool_dir / MANIFEST_FILE).read_text())
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / ANSWERS_INDEX
    converted = target_path / ".specdec-converted"
    settings = {
        "spec": asdict(spec),
        "pool_fingerprint": pool_manifest["fingerprint"],
        "target": converted.read_text() if converted.is_file() else str(target_path),
    }
    index = json.loads(index_path.read_text()) if index_path.is_file() else {**settings, "shards": []}
    key = settings_differ(index, settings)
    if key is not None:
        raise ValueError(
            f"{index_path}: written with another {key} ({index[key]!r}, now {settings[key]!r}); use "
            "another --out, or remove it to start over (passes may be added after those written)"
        )
    index["spec"] = settings["spec"]
    check_context(spec, target_path)
    tokenizer = load_tokenizer(target_path)
    eos: set[int] | None = None  # the backend's target says
    pool_chunks = [pool[i : i + spec.chunk] for i in range(0, len(pool), spec.chunk)]
    done = {s["file"] for s in index["shards"]}
    written = sum(s["answer_tokens"] for s in index["shards"])
    passes = range(len(spec.answer_passes()))
    if answer_tokens is not None and written >= answer_tokens:
        return {**index, "complete": True}
    backend = None
    bar = tqdm(
        total=answer_tokens,
        initial=written,
        desc=f"regenerate ({how.name})",
        unit="tok",
        disable=not progress,
        file=sys.stderr,
    )
    pending = [
        (p, c, convs)
        for p in passes
        for c, convs in enumerate(pool_chunks)
        if shard_name(p, c) not in done and (chunks is None or c in chunks)
    ]
    finished = False  # else interrupted (an error, or SIGTERM: exit_cleanly_on_signals): the engine ends at once
    try:
        for group in pass_groups(pending, max(how.group, 1)):
            if answer_tokens is not None and written >= answer_tokens:
                break
            if deadline is not None and time.monotonic() >= deadline:
                print(f"regenerate: time limit reached with {written} answer tokens written", file=sys.stderr)
                break
            if backend is None:
                backend, eos = open_backend(how, target_path, out, spec.max_prompt_tokens + spec.max_new_tokens)
            t0 = time.time()
            # answered together, written chunk by chunk: a chunk's samples and their order are the same as alone
            answer_pass = group[0][0]
            convs_asked = [x for _, _, convs in group for x in convs]
            samples = answer_conversations(convs_asked, tokenizer, backend, spec, eos, answer_pass)
            seconds = (time.time() - t0) / len(group)
            for _, c, convs in group:
                ids = {x.id for x in convs}
                entry = write_answers(
                    [s for s in samples if s["conversation"] in ids], out / shard_name(answer_pass, c)
                )
                if answer_pass:
                    entry["pass"] = answer_pass
                entry["seconds"] = round(seconds, 1)
                entry["backend"], entry["dtype"] = how.name, how.dtype if how.name == "vllm" else "float32"
                index["shards"].append(entry)
                written += entry["answer_tokens"]
                index["answer_tokens"] = written
                index["samples"] = sum(s["samples"] for s in index["shards"])
                index_path.write_text(json.dumps(index, indent=1))
                bar.update(entry["answer_tokens"])
                bar.set_postfix(tok_s=f"{entry['answer_tokens'] / max(seconds, 1e-3):.0f}", shard=c)
        finished = True
    finally:
        bar.close()
        if backend is not None:
            backend.close(graceful=finished)
    # complete: the goal is written or the whole pool is (not when chosen chunks or a deadline left shards out)
    reached = answer_tokens is not None and written >= answer_tokens
    return {**index, "complete": reached or len(index["shards"]) >= len(passes) * len(pool_chunks)}


def chunk_ranges(text: str) -> set[int]:
    """``0-15,112-164`` -> the chunk numbers it names (both ends included)."""
    chosen: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"chunks: {part!r} is not a number or a range like 112-164") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"chunks: {part!r} is not a range of shard numbers from low to high")
        chosen.update(range(first, last + 1))
    return chosen


def pass_groups(pending: list[tuple], size: int) -> list[list[tuple]]:
    """The pending (pass, chunk, conversations) in groups of ``size`` answered together, never two passes in one."""
    groups: list[list[tuple]] = []
    for item in pending:
        if groups and len(groups[-1]) < size and groups[-1][0][0] == item[0]:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def check_context(spec: RegenSpec, target_path: Path) -> None:
    """A prompt of ``max_prompt_tokens`` and its answer must fit the target's context: refused before any engine
    starts, rather than by the engine for the first long prompt."""
    config = target_path / "config.json"
    context = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    if context and spec.max_prompt_tokens + spec.max_new_tokens > context:
        raise ValueError(
            f"answers: max_prompt_tokens {spec.max_prompt_tokens} + max_new_tokens {spec.max_new_tokens} exceeds "
            f"the target's context of {context} tokens ({config}: max_position_embeddings)"
        )


def eos_ids(target_path: Path) -> set[int]:
    """The target's end-of-turn ids, as its generation config (else its config) gives them."""
    for name in ("generation_config.json", "config.json"):
        path = target_path / name
        ids = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if ids is not None:
            return {int(i) for i in (ids if isinstance(ids, list) else [ids])}
    return set()


def open_backend(how: BackendSpec, target_path: Path, out: Path, longest: int):
    """The backend and the end-of-turn ids its answers stop at. ``longest``: the most tokens a prompt and its answer
    take together (the engines' context length: vLLM and SGLang size their caches for it, 2048 at least)."""
    if how.name in ("kit", "engine"):
        if how.name == "engine" and how.engine is None:
            raise ValueError("the engine backend needs --engine DIR (an ONNX Runtime engine of the target)")
        backend = KitAnswers(target_path, how.batch, how.engine if how.name == "engine" else None)
        return backend, backend.eos
    if how.name == "transformers":
        eos = eos_ids(target_path)
        return TransformersAnswers(target_path, eos, how.batch), eos
    if how.name in ("vllm", "sglang"):
        eos = eos_ids(target_path)
        answers = EngineAnswers(
            how.name, target_path, sorted(eos), out, how.dtype, how.eager, how.tp, how.replicas, max(longest, 2048)
        )
        return answers, eos
    raise ValueError(f"unknown backend {how.name!r}: expected kit, engine, vllm, sglang or transformers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec_kit.train.regenerate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="smollm2", help="checkpoint directory, or a named target (smollm2)")
    p.add_argument("--pool", type=Path, help="prompt pool folder (default: $SPECDEC_CACHE/data/prompt-pool)")
    p.add_argument("--out", type=Path, required=True, help="answers folder (resumed when it exists)")
    p.add_argument(
        "--backend",
        choices=("kit", "engine", "vllm", "sglang", "transformers"),
        default="vllm",
        help="kit: the kit's runtime on the PyTorch target; engine: on an ONNX Runtime engine (--engine); "
        "vllm / sglang: that engine's offline engine in its own interpreter; transformers: Hugging Face's batched "
        "generate (CUDA when present)",
    )
    p.add_argument("--engine", type=Path, help="engine backend: the engine folder (export/build_engine.py)")
    p.add_argument("--answer-tokens", type=int, help="stop once this many answer tokens are written")
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="kit, engine and transformers backends: rows per batch (vLLM batches by itself)",
    )
    p.add_argument("--dtype", default="float32", help="vllm and sglang backends: the engine's dtype")
    p.add_argument("--tp", type=int, default=1, help="vllm and sglang backends: tensor-parallel GPUs per replica")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="vllm and sglang backends: data-parallel workers, each answering part of every request (each on its "
        "own --tp GPUs, or on a CPU its share of the cores)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="vllm backend: no torch.compile (quick start)")
    p.add_argument(
        "--group",
        type=int,
        default=1,
        help="chunks of the pool answered together (bigger batches, e.g. on a GPU); one shard each still",
    )
    p.add_argument(
        "--chunks",
        type=chunk_ranges,
        help="answer only these chunks of the pool (shard numbers), ranges comma-separated, e.g. 0-15,112-164",
    )
    p.add_argument("--spec", type=Path, help="JSON with RegenSpec fields")
    p.add_argument(
        "--time-limit", type=float, help="minutes: start no new group after them (a rerun goes on from there)"
    )
    args = p.parse_args(argv)
    from specdec_kit.runtime.loader import set_threads
    from specdec_kit.runtime.models.pretrained import cache_root, resolve_target
    from specdec_kit.train.background import exit_cleanly_on_signals, nice_own_session_and_say
    from specdec_kit.train.distill import run_stage

    set_threads()
    nice_own_session_and_say()
    exit_cleanly_on_signals()
    spec = RegenSpec(**json.loads(args.spec.read_text())) if args.spec else RegenSpec()
    return run_stage(
        lambda: regenerate(
            resolve_target(args.target),
            args.pool or cache_root() / "data" / "prompt-pool",
            args.out,
            spec,
            BackendSpec(
                args.backend,
                args.batch,
                args.dtype,
                args.engine,
                args.enforce_eager,
                args.group,
                args.tp,
                args.replicas,
            ),
            args.answer_tokens,
            deadline=None if args.time_limit is None else time.monotonic() + 60 * args.time_limit,
            chunks=args.chunks,
        ),
        ("samples", "answer_tokens", "pool_fingerprint"),
    )


if __name__ == "__main__":
    sys.exit(main())
