"""What a category's answers leave to gain: how much of them any lookup could copy, and the best a measured method did
prompt by prompt.

Model-free drafting proposes what followed an earlier occurrence of the last few tokens (in the prompt, the answer so
far). An answer token that no earlier occurrence of its k preceding tokens was followed by is one no lookup of k
tokens over the request's own text proposes, however it ranks candidates or sizes its tree (a shared trie of other
requests' responses may still): the share of answer tokens that some earlier occurrence does predict is the ceiling
of copying on that workload (and a serving team can count it over its own logs before choosing a draft). The best
method per prompt is the ceiling of any policy that picks among the measured methods request by request (a maximum
over noisy runs, so if anything above what such a policy would get): where even that median is short of a goal, no
choice between them reaches it, and what is missing is acceptance (a better head) or cheaper cycles.
"""

from __future__ import annotations

from statistics import median

ORDERS = (1, 2, 3)  # preceding tokens a lookup matches


def copyable(prompt: list[int], answer: list[int], orders: tuple[int, ...] = ORDERS) -> dict[int, int]:
    """For each k in ``orders``: how many of ``answer``'s tokens follow an earlier occurrence (in ``prompt`` + the
    answer before them) of the k tokens before them."""
    sequence = list(prompt) + list(answer)
    seen: dict[int, dict[tuple[int, ...], set[int]]] = {k: {} for k in orders}
    found = dict.fromkeys(orders, 0)
    for j, token in enumerate(sequence):
        for k in orders:
            if j < k:
                continue
            key = tuple(sequence[j - k : j])
            followers = seen[k].setdefault(key, set())
            if j >= len(prompt) and token in followers:
                found[k] += 1
            followers.add(token)
    return found


def copy_shares(results: dict, sets: dict[str, list[list[int]]], temperature: float = 0.0) -> list[dict]:
    """Per category, over plain decoding's answers at ``temperature`` (``speedup.measure``'s runs keep each answer's
    tokens): the answer tokens and the share copyable after each k."""
    out = []
    for (category, temp, method), runs in results.items():
        if method != "plain" or temp != temperature:
            continue
        totals, tokens = dict.fromkeys(ORDERS, 0), 0
        for (prompt, _), run in runs.items():
            if "output" not in run:
                continue
            for k, n in copyable(sets[category][prompt], run["output"]).items():
                totals[k] += n
            tokens += len(run["output"])
        if tokens:
            out.append(
                {
                    "prompt_set": category,
                    "temperature": temp,
                    "answer_tokens": tokens,
                    "copyable": {str(k): totals[k] / tokens for k in ORDERS},
                }
            )
    return out


def best_per_prompt(rows: list[dict]) -> list[dict]:
    """Per (set, temperature): the median over prompts of the best speedup any method had on that prompt (end to end
    and decoding alone), beside the best single method's median, and how often each method was the best."""
    out = []
    for key in dict.fromkeys((r["prompt_set"], r["temperature"]) for r in rows):
        mine = [r for r in rows if (r["prompt_set"], r["temperature"]) == key and r.get("by_prompt")]
        if not mine:
            continue
        prompts = sorted({p["prompt"] for r in mine for p in r["by_prompt"]})
        best, best_decoding, wins = [], [], {}
        for prompt in prompts:
            entries = [(p, r["method"]) for r in mine for p in r["by_prompt"] if p["prompt"] == prompt]
            top, method = max(entries, key=lambda e: e[0]["speedup"])
            best.append(top["speedup"])
            wins[method] = wins.get(method, 0) + 1
            decoding = [p["decode_speedup"] for p, _ in entries if p["decode_speedup"] is not None]
            if decoding:
                best_decoding.append(max(decoding))
        leader = max(mine, key=lambda r: r["speedup"])
        out.append(
            {
                "prompt_set": key[0],
                "temperature": key[1],
                "prompts": len(prompts),
                "best_per_prompt": median(best),
                "best_per_prompt_decoding": median(best_decoding) if best_decoding else None,
                "best_method": leader["method"],
                "best_method_speedup": leader["speedup"],
                "wins": wins,
            }
        )
    return out


def ceiling_table(shares: list[dict], best: list[dict]) -> list[str]:
    """The two ceilings side by side, one line per category (markdown)."""
    copy = {(s["prompt_set"], s["temperature"]): s for s in shares}
    header = " / ".join(str(k) for k in ORDERS)
    lines = [
        "Per category: the share of plain decoding's answer tokens that follow an earlier occurrence of their "
        f"{header} preceding tokens (the most any lookup could copy), and the speedup over plain decoding end to end "
        "(decoding alone) of the best method prompt by prompt, median over prompts, beside the best single method's "
        "median",
        "",
        f"| category | T | answer tokens | copyable after {header} tokens | best method per prompt | best method "
        "| its median | best per prompt, by method |",
        "|---|---:|---:|---|---:|---|---:|---|",
    ]
    for b in best:
        s = copy.get((b["prompt_set"], b["temperature"]))
        tokens = str(s["answer_tokens"]) if s else "-"
        shares_cell = " / ".join(f"{s['copyable'][str(k)]:.0%}" for k in ORDERS) if s else "-"
        decoding = f" ({b['best_per_prompt_decoding']:.2f}x)" if b["best_per_prompt_decoding"] is not None else ""
        wins = ", ".join(f"{m} {n}" for m, n in sorted(b["wins"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {b['prompt_set']} | {b['temperature']:g} | {tokens} | {shares_cell} | {b['best_per_prompt']:.2f}x"
            f"{decoding} | {b['best_method']} | {b['best_method_speedup']:.2f}x | {wins} |"
        )
    return lines
