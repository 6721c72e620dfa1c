"""How varied a set of user turns is: the figures that compare the self-written source's prompts
with human-written ones (benchmarks/bench_diversity.py prints them).

- length spread: words per user turn (percentiles 5, 25, 50, 75, 95 and the mean) and characters
  (median);
- distinct-n (Li et al. 2016): distinct word n-grams over all n-grams of the set, n = 1, 2, 3,
  words lower-cased as eagle3/prepare/dedupe.py normalizes them. The ratio falls as a set grows,
  so sets are compared at one size (`sample`: a seeded sample of each);
- duplicates: the share of turns that repeat an earlier one of the set, exactly (case and
  punctuation aside) or nearly (word 3-shingle Jaccard >= the threshold), with 01's own filter
  (`DuplicateFilter`);
- task types: the share of each, by the record's steer label (`"steer": {"task": ...}`, written
  by a steered self-written source) where present, else by `classify_task`'s keyword rules (the
  first rule whose pattern the lower-cased text matches; `other` when none does).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from eagle3.prepare.dedupe import DuplicateFilter

PERCENTILES = (5, 25, 50, 75, 95)
# (task type, pattern), tried in order: the first match names the turn. The labels are those of
# the shipped steered recipes' `task` axis (datasets/smollm2_self_written_diverse.json).
TASK_RULES = (
    ("code", r"```|\b(python|javascript|typescript|java|c\+\+|rust|sql|bash|html|css|regex|"
             r"function|code|coding|program|script|bug|compile|algorithm|api|def|class|"
             r"implement)\b"),
    ("math", r"\b(calculate|solve|equation|integral|derivative|probability|percent|percentage|"
             r"math|prime|arithmetic|average|sum of|how many|how much)\b|\d\s*[-+*/^x×]\s*\d"),
    ("translate", r"\b(translat\w*|rephrase|paraphrase|in (french|spanish|german|chinese|"
                  r"japanese|italian))\b"),
    ("extraction", r"\b(summari[sz]e|summary|extract|classify|reformat|from the (following|"
                   r"text|passage|article)|identify (the|all)|in json)\b"),
    ("roleplay", r"\b(pretend|imagine (you are|yourself)|act as|role ?play|in the style of|"
                 r"as if you were|embody)\b"),
    ("writing", r"\b(write|compose|draft|essay|poem|story|email|letter|blog|post|article|"
                r"lyrics|slogan|tweet|speech|outline|tale)\b"),
    ("reasoning", r"\b(puzzle|riddle|logic|logical|deduce|true or false)\b"),
    ("compare", r"\b(compare|comparison|versus|vs|pros and cons|difference between)\b"),
    ("brainstorm", r"\b(ideas|suggest\w*|brainstorm|recommend\w*|names for|list of)\b"),
    ("advice", r"\b(should i|how can i|how do i|tips|advice|advise|help me|what should|"
               r"improve my|best way|looking for|planning|plan|assist|i need|i want)\b"),
    ("explain", r"\b(what|why|how|explain|describe|define|meaning|who|when|where|tell me|"
                r"information|is there|are there|is it)\b|\?"),
)
_RULES = tuple((label, re.compile(pattern)) for label, pattern in TASK_RULES)


def classify_task(text: str) -> str:
    """The task type of a user turn by keywords (see TASK_RULES), `other` when none matches."""
    low = text.lower()
    return next((label for label, rx in _RULES if rx.search(low)), "other")


@dataclass
class Turn:
    text: str
    label: str | None = None  # the record's steer label of its task, when it has one


class DiversityInputError(ValueError):
    """A record that holds no user turn to measure; the message names the file and line."""


def user_turns(records: list[tuple[str, dict]], first_only: bool = False) -> list[Turn]:
    """The user turns of conversation records (`(where, record)` pairs: `where` names the file
    and line in errors); `first_only` keeps each record's first user turn."""
    out = []
    for where, rec in records:
        messages = rec.get("messages") if isinstance(rec, dict) else None
        if not isinstance(messages, list):
            raise DiversityInputError(f"{where}: a record needs `messages` (a conversation or "
                                      "prompt-set record)")
        label = (rec.get("steer") or {}).get("task")
        users = [m["content"] for m in messages if isinstance(m, dict)
                 and m.get("role") == "user" and isinstance(m.get("content"), str)]
        if not users:
            raise DiversityInputError(f"{where}: no user turn with text content")
        out += [Turn(t, label) for t in (users[:1] if first_only else users)]
    return out


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all word n-grams of `texts` (0 when there are none)."""
    grams: list[tuple[str, ...]] = []
    for t in texts:
        words = DuplicateFilter.normalize(t).split()
        grams += [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def duplicate_rates(texts: list[str], threshold: float) -> dict:
    """Shares of texts that repeat an earlier one exactly, and exactly or nearly."""
    f = DuplicateFilter(threshold)
    counts = {"exact duplicate": 0, "near duplicate": 0}
    for t in texts:
        why = f.check(t)
        if why is None:
            f.add(t)
        else:
            counts[why] += 1
    n = max(len(texts), 1)
    return {"exact_dup_rate": round(counts["exact duplicate"] / n, 4),
            "near_dup_rate": round((counts["exact duplicate"] + counts["near duplicate"]) / n,
                                   4)}


def measure(turns: list[Turn], sample: int | None = None, seed: int = 0,
            near_dup_threshold: float = 0.8) -> dict:
    """The figures of the module doc for `turns` (a seeded sample of `sample` of them)."""
    if not turns:
        raise ValueError("no user turns to measure")
    if sample is not None and sample < len(turns):
        turns = random.Random(seed).sample(turns, sample)
    texts = [t.text for t in turns]
    words = [len(DuplicateFilter.normalize(t).split()) for t in texts]
    labels = [t.label or classify_task(t.text) for t in turns]
    shares = {lab: round(labels.count(lab) / len(labels), 4) for lab in sorted(set(labels))}
    return {
        "turns": len(turns),
        "words": {**{f"p{p}": round(percentile(words, p), 1) for p in PERCENTILES},
                  "mean": round(sum(words) / len(words), 1)},
        "chars_p50": round(percentile([len(t) for t in texts], 50), 1),
        **{f"distinct_{n}": round(distinct_n(texts, n), 4) for n in (1, 2, 3)},
        **duplicate_rates(texts, near_dup_threshold),
        "task_share": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
        "task_labelled_by": {"steer": sum(t.label is not None for t in turns),
                             "keywords": sum(t.label is None for t in turns)},
    }
