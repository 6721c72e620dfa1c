"""Every command of train_plan_v4.md, README.md, BENCHMARKS.md and docs/*.md runs through the
real argument parsers.

Shell code blocks are split into commands (line continuations joined, comments, redirections
and pipes cut, `VAR=value` prefixes kept aside). Our scripts (`python NN_*.py`, `python
datasets/merge_and_shuffle.py`, `python -m eagle3.*`, `torchrun ... 04_train.py`) are parsed by
their own parsers — `main(argv)` runs until its config is parsed and validated, then stops — so
an unknown or misspelt flag, a bad choice or a missing required flag fails here. torchrun's own
flags go through torch's parser. `python -m sglang.launch_server` commands are checked against
the flags of a pinned SGLang release, read from its real source (`pip download --no-deps`, cached
under `$EAGLE3_CACHE_DIR` or `~/.cache/eagle3`; skipped with the reason when neither cached nor
downloadable). `EAGLE3_*` variables must exist in eagle3/.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("train_plan_v4.md", "README.md", "BENCHMARKS.md",  # and the pages the README links
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
SGLANG_VERSION = "0.5.23"  # the release the plan's server commands are written for
KIMI_TARGET = "/models/Kimi-K2.5"  # the plan's target folder; the tiny target stands in here
# Modules whose main() has no parser and is harmless to run (prints a table).
NO_PARSER_OK = {"eagle3.core.run_summary"}


@dataclass
class Command:
    where: str  # file:line
    argv: list[str]
    env: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


# ---------------------------------------------------------------- extraction


FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
REDIRECT = re.compile(r"\s\d?(>>?|<)\s*(&\d+|\S+)")
SEPARATORS = {";", "&&", "||", "|", "&", "|&"}
WRAPPERS = {"nohup", "time", "exec", "env"}


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of the shell code blocks of a markdown text."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1).strip() in ("bash", "sh", "shell", "console", ""):
            out.append((text[: m.start(2)].count("\n") + 1, m.group(2)))
    return out


def split_commands(body: str, where: str, first_line: int = 1) -> list[Command]:
    """The simple commands of a shell block, with their `VAR=value` prefixes."""
    commands = []
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):  # continuation
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        i += 1
        lex = shlex.shlex(REDIRECT.sub(" ", " " + line), posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, "#"
        current: list[str] = []
        for token in list(lex) + [";"]:
            if token in SEPARATORS:
                if current:
                    commands.append(_command(current, f"{where}:{first_line + start}"))
                current = []
            else:
                current.append(token)
    return commands


def _command(tokens: list[str], where: str) -> Command:
    env = {}
    while tokens and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0])
                      or tokens[0] in WRAPPERS):
        if "=" in tokens[0]:
            key, value = tokens[0].split("=", 1)
            env[key] = value
        tokens = tokens[1:]
    return Command(where, tokens, env)


def doc_commands(doc: str) -> list[Command]:
    text = (ROOT / doc).read_text()
    return [c for line, body in shell_blocks(text) for c in split_commands(body, doc, line)]


def is_python(token: str) -> bool:
    return bool(re.fullmatch(r"python[0-9.]*|\$\{?PY\}?", token))


def kind(cmd: Command) -> str | None:
    """'script', 'module', 'sglang', 'torchrun', 'bash' or None (not ours to check)."""
    a = cmd.argv
    if not a:
        return None
    if a[0] == "torchrun":
        return "torchrun"
    if a[0] == "bash" and len(a) > 1 and a[1].endswith(".sh"):
        return "bash"
    if is_python(a[0]) and len(a) > 1:
        if a[1] == "-m" and len(a) > 2:
            return "sglang" if a[2] == "sglang.launch_server" else (
                "module" if a[2].startswith("eagle3.") else None)
        if a[1].endswith(".py"):
            return "script"
    return None


# ---------------------------------------------------------------- parsing with our parsers


class _Parsed(Exception):
    pass


def _load_script(path: Path):
    """A script loaded as a module once (registered first: its dataclasses need that)."""
    name = "plan_check_" + re.sub(r"\W", "_", str(path.relative_to(ROOT)))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def parse_with_own_parser(module, argv: list[str], what: str) -> None:
    """Run `module.main(argv)` until its arguments are parsed (and the config validated), then
    stop it; raises AssertionError with the parser's message on a bad command line."""
    from eagle3.core import cli

    real_parse_config = cli.parse_config

    def parse_config_then_stop(cls, args, description=None):
        raise _Parsed(real_parse_config(cls, args, description))

    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_args_then_stop(self, args=None, namespace=None):
        raise _Parsed(real_parse_args(self, args, namespace))

    patches = [mock.patch.object(module, "parse_config", parse_config_then_stop)
               if hasattr(module, "parse_config") else
               mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args_then_stop)]
    err = StringIO()
    with patches[0], redirect_stderr(err), redirect_stdout(StringIO()):
        try:
            module.main(argv)
        except _Parsed:
            return
        except SystemExit as e:
            raise AssertionError(f"{what}: rejected by its parser (exit {e.code}):\n"
                                 f"{err.getvalue()[-1500:]}") from None
    if module.__name__ not in NO_PARSER_OK:
        raise AssertionError(f"{what}: main() returned without parsing its arguments")


def check_ours(cmd: Command, paths: dict[str, str] | None = None) -> None:
    """Parse one of our commands; raises AssertionError naming it on any problem. `paths` maps
    path prefixes of the real host (the target folder) to local stand-ins, for configs that
    check what a path holds."""
    k, a = kind(cmd), cmd.argv
    for real, local in (paths or {}).items():
        a = [local + t[len(real):] if t.startswith(real) else t for t in a]
    if k == "bash":
        assert (ROOT / a[1]).is_file(), f"{cmd}: {a[1]} does not exist"
        return
    if k == "torchrun":
        from torch.distributed.run import get_args_parser

        err = StringIO()
        try:
            with redirect_stderr(err):
                ns = get_args_parser().parse_args(a[1:])
        except SystemExit:
            raise AssertionError(f"{cmd}: torchrun rejects it:\n{err.getvalue()}") from None
        a = ["python", ns.training_script, *ns.training_script_args]
    if a[1] == "-m":
        module = importlib.import_module(a[2])
        parse_with_own_parser(module, a[3:], str(cmd))
    else:
        path = ROOT / a[1]
        assert path.is_file(), f"{cmd}: {a[1]} does not exist in the repository"
        parse_with_own_parser(_load_script(path), a[2:], str(cmd))
    for var in cmd.env:
        if var.startswith("EAGLE3_"):
            assert var in _eagle3_sources(), f"{cmd}: no code reads {var}"
    for token in a:  # files of this repository that a command names must exist
        path = ROOT / token
        if (not token.startswith(("/", "-", "runs/")) and "/" in token
                and token.endswith((".json", ".jsonl", ".py", ".sh", ".toml"))):
            assert path.is_file(), f"{cmd}: {token} does not exist in the repository"


def _eagle3_sources() -> str:
    return "".join(p.read_text() for p in (ROOT / "eagle3").rglob("*.py"))


# ---------------------------------------------------------------- SGLang's flags


def sglang_flags_from_sources(sources: dict[str, str]) -> set[str]:
    """Every `--flag` a release's server accepts: literal flags (`add_argument("--x")`,
    aliases, `cli_name=`) anywhere in the argument code, plus the dataclass fields that newer
    releases turn into flags (`name: A[...]` -> `--name` unless `no_cli=True`)."""
    flags = set()
    for text in sources.values():
        flags |= set(re.findall(r"""["'](--[a-z0-9][a-z0-9-]*)["']""", text))
    for path, text in sources.items():
        if "/arg_groups/" not in path:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            for st in node.body:
                ann = getattr(st, "annotation", None)
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                        and isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
                        and ann.value.id == "A"):
                    src = ast.get_source_segment(text, ann) or ""
                    if "no_cli=True" not in src and "cli_name=" not in src:
                        flags.add("--" + st.target.id.replace("_", "-"))
    return flags


def _cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3")


def sglang_flags(version: str) -> set[str] | str:
    """The flags of `sglang.launch_server` in a release (cached), or why they are unknown."""
    cache = _cache_root() / "sglang_server_flags" / f"{version}.json"
    if cache.is_file():
        return set(json.loads(cache.read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp,
                   "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                   "--abi", "cp311", "--platform", "manylinux_2_34_x86_64",
                   "--retries", "1", "--timeout", "30", f"sglang=={version}"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=600)
            wheel = next(Path(tmp).glob("sglang-*.whl"))
        except (subprocess.SubprocessError, OSError, StopIteration) as e:
            return f"SGLang {version} neither cached in {cache} nor downloadable: {e!r}"[:400]
        with zipfile.ZipFile(wheel) as z:
            sources = {n: z.read(n).decode() for n in z.namelist()
                       if n == "sglang/srt/server_args.py"
                       or (n.startswith("sglang/srt/arg_groups/") and n.endswith(".py"))}
    flags = sglang_flags_from_sources(sources)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(sorted(flags)))
    return flags


def unknown_sglang_flags(cmd: Command, flags: set[str]) -> list[str]:
    used = [t.split("=", 1)[0] for t in cmd.argv[3:] if t.startswith("--")]
    return [f for f in used if f not in flags]


# ---------------------------------------------------------------- the tests


def embedded_sglang_commands(cmd: Command) -> list[Command]:
    """SGLang flags that 05_benchmark.py passes on to the servers it launches."""
    out = []
    if kind(cmd) == "script" and cmd.argv[1].endswith("05_benchmark.py") and not any(
            a == "vllm" and b == "--backend" for b, a in zip(cmd.argv, cmd.argv[1:])):
        for i, flag in enumerate(cmd.argv):
            if flag not in ("--launch-args", "--spec-args"):
                continue
            values = cmd.argv[i + 1:i + 2]  # --spec-args: one flag string a server, or several
            while flag == "--spec-args" and i + 1 + len(values) < len(cmd.argv) \
                    and " " in cmd.argv[i + 1 + len(values)]:
                values.append(cmd.argv[i + 1 + len(values)])
            out += [Command(f"{cmd.where} ({flag})",
                            ["python", "-m", "sglang.launch_server", *shlex.split(value)])
                    for value in values]
    return out


ALL = [c for doc in DOCS for c in doc_commands(doc)]
OURS = [c for c in ALL if kind(c) in ("script", "module", "torchrun", "bash")]
SGLANG = [c for c in ALL if kind(c) == "sglang"] + [e for c in OURS
                                                     for e in embedded_sglang_commands(c)]


@pytest.fixture(scope="module")
def kimi_like_target(tiny_target_dir, tmp_path_factory):
    """The tiny target with its tokenizer shipped as code, as Kimi-K2.5's: the plan's commands
    that load it must pass --trust-remote-code."""
    from dataset_helpers import code_shipping_target

    return code_shipping_target(tiny_target_dir, tmp_path_factory.mktemp("kimi") / "target")


@pytest.mark.parametrize("cmd", OURS, ids=[c.where for c in OURS])
def test_doc_command_parses_with_the_scripts_own_parser(cmd, kimi_like_target):
    check_ours(cmd, {KIMI_TARGET: str(kimi_like_target)})


def test_command_loading_a_code_shipping_target_fails_without_the_flag(kimi_like_target):
    (cmd,) = split_commands(f"python 03_build_vocab_mapping.py --workdir w --target "
                            f"{kimi_like_target}", "doc")
    with pytest.raises(AssertionError, match="--trust-remote-code"):
        check_ours(cmd)


def test_plan_has_a_command_for_every_stage_and_server():
    plan = " ".join(shlex.join(c.argv) for c in doc_commands("train_plan_v4.md"))
    for script in ("01_prepare_datasets.py", "01b_generate_synthetic.py",
                   "datasets/merge_and_shuffle.py", "02b_extract_hidden_states_sglang.py",
                   "03_build_vocab_mapping.py", "04_train.py", "05_benchmark.py",
                   "-m eagle3.extract.patching", "--check-only"):
        assert script in plan, script
    servers = [c for c in SGLANG if c.where.startswith("train_plan_v4.md")]
    assert any("(--launch-args)" in c.where for c in servers)  # 05 launches its servers
    assert any("EAGLE3_DUMP_DIR" in c.env for c in servers)  # the dump server
    assert any("EAGLE3" in c.argv for c in servers)  # the serving command
    assert len(servers) >= 3  # generation, dump, serving


def test_plan_sglang_commands_use_only_flags_of_the_pinned_release():
    flags = sglang_flags(SGLANG_VERSION)
    if isinstance(flags, str):
        pytest.skip(flags)
    bad = {str(c): unknown_sglang_flags(c, flags) for c in SGLANG}
    assert not {k: v for k, v in bad.items() if v}, bad
    for c in SGLANG:
        for var in c.env:
            if var.startswith("EAGLE3_"):
                assert var in _eagle3_sources(), f"{c}: no code reads {var}"


def test_sglang_flag_extraction_knows_old_and_new_layouts():
    old = {"sglang/srt/server_args.py": 'parser.add_argument(\n  "--disable-radix-cache", '
                                        'action="store_true")\nparser.add_argument("--tp-size")'}
    new = {"sglang/srt/arg_groups/fields/memory.py": (
        "class Memory(Struct):\n"
        "    disable_radix_cache: A[bool, 'help'] = False\n"
        "    tp_size: A[int, Arg(help='x', aliases=['--tensor-parallel-size'])] = 1\n"
        "    hidden: A[str, Arg(no_cli=True)] = 'a'\n"
        "    fp8_gemm: A[str, Arg(cli_name='--fp8-gemm-backend')] = 'a'\n")}
    assert sglang_flags_from_sources(old) == {"--disable-radix-cache", "--tp-size"}
    assert sglang_flags_from_sources(new) == {"--disable-radix-cache", "--tp-size",
                                              "--tensor-parallel-size", "--fp8-gemm-backend"}


def test_split_commands_joins_continuations_and_drops_redirections_and_pipes():
    body = ("# a comment\nEAGLE3_DUMP_DIR=/d nohup python -m sglang.launch_server --tp-size 8 \\\n"
            "    --disable-radix-cache > dump.log 2>&1 &\n"
            "python 03_build_vocab_mapping.py --workdir w --target t | tee log.txt\n"
            "df -h /data && python -m eagle3.extract.patching --check\n")
    cmds = split_commands(body, "doc")
    assert [c.argv for c in cmds] == [
        ["python", "-m", "sglang.launch_server", "--tp-size", "8", "--disable-radix-cache"],
        ["python", "03_build_vocab_mapping.py", "--workdir", "w", "--target", "t"],
        ["tee", "log.txt"], ["df", "-h", "/data"], ["python", "-m", "eagle3.extract.patching", "--check"]]
    assert cmds[0].env == {"EAGLE3_DUMP_DIR": "/d"} and cmds[0].where == "doc:2"
    assert [kind(c) for c in cmds] == ["sglang", "script", None, None, "module"]


@pytest.mark.parametrize("line, message", [
    ("python 03_build_vocab_mapping.py --workdir w --target t --draft-vocab-size 32000",
     "unrecognized arguments: --draft-vocab-size"),
    ("python 03_build_vocab_mapping.py --workdir w", "--target"),  # a required flag missing
    ("python 05_benchmark.py --workdir w --backend trtllm", "invalid choice"),
    ("python 05_benchmark.py --workdir w --backend hf", "needs --target"),  # __post_init__
    ("python -m eagle3.extract.patching --chek", "unrecognized arguments"),
    ("torchrun --nproc-per-node 8 04_train.py --workdir w --target t --epochz 3", "--epochz"),
    ("python 09_missing.py --x", "does not exist"),
])
def test_check_ours_fails_when_a_command_is_wrong(line, message):
    (cmd,) = split_commands(line, "doc")
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_ours(cmd)


def test_unknown_sglang_flags_are_named():
    (cmd,) = split_commands("python -m sglang.launch_server --tp-size 8 --speculative-algo EAGLE3"
                            " --port=30000", "doc")
    assert unknown_sglang_flags(cmd, {"--tp-size", "--port"}) == ["--speculative-algo"]


# ---------------------------------------------------------------- vLLM's flags


VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"
# Parses each command line (a JSON list of argv lists on stdin) with vLLM's own server parser.
VLLM_PARSE = """
import contextlib, io, json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        print(json.dumps(None))
    except SystemExit:
        print(json.dumps(err.getvalue()[-400:]))
"""


def vllm_server_args(cmd: Command) -> list[str] | None:
    """The server flags of `vllm serve MODEL ...`, `python -m vllm...api_server ...`, or of
    `05_benchmark.py --backend vllm --launch-args ...` (05 adds --model and --port)."""
    a = cmd.argv
    if a[:2] == ["vllm", "serve"] and len(a) > 2:
        return ["--model", *a[2:]]
    if a and is_python(a[0]) and a[1:3] == ["-m", VLLM_API_SERVER]:
        return a[3:]
    if kind(cmd) == "script" and a[1].endswith("05_benchmark.py") and "vllm" in a[1:]:
        if "--launch-args" in a:
            return ["--model", "/models/m", *shlex.split(a[a.index("--launch-args") + 1])]
    return None


VLLM = [c for c in ALL if vllm_server_args(c) is not None]


def test_plan_vllm_commands_parse_with_vllms_own_parser(vllm_python):
    plan = [c for c in VLLM if c.where.startswith("train_plan_v4.md")]
    assert any(c.argv[:2] == ["vllm", "serve"] for c in plan)  # the serving command
    assert any("--launch-args" in c.argv for c in plan)  # 05 launches its servers
    proc = subprocess.run([vllm_python, "-c", VLLM_PARSE], capture_output=True, text=True,
                          input=json.dumps([vllm_server_args(c) for c in VLLM]), timeout=600,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith(("n", '"'))]
    assert len(errors) == len(VLLM), proc.stdout[-2000:]
    bad = {str(c): e for c, e in zip(VLLM, errors) if e}
    assert not bad, bad
