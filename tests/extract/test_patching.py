"""Tests of eagle3/extract/patching.py on the real deepseek_v2.py of several SGLang releases.

The sources come from `tools/fetch_sglang_sources.py` (`pip download --no-deps`, cached under
`$EAGLE3_CACHE_DIR` or `~/.cache/eagle3`); a release that is neither cached nor downloadable
skips its tests with the reason. Each test works on a copy in tmp_path.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import py_compile
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from eagle3.extract import patching, sglang_dump
from eagle3.extract.patching import UnsupportedSglangError

ROOT = Path(__file__).resolve().parents[2]
# 0.5.10: first supported; 0.5.13: capture-id convention changed; 0.5.17: aux states packed;
# 0.5.23: newest release when this was written.
SUPPORTED = ["0.5.10", "0.5.13", "0.5.17", "0.5.23"]
TOO_OLD = "0.5.9"


def _load_fetch_tool():
    spec = importlib.util.spec_from_file_location(
        "fetch_sglang_sources", ROOT / "tools" / "fetch_sglang_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_tool = _load_fetch_tool()


@functools.cache
def _fetch(version: str) -> Path | str:
    """The cached sources of a release, or why they cannot be had (asked once per session)."""
    try:
        return fetch_tool.fetch_sglang_sources(version)
    except fetch_tool.FetchError as exc:
        return (f"SGLang {version} sources neither cached in {fetch_tool.default_cache_root()} "
                f"nor downloadable: {exc}")


def release_copy(version: str, tmp_path: Path) -> Path:
    """A writable copy of a release's sources (the folder holding `sglang/`), or skip."""
    cached = _fetch(version)
    if isinstance(cached, str):
        pytest.skip(cached)
    return Path(shutil.copytree(cached, tmp_path / version))


def model_file(release: Path) -> Path:
    return release / "sglang" / patching.MODEL_FILE


@pytest.fixture(params=SUPPORTED)
def release(request, tmp_path):
    return release_copy(request.param, tmp_path)


def test_apply_patch_compiles_and_reapplies_as_noop_when_release_is_supported(release):
    original = model_file(release).read_bytes()
    package = patching.find_sglang_package(release)
    assert patching.check_patch(package).state == "unpatched"
    assert patching.apply_patch(package).state == "patched"
    patched = model_file(release).read_bytes()
    assert patched != original
    py_compile.compile(str(model_file(release)), doraise=True)
    assert patching.apply_patch(package).state == "patched"
    assert model_file(release).read_bytes() == patched
    backup = model_file(release).with_name("deepseek_v2.py" + patching.BACKUP_SUFFIX)
    assert backup.read_bytes() == original


def test_revert_patch_restores_original_bytes_when_patched(release):
    original = model_file(release).read_bytes()
    package = patching.find_sglang_package(release)
    patching.apply_patch(package)
    assert patching.revert_patch(package) is True
    assert model_file(release).read_bytes() == original
    assert patching.check_patch(package).state == "unpatched"
    assert patching.revert_patch(package) is False
    assert not model_file(release).with_name("deepseek_v2.py" + patching.BACKUP_SUFFIX).exists()


def _method(tree: ast.Module, name: str) -> ast.FunctionDef:
    cls = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "DeepseekV2ForCausalLM")
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef)
                and node.name == name)


def _is_hook(stmt: ast.stmt, call: str) -> bool:
    return isinstance(stmt, ast.If) and f"_eagle3_dump.{call}(" in ast.unparse(stmt)


def test_hook_sits_between_model_output_and_logits_processor_when_applied(release):
    package = patching.find_sglang_package(release)
    patching.apply_patch(package)
    tree = ast.parse(model_file(release).read_text())
    forward = [ast.unparse(stmt) for stmt in _method(tree, "forward").body]
    at = next(i for i, stmt in enumerate(_method(tree, "forward").body)
              if _is_hook(stmt, "maybe_dump"))
    assert forward[at - 1].startswith("if self.capture_aux_hidden_states:")
    assert "hidden_states, aux_hidden_states = hidden_states" in forward[at - 1]
    assert "self.logits_processor(" in forward[at + 1]
    init = _method(tree, "__init__").body
    at = next(i for i, stmt in enumerate(init) if _is_hook(stmt, "enable_capture"))
    before = "\n".join(ast.unparse(stmt) for stmt in init[:at])
    assert "self.model = DeepseekV2Model(" in before and "self.pp_group = " in before
    assert ast.unparse(init[at - 1]) == "self.capture_aux_hidden_states = False"
    loader = next(i for i, node in enumerate(tree.body) if "_eagle3_dump = None" in
                  ast.unparse(node))
    assert isinstance(tree.body[loader + 2], ast.ClassDef)  # the `if EAGLE3_DUMP_DIR:` between


def _real_set_capture(release: Path):
    """`DeepseekV2ForCausalLM.set_eagle3_layers_to_capture` of a release, as a plain function."""
    method = _method(ast.parse(model_file(release).read_text()), "set_eagle3_layers_to_capture")
    namespace = {"Optional": Optional, "List": list}
    exec(compile(ast.Module([method], []), "set_eagle3_layers_to_capture", "exec"), namespace)
    return namespace["set_eagle3_layers_to_capture"]


def test_enable_capture_captures_2_30_58_when_real_sglang_code_has_61_layers(release, monkeypatch,
                                                                               tmp_path):
    monkeypatch.setattr(sglang_dump, "server_config",
                        lambda: sglang_dump.DumpConfig(tmp_path, tp_rank=1))
    set_capture = _real_set_capture(release)
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=61),
                            pp_group=SimpleNamespace(is_last_rank=True),
                            model=SimpleNamespace(layers_to_capture=[]),
                            capture_aux_hidden_states=False)
    model.set_eagle3_layers_to_capture = lambda ids: set_capture(model, ids)
    assert sglang_dump.enable_capture(model) == [2, 30, 58]
    assert model.model.layers_to_capture == [2, 30, 58] and model.capture_aux_hidden_states


def test_loader_hunk_loads_dump_module_only_when_env_var_is_set(release, monkeypatch, tmp_path):
    package = patching.find_sglang_package(release)
    patching.apply_patch(package)
    source = model_file(release).read_text()
    begin = source.index("# >>> eagle3 dump hook: loader")
    loader = source[begin:source.index("# <<< eagle3 dump hook: loader")]
    monkeypatch.setitem(sys.modules, "eagle3_sglang_dump", None)  # removed again at teardown
    monkeypatch.delenv(sglang_dump.ENV_DUMP_DIR, raising=False)
    namespace = {}
    exec(loader, namespace)
    assert namespace["_eagle3_dump"] is None
    monkeypatch.setenv(sglang_dump.ENV_DUMP_DIR, str(tmp_path))
    exec(loader, namespace)
    assert Path(namespace["_eagle3_dump"].__file__) == patching.DUMP_MODULE_PATH
    assert callable(namespace["_eagle3_dump"].maybe_dump)


def test_apply_patch_refuses_when_release_is_older_than_0_5_10(tmp_path):
    release = release_copy(TOO_OLD, tmp_path)
    original = model_file(release).read_bytes()
    package = patching.find_sglang_package(release)
    status = patching.check_patch(package)
    assert status.state == "unsupported" and status.version == TOO_OLD
    assert any("rids" in reason for reason in status.reasons)
    with pytest.raises(UnsupportedSglangError, match="older than 0.5.10"):
        patching.apply_patch(package)
    assert model_file(release).read_bytes() == original


def test_apply_patch_refuses_naming_anchor_when_anchor_is_missing(tmp_path):
    release = release_copy(SUPPORTED[0], tmp_path)
    path = model_file(release)
    path.write_text(path.read_text().replace("            hidden_states, aux_hidden_states = "
                                             "hidden_states\n", "            pass\n"))
    (release / "sglang" / "_version.py").unlink()  # a checkout: features and anchors decide
    original = path.read_bytes()
    with pytest.raises(UnsupportedSglangError, match="hunk 'dump'.*aux_hidden_states = None"):
        patching.apply_patch(patching.find_sglang_package(release))
    assert path.read_bytes() == original


def test_apply_patch_replaces_hook_when_dump_module_moved(tmp_path):
    release = release_copy(SUPPORTED[-1], tmp_path)
    original = model_file(release).read_bytes()
    package = patching.find_sglang_package(release)
    old_spec = patching.load_hook_spec(dump_module=Path("/old/checkout/eagle3/extract/sglang_dump.py"))
    patching.apply_patch(package, old_spec)
    assert patching.check_patch(package).state == "outdated"
    assert patching.apply_patch(package).state == "patched"
    assert "/old/checkout" not in model_file(release).read_text()
    patching.revert_patch(package)
    assert model_file(release).read_bytes() == original


def test_strip_hook_raises_when_a_block_is_never_closed():
    spec = patching.load_hook_spec()
    source = "class DeepseekV2ForCausalLM(Base):\n    x = 1\n"
    patched = patching.render_patched(source, dataclasses.replace(spec, hunks=spec.hunks[:1]))
    broken = patched.replace("# <<< eagle3 dump hook: loader <<<\n", "")
    with pytest.raises(patching.CorruptPatchError, match="never closed"):
        patching.strip_hook(broken)
    assert patching.strip_hook(patched) == source


def test_find_sglang_package_accepts_package_site_packages_and_checkout(tmp_path):
    for layout in ("site/sglang", "checkout/python/sglang"):
        (tmp_path / layout / "srt" / "models").mkdir(parents=True)
        (tmp_path / layout / patching.MODEL_FILE).write_text("")
    package = (tmp_path / "site" / "sglang").resolve()
    assert patching.find_sglang_package(tmp_path / "site") == package
    assert patching.find_sglang_package(package) == package
    assert patching.find_sglang_package(tmp_path / "checkout") == \
        (tmp_path / "checkout" / "python" / "sglang").resolve()
    with pytest.raises(patching.SglangNotFoundError, match="--sglang-dir|pass the sglang"):
        patching.find_sglang_package(tmp_path)


def test_read_sglang_version_uses_dist_info_when_version_file_is_missing(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang-0.5.21.dist-info").mkdir()
    (tmp_path / "sglang-0.5.21.dist-info" / "METADATA").write_text("Name: sglang\nVersion: "
                                                                    "0.5.21\n")
    assert patching.read_sglang_version(tmp_path / "sglang") == "0.5.21"
    (tmp_path / "sglang" / "_version.py").write_text("__version__ = version = '0.5.22'\n")
    assert patching.read_sglang_version(tmp_path / "sglang") == "0.5.22"


def test_main_exit_code_tells_state_when_checking(tmp_path):
    release = release_copy(SUPPORTED[0], tmp_path)
    assert patching.main(["--sglang-dir", str(release), "--check"]) == 1
    assert patching.main(["--sglang-dir", str(release)]) == 0
    assert patching.main(["--sglang-dir", str(release), "--check"]) == 0
    assert patching.main(["--sglang-dir", str(release), "--revert"]) == 0
    assert patching.main(["--sglang-dir", str(release), "--check"]) == 1
    assert patching.main(["--sglang-dir", str(tmp_path / "nowhere"), "--check"]) == 2
