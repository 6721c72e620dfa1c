"""Config dataclasses <-> command lines, shared by every numbered script.

Defaults live only in the dataclass; each field becomes one kebab-case flag whose help is the
field's `help` metadata plus its default. Validation belongs in the dataclass's `__post_init__`.

    @dataclass
    class TrainConfig:
        lr: float = arg(3e-4, "peak learning rate")

    cfg = parse_config(TrainConfig, argv, description=__doc__)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


def arg(default: Any = dataclasses.MISSING, help: str = "", **kw) -> Any:
    """A dataclass field with its command-line help; lists get a default factory."""
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value),
                                 metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


@dataclasses.dataclass(kw_only=True)
class StageFlags:
    """The flags every numbered stage has; each stage config inherits them (after its own)."""

    workdir: Path = arg(Path("runs/default"), "work directory shared by all stages")
    force: bool = arg(False, "redo the stage even if it is complete (04: restart training from "
                             "scratch)")
    log_level: str = arg("INFO", "logging level")


@dataclasses.dataclass(kw_only=True)
class UpstreamStageFlags(StageFlags):
    """`StageFlags` of a stage that reads another stage's folder."""

    allow_partial: bool = arg(False, "accept incomplete upstream stage folders (manifest missing "
                                     "or not complete)")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _none_or(conv):
    return lambda s: None if s.lower() in ("none", "null", "") else conv(s)


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp, optional = _unwrap_optional(hints[f.name])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory()
        )
        help_text = f.metadata.get("help", "")
        if not required:
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"help": help_text, "dest": f.name}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is list:
            (inner,) = typing.get_args(tp)
            kwargs.update(nargs="+", type=inner)
        else:
            conv = Path if tp is Path else tp
            kwargs["type"] = _none_or(conv) if optional else conv
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument(flag, **kwargs)
    return parser


def parse_config(cls: type[C], argv: list[str] | None, description: str | None = None) -> C:
    """Parse `argv` into `cls`; a ValueError from `__post_init__` becomes a usage error."""
    parser = build_parser(cls, description)
    ns = parser.parse_args(argv)
    try:
        return cls(**vars(ns))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def config_dict(cfg: Any) -> dict:
    """The resolved config as JSON-ready dict (for manifests and checkpoints)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = str(v) if isinstance(v, Path) else v
    return out


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once, from a script's `main`."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
