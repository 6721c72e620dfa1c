"""Tests of eagle3/extract/patching.py on the real model files of several SGLang releases: the
hook in `deepseek_v2.py` (DeepseekV2ForCausalLM), `qwen2.py` (Qwen2ForCausalLM) and `llama.py`
(LlamaForCausalLM), applied, checked and reverted together.

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
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from eagle3.extract import patching, sglang_dump
from eagle3.extract.patching import UnsupportedSglangError

ROOT = Path(__file__).resolve().parents[2]
# 0.5.10: first supported; 0.5.13: deepseek_v2.py's capture-id convention changed; 0.5.17:
# deepseek_v2.py packs its aux states (qwen2.py and llama.py keep a list); 0.5.23: newest release
# when this was written.
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


MODELS = {model.path.name: model for model in patching.load_hook_spec().model_files}


def test_hook_spec_names_the_three_model_files_and_their_classes():
    assert {name: model.class_name for name, model in MODELS.items()} == {
        "deepseek_v2.py": "DeepseekV2ForCausalLM", "qwen2.py": "Qwen2ForCausalLM",
        "llama.py": "LlamaForCausalLM"}


def model_file(release: Path, name: str) -> Path:
    return release / "sglang" / MODELS[name].path


def file_bytes(release: Path) -> dict[str, bytes]:
    return {name: model_file(release, name).read_bytes() for name in MODELS}


@pytest.fixture(params=SUPPORTED)
def release(request, tmp_path):
    return release_copy(request.param, tmp_path)


def test_apply_patch_compiles_and_reapplies_as_noop_when_release_is_supported(release):
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    status = patching.check_patch(package)
    assert status.state == "unpatched" and {f.state for f in status.files} == {"unpatched"}
    status = patching.apply_patch(package)
    assert status.state == "patched" and [f.model_file.name for f in status.files] == list(MODELS)
    patched = file_bytes(release)
    for name in MODELS:
        assert patched[name] != original[name], name
        py_compile.compile(str(model_file(release, name)), doraise=True)
    assert patching.apply_patch(package).state == "patched"
    assert file_bytes(release) == patched
    for name in MODELS:
        assert patching.backup_path(model_file(release, name)).read_bytes() == original[name]


def test_revert_patch_restores_original_bytes_when_patched(release):
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    patching.apply_patch(package)
    reverted = patching.revert_patch(package)
    assert sorted(path.name for path in reverted) == sorted(MODELS)
    assert file_bytes(release) == original
    assert patching.check_patch(package).state == "unpatched"
    assert patching.revert_patch(package) == []
    assert not any(patching.backup_path(model_file(release, name)).exists() for name in MODELS)


def _method(tree: ast.Module, class_name: str, name: str) -> ast.FunctionDef:
    cls = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == class_name)
    return next(node for node in cls.body if isinstance(node, ast.FunctionDef)
                and node.name == name)


def _is_hook(stmt: ast.stmt, call: str) -> bool:
    return isinstance(stmt, ast.If) and f"_eagle3_dump.{call}(" in ast.unparse(stmt)


@pytest.mark.parametrize("name", list(MODELS))
def test_hook_sits_between_model_output_and_logits_processor_when_applied(release, name):
    patching.apply_patch(patching.find_sglang_package(release))
    tree = ast.parse(model_file(release, name).read_text())
    class_name = MODELS[name].class_name
    body = _method(tree, class_name, "forward").body
    at = next(i for i, stmt in enumerate(body) if _is_hook(stmt, "maybe_dump"))
    before, after = ast.unparse(body[at - 1]), ast.unparse(body[at + 1])
    assert before.startswith("if self.capture_aux_hidden_states:")
    assert "hidden_states, aux_hidden_states = hidden_states" in before
    assert "self.logits_processor(" in after  # the states the logits processor sees
    assert "forward_batch" in ast.unparse(_method(tree, class_name, "forward").args)
    init = _method(tree, class_name, "__init__").body
    at = next(i for i, stmt in enumerate(init) if _is_hook(stmt, "enable_capture"))
    built = "\n".join(ast.unparse(stmt) for stmt in init[:at])
    assert "self.model = " in built and "self.pp_group = " in built and "self.config = " in built
    assert ast.unparse(init[at - 1]) == "self.capture_aux_hidden_states = False"
    loader = next(i for i, node in enumerate(tree.body) if "_eagle3_dump = None" in
                  ast.unparse(node))
    assert isinstance(tree.body[loader + 2], ast.ClassDef)  # the `if EAGLE3_DUMP_DIR:` between
    assert tree.body[loader + 2].name == class_name


def _real_set_capture(release: Path, name: str):
    """The hooked class's `set_eagle3_layers_to_capture` of a release, as a plain function."""
    method = _method(ast.parse(model_file(release, name).read_text()), MODELS[name].class_name,
                     "set_eagle3_layers_to_capture")
    namespace = {"Optional": Optional, "List": list}
    exec(compile(ast.Module([method], []), "set_eagle3_layers_to_capture", "exec"), namespace)
    return namespace["set_eagle3_layers_to_capture"]


# 61: Kimi-K2.5; 28: Qwen2.5-Coder-1.5B; 30: SmolLM2-135M; 8: the tiny targets.
@pytest.mark.parametrize("name", list(MODELS))
def test_enable_capture_captures_sglang_default_layers_when_real_sglang_code_runs(
        release, name, monkeypatch, tmp_path):
    monkeypatch.setattr(sglang_dump, "server_config",
                        lambda: sglang_dump.DumpConfig(tmp_path, tp_rank=1))
    set_capture = _real_set_capture(release, name)
    for num_layers in (61, 28, 30, 8):
        model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=num_layers),
                                pp_group=SimpleNamespace(is_last_rank=True),
                                model=SimpleNamespace(layers_to_capture=[]),
                                capture_aux_hidden_states=False)
        model.set_eagle3_layers_to_capture = lambda ids, model=model: set_capture(model, ids)
        want = [2, num_layers // 2, num_layers - 3]
        assert sglang_dump.enable_capture(model) == want, (name, num_layers)
        assert model.model.layers_to_capture == want and model.capture_aux_hidden_states
        set_capture(model, None)  # SGLang's own default: the same layers
        assert model.model.layers_to_capture == want


def _loader(release: Path, name: str) -> str:
    source = model_file(release, name).read_text()
    begin = source.index("# >>> eagle3 dump hook: loader")
    return source[begin:source.index("# <<< eagle3 dump hook: loader")]


def test_loader_hunk_loads_dump_module_once_only_when_env_var_is_set(release, monkeypatch,
                                                                     tmp_path):
    patching.apply_patch(patching.find_sglang_package(release))
    monkeypatch.setitem(sys.modules, "eagle3_sglang_dump", None)  # removed again at teardown
    monkeypatch.delenv(sglang_dump.ENV_DUMP_DIR, raising=False)
    namespace = {}
    exec(_loader(release, "deepseek_v2.py"), namespace)
    assert namespace["_eagle3_dump"] is None
    monkeypatch.setenv(sglang_dump.ENV_DUMP_DIR, str(tmp_path))
    loaded = []
    for name in MODELS:  # as SGLang imports the three files: one copy of the module
        namespace = {}
        exec(_loader(release, name), namespace)
        loaded.append(namespace["_eagle3_dump"])
    assert Path(loaded[0].__file__) == patching.DUMP_MODULE_PATH
    assert callable(loaded[0].maybe_dump) and all(module is loaded[0] for module in loaded)


def test_apply_patch_refuses_when_release_is_older_than_0_5_10(tmp_path):
    release = release_copy(TOO_OLD, tmp_path)
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    status = patching.check_patch(package)
    assert status.state == "unsupported" and status.version == TOO_OLD
    assert any("rids" in reason for reason in status.release_reasons)
    with pytest.raises(UnsupportedSglangError, match="older than 0.5.10"):
        patching.apply_patch(package)
    assert file_bytes(release) == original
    assert patching.main(["--sglang-dir", str(release)]) == 2
    assert file_bytes(release) == original


def test_apply_patch_refuses_naming_file_and_anchor_when_one_file_lacks_an_anchor(tmp_path):
    release = release_copy(SUPPORTED[0], tmp_path)
    path = model_file(release, "qwen2.py")
    path.write_text(path.read_text().replace("            hidden_states, aux_hidden_states = "
                                             "hidden_states\n", "            pass\n"))
    (release / "sglang" / "_version.py").unlink()  # a checkout: features and anchors decide
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    status = patching.check_patch(package)
    states = {found.model_file.name: found.state for found in status.files}
    assert status.state == "unsupported" and status.release_reasons == ()
    assert states == {"deepseek_v2.py": "unpatched", "qwen2.py": "unsupported",
                      "llama.py": "unpatched"}
    with pytest.raises(UnsupportedSglangError,
                       match="qwen2.py: hunk 'dump'.*aux_hidden_states = None.*Qwen2ForCausalLM"):
        patching.apply_patch(package)
    assert file_bytes(release) == original  # all or nothing
    assert patching.main(["--sglang-dir", str(release), "--check"]) == 2


def test_apply_patch_replaces_hook_when_dump_module_moved(tmp_path):
    release = release_copy(SUPPORTED[-1], tmp_path)
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    old_spec = patching.load_hook_spec(dump_module=Path("/old/checkout/eagle3/extract/sglang_dump.py"))
    patching.apply_patch(package, old_spec)
    assert patching.check_patch(package).state == "outdated"
    assert patching.apply_patch(package).state == "patched"
    assert not any("/old/checkout" in model_file(release, name).read_text() for name in MODELS)
    patching.revert_patch(package)
    assert file_bytes(release) == original


def test_apply_patch_completes_a_release_where_only_deepseek_v2_is_patched(tmp_path):
    """A GPU machine patched by the deepseek_v2.py-only hook: --check says so, applying adds the
    other files (and refreshes that one)."""
    release = release_copy("0.5.17", tmp_path)
    original = file_bytes(release)
    package = patching.find_sglang_package(release)
    deepseek_only = dataclasses.replace(patching.load_hook_spec(),
                                        model_files=(MODELS["deepseek_v2.py"],))
    patching.apply_patch(package, deepseek_only)
    status = patching.check_patch(package)
    assert [found.state for found in status.files] == ["patched", "unpatched", "unpatched"]
    assert status.state == "unpatched"
    assert patching.main(["--sglang-dir", str(release), "--check"]) == 1
    assert patching.main(["--sglang-dir", str(release)]) == 0
    assert patching.check_patch(package).state == "patched"
    assert patching.main(["--sglang-dir", str(release), "--revert"]) == 0
    assert file_bytes(release) == original


def test_strip_hook_raises_when_a_block_is_never_closed():
    spec = patching.load_hook_spec()
    source = ("class DeepseekV2ForCausalLM(Base):\n"
              "    def set_eagle3_layers_to_capture(self, layer_ids=None):\n        pass\n")
    patched = patching.render_patched(source, dataclasses.replace(spec, hunks=spec.hunks[:1]),
                                      "DeepseekV2ForCausalLM")
    broken = patched.replace("# <<< eagle3 dump hook: loader <<<\n", "")
    with pytest.raises(patching.CorruptPatchError, match="never closed"):
        patching.strip_hook(broken)
    assert patching.strip_hook(patched) == source


def test_render_patched_refuses_when_class_cannot_capture_aux_states():
    spec = patching.load_hook_spec()
    with pytest.raises(UnsupportedSglangError, match="set_eagle3_layers_to_capture"):
        patching.render_patched("class Qwen2ForCausalLM(Base):\n    x = 1\n", spec,
                                "Qwen2ForCausalLM")


def test_find_sglang_package_accepts_package_site_packages_and_checkout(tmp_path):
    for layout in ("site/sglang", "checkout/python/sglang"):
        (tmp_path / layout / patching.MODELS_DIR).mkdir(parents=True)
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


def test_fetch_tool_refetches_a_cache_without_qwen2_and_llama(tmp_path, monkeypatch):
    """A cache written when only deepseek_v2.py was hooked is fetched again and replaced."""
    cached = release_copy(SUPPORTED[0], tmp_path / "real")

    def fake_download(version, into, timeout_s):  # the wheel, rebuilt from the real files
        into.mkdir(parents=True)
        wheel = into / f"sglang-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for path in sorted((cached / "sglang").rglob("*.py")):
                archive.write(path, str(path.relative_to(cached)))
        return wheel

    monkeypatch.setattr(fetch_tool, "_download_wheel", fake_download)
    old = tmp_path / "cache" / "sglang" / SUPPORTED[0]
    shutil.copytree(cached, old)
    for name in ("qwen2.py", "llama.py"):
        model_file(old, name).unlink()
    assert fetch_tool.cached_sources(SUPPORTED[0], tmp_path / "cache") is None
    fetched = fetch_tool.fetch_sglang_sources(SUPPORTED[0], tmp_path / "cache")
    assert fetched == old and file_bytes(fetched) == file_bytes(cached)
    assert [p.name for p in (tmp_path / "cache" / "sglang").iterdir()] == [SUPPORTED[0]]
