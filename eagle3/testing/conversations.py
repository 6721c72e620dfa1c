"""Synthetic conversation datasets written as a complete 01_prepared stage (tests, benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.core.stage import STAGE_DIRS, atomic_write_json

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def synthetic_conversations(n: int, source: str = "synth", long_every: int = 0,
                            long_words: int = 600) -> list[dict]:
    """`n` conversations in the 01 record shape: single and multi-turn, some with a system
    prompt or tools; every `long_every`-th (0 = none) has a long user turn."""
    convs = []
    for i in range(n):
        user = f"Question {i}: explain item {i * 7} in two sentences."
        if long_every and i % long_every == 0:
            user += " " + " ".join(f"word{k % 50}" for k in range(long_words))
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "content": f"Old answer {i}."}]
        if i % 3 == 1:
            msgs.insert(0, {"role": "system", "content": "You are a concise assistant."})
        if i % 4 == 2:  # a second user turn: the prompt keeps the first exchange as history
            msgs += [{"role": "user", "content": f"And item {i + 1}?"},
                     {"role": "assistant", "content": "Also old."}]
        conv = {"id": f"{source}/{i:05d}", "source": source, "messages": msgs}
        if i % 5 == 3:
            conv["tools"] = TOOLS
        convs.append(conv)
    return convs


def write_prepared_stage(workdir: Path, datasets: dict[str, list[dict]],
                         max_seq_len: int = 4096, regenerate: bool = True) -> Path:
    """Write `<workdir>/01_prepared/<name>/conversations.jsonl` and a complete manifest."""
    stage = Path(workdir) / STAGE_DIRS["01"]
    outputs = {}
    for name, convs in datasets.items():
        (stage / name).mkdir(parents=True, exist_ok=True)
        with (stage / name / "conversations.jsonl").open("w") as f:
            for c in convs:
                f.write(json.dumps(c) + "\n")
        outputs[name] = {"regenerate": regenerate, "max_seq_len": max_seq_len,
                         "records": len(convs)}
    atomic_write_json(stage / "manifest.json", {"stage": STAGE_DIRS["01"], "complete": True,
                                                "outputs": {"datasets": outputs}})
    return stage
