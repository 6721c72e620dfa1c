"""Import-only stand-in packages: every name and submodule imports, nothing can be used.

A stand-in module answers any attribute with an `Unavailable` placeholder and any submodule
import with another stand-in module, so `from pkg.sub import name` at SGLang's import time
succeeds, and so does reading attributes of a placeholder (another placeholder: transformers
builds a table keyed by `torchvision.transforms.InterpolationMode` members at import). Calling a
placeholder writes `STANDIN_USED_MARK` and the name to stderr, which the server log keeps, then
raises `StandInUsedError`: a call is seen even where the caller catches the error. The tests
assert that a server's log holds no such line.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STANDIN_USED_MARK = "IMPORT-ONLY STAND-IN USED:"


class StandInUsedError(RuntimeError):
    """Something called into a package that only a stand-in provides."""


def _used(name: str) -> StandInUsedError:
    print(f"{STANDIN_USED_MARK} {name}", file=sys.stderr, flush=True)
    return StandInUsedError(f"{name} belongs to an import-only stand-in (tests/sglang_support): "
                            "this code path needs the real package")


class Unavailable:
    """A name imported from a stand-in package: raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise _used(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<import-only stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # importlib, pickle and inspect probe dunders: not a use
            raise AttributeError(attr)
        return Unavailable(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every submodule of the stand-in packages, as a stand-in module."""

    def __init__(self):
        self.packages: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.packages or "." not in fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_FINDER = _StandInFinder()


# transformers parses a torchvision it finds by `__version__` ("N/A" fails to parse); a version
# below every release keeps its version-gated torchvision paths off.
STANDIN_VERSION = "0.0.0+import.only.stand.in"


def make_stand_in(module: types.ModuleType) -> None:
    """Turn the package `module` (called from its `__init__`) into an import-only stand-in."""
    module.__version__ = STANDIN_VERSION
    module.__class__ = _StandInModule
    _FINDER.packages.add(module.__name__)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
