"""Prompts the target writes itself: the `self_written` source of stage 01 ("Magpie", Xu et al.
2024). An aligned chat model continued right after the opening of a user turn in its own chat
template (eagle3/prepare/opening.py) writes a plausible user request.

- A round samples candidates for the first user turn, `oversample x still needed / keep rate so
  far` of them in whole batches (at most `ROUND_BATCHES` batches a round), each batch with its
  own seed (dataset seed and name, round, batch). Candidates are judged in order, each rejection counted
  by reason: `too long` (no end of turn within `max_user_tokens`), `not closed` (ended by
  another stop token, eos), `empty`, `special token` (the text holds a template special token),
  `broken text` (U+FFFD or control characters), `too short` (< `min_user_chars`), `exact
  duplicate` (same words, case and punctuation aside) and `near duplicate`
  (eagle3/prepare/dedupe.py) of a prompt kept before. Candidates after the wanted number is
  reached are `surplus`, not judged.
- The first `heldout` kept prompts are the held-out set (single turn, never trained on); each
  later one starts a conversation of 1, 2 or 3 user turns (drawn from `turns`, seeded). For the
  longer ones the target answers greedily (at most `reply_max_new_tokens`; `<think>...</think>`
  moves to `reasoning_content`) and the next user turn is sampled after the reply, judged by the
  same rules against the conversation's own turns. A conversation ends early at its last user
  turn, counted by reason, when a reply is not closed, is empty or holds a special token, a
  later user turn is rejected, or another turn would leave no room under `max_seq_len` for the
  reply, the next user turn and 01b's last reply. Every conversation ends with a user turn:
  01b writes its last reply. With `keep_cut_replies`, a reply cut at `reply_max_new_tokens`
  stays in the conversation as written (closed by the template; counted) instead of ending it:
  the lever for long contexts from a target whose replies run long.
- `steer` (eagle3/prepare/steer.py) gives each candidate its own opening: a system prompt and/or
  the start of the user turn made from labelled options drawn under the seed; the records carry
  the labels (`"steer": {axis: label}`).
- Each round is one file (`round_NNNN.json`, written whole); a re-run replays the finished
  rounds and continues, so a killed run ends with the same conversations as an uninterrupted
  one. Once 100 candidates are judged and fewer than `MIN_KEEP_RATE` of them kept, the stage
  stops: the target does not write user turns after this opening.
- A generator in process (`Generator`, `run`) gets the batches one after another. A server one
  (`ConcurrentGenerator`, `run_async` in a running loop) is sent every batch of a phase at
  once, and several datasets' writers run in one event loop (eagle3/prepare/selfwritten_run.py)
  sharing its requests in flight: no batch, round or dataset waits for another's last replies.
  The batches, their seeds, and so the files, are the same either way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from eagle3.core.chat import ChatRenderer
from eagle3.core.progress import progress
from eagle3.core.records import RecordError
from eagle3.core.server import gather_or_cancel
from eagle3.core.stage import StageError, atomic_write_json
from eagle3.generate.jobs import seed_of
from eagle3.prepare.conversations import split_inline_reasoning
from eagle3.prepare.dedupe import DuplicateFilter
from eagle3.prepare.opening import Opening, TemplateCutError, derive_opening, next_user_ids
from eagle3.prepare.steer import UNSTEERED, Draw, SteerSpec

log = logging.getLogger(__name__)

REASONS = ("too long", "not closed", "empty", "special token", "broken text", "too short",
           "exact duplicate", "near duplicate")
# U+FFFD (bytes that decode to no character) and control characters other than tab and newlines
_BROKEN = re.compile("[\ufffd\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
ROUND_BATCHES = 8  # generation batches of candidates per round at most: the unit of resume
MIN_KEEP_RATE = 0.02  # below this share of judged candidates kept, the stage stops


class SelfWrittenError(StageError):
    """The target does not write usable user turns; the message gives the rates and reasons."""


class Generator(Protocol):
    """eagle3.generate.fast.FastGenerator's interface (and the server one's, and the tests')."""

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: list[int] | int,
                     temperature: float = 0.0, top_p: float = 1.0,
                     seed: int = 0) -> list[tuple[list[int], str]]: ...


@runtime_checkable
class ConcurrentGenerator(Protocol):
    """A generator over servers (eagle3.prepare.server_generator.ServerGenerator): the calls
    made together in one event loop share its requests in flight."""

    async def agenerate_ids(self, prompts: list[list[int]], max_new_tokens: list[int] | int,
                            temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                            stop=None) -> list[tuple[list[int], str]]: ...

    async def aclose(self) -> None: ...


@dataclass
class SelfWrittenSpec:
    """The `self_written` block of a recipe entry (its `count` and `seed` are the entry's)."""

    heldout: int = 0  # single-turn prompts kept apart in heldout.jsonl (05 --prompt-sets)
    temperature: float = 1.0  # sampling of user turns (> 0; the replies are greedy)
    top_p: float = 1.0  # nucleus of user-turn sampling, (0, 1]
    max_user_tokens: int = 128  # a user turn not closed within this many tokens is rejected
    min_user_chars: int = 16  # shorter user turns are rejected
    reply_max_new_tokens: int = 256  # budget of the target's replies between user turns
    turns: list = field(default_factory=lambda: [[1, 1.0]])  # [[user turns, weight], ...]
    near_dup_threshold: float = 0.8  # word 3-shingle Jaccard of a near duplicate, (0, 1]
    system: str | None = None  # system prompt; None = as the template sets it (its default)
    oversample: float = 1.3  # candidates per still-needed prompt, over the keep rate so far
    max_rounds: int = 100  # stop (with fewer conversations, warned) after this many rounds
    keep_cut_replies: bool = False  # a reply cut at reply_max_new_tokens stays (else: ends it)
    steer: Any = None  # eagle3.prepare.steer.SteerSpec's block; None = every opening the same

    def __post_init__(self) -> None:
        def bad(msg: str):
            raise ValueError(f"self_written: {msg}")

        if not isinstance(self.heldout, int) or self.heldout < 0:
            bad(f"heldout must be an integer >= 0, got {self.heldout!r}")
        if not self.temperature > 0:
            bad(f"temperature must be > 0 (user turns are sampled), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("max_user_tokens", "reply_max_new_tokens", "max_rounds"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_user_chars < 0:
            bad(f"min_user_chars must be >= 0, got {self.min_user_chars}")
        if not 0 < self.near_dup_threshold <= 1:
            bad(f"near_dup_threshold must be in (0, 1], got {self.near_dup_threshold}")
        if self.oversample < 1:
            bad(f"oversample must be >= 1, got {self.oversample}")
        if self.system is not None and not (isinstance(self.system, str) and self.system.strip()):
            bad("system must be a non-empty string, or null for the template's default")
        try:
            turns = [(int(n), float(w)) for n, w in self.turns]
        except (TypeError, ValueError):
            bad(f"turns must be [[user turns, weight], ...], got {self.turns!r}")
        if not turns or any(n < 1 or w <= 0 for n, w in turns) or \
                len({n for n, _ in turns}) != len(turns):
            bad(f"turns must list distinct user-turn counts >= 1 with weights > 0, got "
                f"{self.turns!r}")
        self.turns = [[n, w] for n, w in turns]
        if not isinstance(self.keep_cut_replies, bool):
            bad(f"keep_cut_replies must be true or false, got {self.keep_cut_replies!r}")
        if self.steer is not None and not isinstance(self.steer, SteerSpec):
            self.steer = SteerSpec.from_json(self.steer)

    @classmethod
    def from_json(cls, block: Any) -> "SelfWrittenSpec":
        if not isinstance(block, dict):
            raise ValueError(f"self_written must be an object, got {block!r}")
        known = {f.name for f in fields(cls)}
        if set(block) - known:
            raise ValueError(f"self_written has unknown fields {sorted(set(block) - known)}; "
                             f"known: {sorted(known)}")
        return cls(**block)

    @property
    def max_turns(self) -> int:
        return max(n for n, _ in self.turns)


@dataclass
class WriterState:
    """What the finished rounds decided (rebuilt from their files on resume)."""

    rounds: int = 0
    candidates: int = 0
    judged: int = 0
    surplus: int = 0
    rejected: dict = field(default_factory=lambda: {r: 0 for r in REASONS})
    kept: int = 0  # first user turns kept (held out or starting a conversation)
    conversations: list = field(default_factory=list)
    heldout: list = field(default_factory=list)
    ended_early: dict = field(default_factory=dict)  # reason -> conversations
    replies_cut_kept: int = 0  # replies cut at the budget and kept (keep_cut_replies)
    generated_tokens: int = 0
    seconds: float = 0.0


class SelfWriter:
    """Writes one dataset's conversations round by round into `cache` (see the module doc)."""

    def __init__(self, name: str, spec: SelfWrittenSpec, renderer: ChatRenderer, cache: Path,
                 *, count: int, seed: int, max_seq_len: int, batch_size: int,
                 load_generator: Callable[[], Generator]):
        self.name, self.spec, self.count, self.seed = name, spec, count, seed
        self.max_seq_len, self.renderer, self.tok = max_seq_len, renderer, renderer.tokenizer
        self.cache, self.batch = Path(cache), batch_size
        self._load_generator, self._generator = load_generator, None
        self.opening = derive_opening(renderer, spec.system)
        self.base = [{"role": "system", "content": spec.system}] if spec.system else []
        self._openings: dict[tuple, list[int]] = {}  # (system, prefix) -> opening ids
        self.state = WriterState()
        self.filter = DuplicateFilter(spec.near_dup_threshold)
        self._bar = self._stop = None

    @property
    def generator(self) -> Generator:
        if self._generator is None:  # loaded only when a round must be generated
            self._generator = self._load_generator()
        return self._generator

    @property
    def wanted(self) -> int:
        return self.count + self.spec.heldout

    # ------------------------------------------------------------ rounds

    def run(self, stop=None) -> WriterState:
        """`run_async` with no event loop (blocking): every batch one after another through
        `generate_ids`, whatever the generator."""
        return _run_without_loop(self.run_async(stop))

    async def run_async(self, stop=None) -> WriterState:
        """Replay the finished rounds, then write rounds until enough conversations; `stop` (a
        StopSignals) is checked between generation batches (and, with a ConcurrentGenerator in
        a running loop, before each request is sent)."""
        self.cache.mkdir(parents=True, exist_ok=True)
        st, self._stop = self.state, stop
        while (path := self.cache / f"round_{st.rounds + 1:04d}.json").exists():
            self._absorb(json.loads(path.read_text()), replay=True)
        if st.rounds:
            log.info("%s: %d self-written rounds already done (%d of %d prompts kept)",
                     self.name, st.rounds, st.kept, self.wanted)
            self._check_keep_rate()
        self._bar = progress(total=self.wanted, desc=f"01 self-written {self.name}",
                             unit="conv")
        self._bar.update(len(st.conversations) + len(st.heldout))
        try:
            while st.kept < self.wanted and st.rounds < self.spec.max_rounds:
                rnd = await self._round(st.rounds + 1)
                atomic_write_json(self.cache / f"round_{rnd['round']:04d}.json", rnd)
                self._absorb(rnd, replay=False)
                self._check_keep_rate()
        finally:
            self._bar.close()
        if st.kept < self.wanted:
            log.warning("%s: %d of %d prompts kept after %d rounds (max_rounds): the dataset "
                        "is smaller than the recipe asks", self.name, st.kept, self.wanted,
                        st.rounds)
        return st

    def _absorb(self, rnd: dict, replay: bool) -> None:
        st = self.state
        st.rounds = rnd["round"]
        st.candidates += rnd["candidates"]
        st.judged += rnd["judged"]
        st.surplus += rnd["surplus"]
        for k, n in rnd["rejected"].items():
            st.rejected[k] = st.rejected.get(k, 0) + n
        if replay:  # a live round added its prompts to the filter as it kept them
            for text in rnd["kept"]:
                self.filter.add(text)
        st.kept += len(rnd["kept"])
        st.conversations += rnd["conversations"]
        st.heldout += rnd["heldout"]
        for k, n in rnd["ended_early"].items():
            st.ended_early[k] = st.ended_early.get(k, 0) + n
        st.replies_cut_kept += rnd.get("replies_cut_kept", 0)  # rounds of older runs lack it
        st.generated_tokens += rnd["generated_tokens"]
        st.seconds += rnd["seconds"]

    def _check_keep_rate(self) -> None:
        st = self.state
        if st.judged < 100 or st.kept >= MIN_KEEP_RATE * st.judged:
            return
        top = ", ".join(f"{k} {n}" for k, n in sorted(st.rejected.items(), key=lambda kv: -kv[1])
                        if n)
        raise SelfWrittenError(
            f"{self.name}: the target kept {st.kept} of {st.judged} user turns it wrote "
            f"({100 * st.kept / st.judged:.1f}% < {100 * MIN_KEEP_RATE:.0f}%; rejected: {top}); "
            f"it does not write user requests after {self.opening.text[-60:]!r} (a base model? "
            f"see the rejected examples in {self.cache}/round_*.json)")

    def _candidates(self) -> int:
        """Candidates of the next round: whole batches, enough at the keep rate so far."""
        st = self.state
        rate = max(MIN_KEEP_RATE, st.kept / st.judged) if st.judged else 1.0
        n = min(math.ceil(self.spec.oversample * (self.wanted - st.kept) / rate),
                ROUND_BATCHES * self.batch)
        return self.batch * math.ceil(n / self.batch)

    async def _round(self, r: int) -> dict:
        t0 = time.perf_counter()
        spec, st = self.spec, self.state
        n = self._candidates()
        draws = [self.draw(r, k) for k in range(n)]
        outs = await self._generate([self.opening_ids(d) for d in draws], spec.max_user_tokens,
                                    spec.temperature, ("user", r), f"round {r}: user turns")
        rejected = {k: 0 for k in REASONS}
        examples: dict[str, list[str]] = {}
        kept: list[tuple[str, Draw]] = []
        room = self.wanted - st.kept
        for (ids, finish), d in zip(outs, draws):
            if len(kept) >= room:
                break
            text, why = self.judge(ids, finish, [self.filter], d.prefix)
            if why is None:
                self.filter.add(text)
                kept.append((text, d))
            else:
                rejected[why] += 1
                examples.setdefault(why, []).append(text[:300])
        judged = sum(rejected.values()) + len(kept)
        to_held = max(0, min(len(kept), spec.heldout - st.kept))
        heldout = [{"id": f"{self.name}/heldout-{st.kept + k:06d}", "source": self.name,
                    "messages": self.bases(d)[0] + [{"role": "user", "content": text}],
                    **({"steer": d.labels} if d.labels else {})}
                   for k, (text, d) in enumerate(kept[:to_held])]
        self._bar.update(len(heldout))
        firsts = {st.kept + k: kd for k, kd in enumerate(kept) if k >= to_held}
        convs, ended, more, cut = await self._conversations(r, firsts)
        return {"round": r, "seed": self.seed, "candidates": n, "judged": judged,
                "surplus": n - judged, "rejected": rejected, "kept": [t for t, _ in kept],
                "heldout": heldout, "conversations": convs, "ended_early": ended,
                "replies_cut_kept": cut,
                "rejected_examples": {k: v[:20] for k, v in examples.items()},
                "generated_tokens": sum(len(ids) for ids, _ in outs) + more,
                "seconds": round(time.perf_counter() - t0, 3)}

    def draw(self, r: int, k: int) -> Draw:
        """The steer of round `r`'s candidate `k` (UNSTEERED without a `steer` block)."""
        steer = self.spec.steer
        return UNSTEERED if steer is None else steer.draw(self.seed, self.name, r, k)

    def opening_ids(self, d: Draw) -> list[int]:
        """What the target continues to write a first user turn under the steer `d`."""
        key = (d.system, d.prefix)
        if key not in self._openings:
            opening: Opening = (self.opening if d.system is None
                                else derive_opening(self.renderer, d.system))
            self._openings[key] = self.renderer.encode(opening.text + d.prefix)
        return self._openings[key]

    def bases(self, d: Draw) -> tuple[list[dict], list[dict]]:
        """(the messages a conversation written under `d` starts with, those its later user
        turns are written after): the steering system prompt is in both with keep_system, in
        the second only otherwise."""
        if d.system is None:
            return self.base, self.base
        steered = [{"role": "system", "content": d.system}]
        return (steered if self.spec.steer.keep_system else self.base), steered

    def judge(self, ids: list[int], finish: str, filters: list[DuplicateFilter],
              prefix: str = "") -> tuple[str, str | None]:
        """(text, None) for a user turn to keep, else (text, reason); `prefix` is the start of
        the turn the opening gave (a steer's), which the text continues."""
        if finish != "stop":
            return prefix + self.tok.decode(ids, skip_special_tokens=False), "too long"
        raw = prefix + self.tok.decode(ids[:-1], skip_special_tokens=False)
        if not ids or ids[-1] != self.opening.stop_ids[0]:  # a server may answer nothing
            return raw, "not closed"
        text = raw.strip()
        if not text:
            return raw, "empty"
        if self.renderer.special_text_in([{"role": "user", "content": raw}]):
            return raw, "special token"
        if _BROKEN.search(text):
            return text, "broken text"
        if len(text) < self.spec.min_user_chars:
            return text, "too short"
        for f in filters:
            if why := f.check(text):
                return text, why
        return text, None

    async def _generate(self, prompts: list[list[int]], budget: int, temperature: float,
                        where: tuple, phase: str) -> list[tuple[list[int], str]]:
        """`prompts` in batches of `batch`, each batch seeded by (seed, where, its offset): all
        at once through a ConcurrentGenerator in a running loop, else one after another."""
        gen, top_p = self.generator, self.spec.top_p if temperature > 0 else 1.0
        starts = range(0, len(prompts), self.batch)
        seeds = [seed_of(self.seed, self.name, *where, b) for b in starts]
        if isinstance(gen, ConcurrentGenerator) and _loop_running():
            if self._stop is not None:
                self._stop.check()
            self._bar.set_postfix_str(f"{phase} ({len(prompts)})", refresh=False)
            outs = await gather_or_cancel(
                gen.agenerate_ids(prompts[b:b + self.batch], budget, temperature, top_p, s,
                                  self._stop) for b, s in zip(starts, seeds))
            return [o for out in outs for o in out]
        out: list[tuple[list[int], str]] = []
        for b, s in zip(starts, seeds):
            if self._stop is not None:
                self._stop.check()
            self._bar.set_postfix_str(f"{phase} {b}/{len(prompts)}", refresh=False)
            out += gen.generate_ids(prompts[b:b + self.batch], budget, temperature, top_p, s)
        return out

    # ------------------------------------------------------------ multi-turn

    async def _conversations(self, r: int,
                             firsts: dict[int, tuple[str, Draw]]) -> tuple[list, dict, int, int]:
        """Conversations started by this round's prompts; (records, early ends, tokens, cut
        replies kept)."""
        spec = self.spec
        convs, goals, filters, writing = [], [], [], []
        for index, (text, d) in firsts.items():
            rng = random.Random(seed_of(self.seed, self.name, "turns", index))
            goals.append(rng.choices([n for n, _ in spec.turns],
                                     [w for _, w in spec.turns])[0])
            base, write_base = self.bases(d)
            convs.append({"id": f"{index:06d}",
                          "messages": base + [{"role": "user", "content": text}],
                          **({"steer": d.labels} if d.labels else {})})
            writing.append((len(base), write_base))  # later user turns: written after these
            f = DuplicateFilter(spec.near_dup_threshold)
            f.add(text)
            filters.append(f)
        ended: dict[str, int] = {}
        alive = [g > 1 for g in goals]
        self._bar.update(len(convs) - sum(alive))
        tokens = cut = 0
        for turn in range(2, spec.max_turns + 1):
            active = [i for i in range(len(convs)) if alive[i] and goals[i] >= turn]
            prompts = {i: self.renderer.prompt_ids(convs[i]["messages"]) for i in active}
            # Room for this reply, the next user turn and 01b's last reply.
            need = 2 * spec.reply_max_new_tokens + spec.max_user_tokens
            for i in [i for i in active if len(prompts[i]) + need > self.max_seq_len]:
                self._end(i, alive, ended, "context limit")
            active = sorted((i for i in active if alive[i]), key=lambda i: -len(prompts[i]))
            if not active:
                break
            replies = await self._generate([prompts[i] for i in active],
                                           spec.reply_max_new_tokens, 0.0, ("reply", r, turn),
                                           f"round {r}: replies to user turn {turn - 1}")
            tokens += sum(len(ids) for ids, _ in replies)
            ready, user_prompts = [], []
            for i, (ids, finish) in zip(active, replies):
                msg, why = self._reply(ids, finish)
                if why is None:
                    cut += finish != "stop"
                    skip, write_base = writing[i]
                    try:
                        user_prompts.append(next_user_ids(
                            self.renderer, write_base + convs[i]["messages"][skip:] + [msg]))
                    except TemplateCutError:
                        why = "template cannot open a later user turn"
                if why is not None:
                    self._end(i, alive, ended, why)
                    continue
                convs[i]["messages"].append(msg)
                ready.append(i)
            users = await self._generate(user_prompts, spec.max_user_tokens, spec.temperature,
                                         ("user", r, turn), f"round {r}: user turns {turn}")
            tokens += sum(len(ids) for ids, _ in users)
            for i, (ids, finish) in zip(ready, users):
                text, why = self.judge(ids, finish, [filters[i]])
                if why is not None:
                    convs[i]["messages"].pop()  # end at the last user turn
                    self._end(i, alive, ended, f"user turn {turn}: {why}")
                    continue
                filters[i].add(text)
                convs[i]["messages"].append({"role": "user", "content": text})
                if goals[i] == turn:
                    alive[i] = False
                    self._bar.update(1)
        return convs, dict(sorted(ended.items())), tokens, cut

    def _end(self, i: int, alive: list[bool], ended: dict, why: str) -> None:
        alive[i] = False
        ended[why] = ended.get(why, 0) + 1
        self._bar.update(1)

    def _reply(self, ids: list[int], finish: str) -> tuple[dict | None, str | None]:
        """The assistant message of a greedy reply, or why the conversation ends before it; a
        reply cut at the budget is kept as written with `keep_cut_replies`."""
        closed = finish == "stop" and ids and ids[-1] == self.renderer.end_of_turn_id
        if not closed and not (self.spec.keep_cut_replies and finish == "length" and ids):
            return None, "reply not closed"
        msg = {"role": "assistant",
               "content": self.tok.decode(ids[:-1] if closed else ids, skip_special_tokens=False)}
        try:
            split_inline_reasoning(msg)
        except RecordError:
            return None, "reply reasoning not closed"
        if not msg["content"].strip() and not msg.get("reasoning_content", "").strip():
            return None, "reply empty"
        if self.renderer.special_text_in([msg]):
            return None, "reply special token"
        return msg, None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _run_without_loop(coro):
    """Run to its end a coroutine whose awaits all finish at once (SelfWriter's rounds over
    batches sent one after another), with no event loop, so that a generator called inside may
    run one of its own (the server generator's `generate_ids` does)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("SelfWriter.run: a generation call waited on an event loop; await "
                       "run_async in one instead")
