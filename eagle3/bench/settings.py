"""The speculative settings stage 05 compares on SGLang: one server each, one baseline for all.

A setting is what SGLang's EAGLE3 flags make of the draft: `speculative_num_steps` (draft steps
a round), `speculative_eagle_topk` (branches kept a step; 1 is a chain) and
`speculative_num_draft_tokens` (tokens the target verifies a round). 05 reads them from each
server's `/server_info`, never from the flags it was given, so that a server is labelled and
its flags printed as it serves: `chain 3` (3 steps, topk 1), `tree 4x2/8` (4 steps, topk 2, 8
tokens verified).

Servers come from `--spec-url` (attached, several URLs) or `--spec-args` (launched, one flag
string a server, one after the other). Their roles are `speculative`, `speculative-2`, ... in
that order: the first keeps the single-server name, so that a run of one setting writes the
results, requests and server logs it always wrote. Two servers of the same setting measure the
same thing twice (a copy-paste slip in a command): refused, naming both.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from eagle3.core.preflight import PreflightError

SETTING_KEYS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
# The SGLang flag of each key, in the order the served flags are printed.
SETTING_FLAGS = dict(zip(SETTING_KEYS, ("--speculative-num-steps", "--speculative-eagle-topk",
                                        "--speculative-num-draft-tokens")))


@dataclass(frozen=True)
class SpecServer:
    """One speculative server 05 is told about, before it is asked anything."""

    role: str  # "speculative", "speculative-2", ...: its name in results.json and requests.jsonl
    source: str  # the flag that gave it, for errors: "--spec-url #2", "--spec-args #2 ('...')"
    url: str | None = None  # attached; None: launched here (the URL is known once it runs)
    spec_args: str | None = None  # launched: its flags beyond 05's own


def spec_role(i: int) -> str:
    """The role of the i-th speculative server (0-based)."""
    return "speculative" if i == 0 else f"speculative-{i + 1}"


def spec_servers(spec_url: list[str] | None, spec_args: list[str],
                 attached: bool) -> list[SpecServer]:
    """The speculative servers of a run, in the order they are measured."""
    if attached:
        return [SpecServer(spec_role(i), f"--spec-url #{i + 1}", url=url)
                for i, url in enumerate(spec_url or [])]
    return [SpecServer(spec_role(i), f"--spec-args #{i + 1} ({args!r})", spec_args=args)
            for i, args in enumerate(spec_args)]


def setting_of(info: dict) -> tuple:
    """(steps, topk, draft tokens) a server reports; None where it does not say."""
    return tuple(info.get(k) for k in SETTING_KEYS)


def label(info: dict) -> str:
    """`chain 3`, `tree 4x2/8`; the algorithm's name when the server reports no steps."""
    steps, topk, tokens = setting_of(info)
    if steps is None:
        return f"{info.get('speculative_algorithm')} (steps not reported)"
    if topk in (None, 1):
        return f"chain {steps}"
    return f"tree {steps}x{topk}/{'?' if tokens is None else tokens}"


def serve_flags(info: dict, draft_dir: Path | str) -> str:
    """The SGLang flags that start a server of this setting with the draft it served (its
    `speculative_draft_model_path`, else the folder 05 checked)."""
    draft = info.get("speculative_draft_model_path") or str(draft_dir)
    flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
             shlex.quote(str(draft))]
    for key, flag in SETTING_FLAGS.items():
        if info.get(key) is not None:
            flags += [flag, str(info[key])]
    return " ".join(flags)


def requested_setting(spec_args: str) -> tuple:
    """(steps, topk, draft tokens) a `--spec-args` string asks for; None where it does not
    say (SGLang then picks)."""
    tokens, found = shlex.split(spec_args), dict.fromkeys(SETTING_KEYS)
    flags = {flag: key for key, flag in SETTING_FLAGS.items()}
    for i, tok in enumerate(tokens):
        name, eq, value = tok.partition("=")
        if name in flags and (eq or i + 1 < len(tokens)):
            found[flags[name]] = value if eq else tokens[i + 1]
    return tuple(found.values())


# Flags 05 sets itself on every speculative server it launches: EAGLE3 (EAGLE with an EAGLE-3
# draft starts, then accepts about 1 token a round: docs/PIPELINE.md) and the draft it checked.
OWN_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path")


def check_spec_args(spec_args: list[str]) -> None:
    """ValueError naming a `--spec-args` string that sets one of 05's own flags, or two that
    would start the same setting (the same flags, or the same three settings given in full)."""
    for i, args in enumerate(spec_args):
        own = [t.partition("=")[0] for t in shlex.split(args) if t.partition("=")[0] in OWN_FLAGS]
        if own:
            raise ValueError(f"--spec-args #{i + 1} ({args!r}) sets {own[0]}: 05 starts every "
                             "speculative server with --speculative-algorithm EAGLE3 and "
                             "--speculative-draft-model-path <--draft> itself (EAGLE with an "
                             "EAGLE-3 draft serves with acceptance about 1). Leave it out")
    seen: dict[tuple, int] = {}
    for i, args in enumerate(spec_args):
        keys = [tuple(shlex.split(args))]
        asked = requested_setting(args)
        if None not in asked:
            keys.append(asked)
        for key in keys:
            if key in seen:
                j = seen[key]
                raise ValueError(f"--spec-args #{j + 1} ({spec_args[j]!r}) and #{i + 1} "
                                 f"({args!r}) start the same speculative setting: give each "
                                 "setting once")
            seen[key] = i


def check_distinct_urls(spec_url: list[str]) -> None:
    """ValueError naming a URL given twice to `--spec-url`."""
    norm = [u.rstrip("/") for u in spec_url]
    for i, url in enumerate(norm):
        if url in norm[:i]:
            raise ValueError(f"--spec-url lists {url} twice (#{norm.index(url) + 1} and "
                             f"#{i + 1}): give each speculative server once")


class SeenSettings:
    """The settings of the servers inspected so far; `add` refuses a second server of one."""

    def __init__(self):
        self._by_setting: dict[tuple, str] = {}

    def add(self, info: dict, source: str) -> None:
        """PreflightError naming both servers when `info` reports a setting seen already (all
        three keys known: a server that reports none cannot be told apart)."""
        key = setting_of(info)
        if None in key:
            return
        if key in self._by_setting:
            raise PreflightError(
                f"{self._by_setting[key]} and {source} serve the same speculative setting "
                f"({label(info)}: {', '.join(f'{k} {v}' for k, v in zip(SETTING_KEYS, key))}): "
                "05 would measure it twice. Give each setting once")
        self._by_setting[key] = source


def served_setting(server: SpecServer, info: dict, url: str, draft_dir: Path | str) -> dict:
    """What results.json records of one speculative setting (its `settings` list)."""
    return {"role": server.role, "label": label(info), "url": url, "source": server.source,
            "spec_args": server.spec_args, **dict(zip(SETTING_KEYS, setting_of(info))),
            "serve_flags": serve_flags(info, draft_dir)}
