"""Stage-05 test helpers: an untrained draft for the tiny target, a free port, and the fake
SGLang server as `python -m sglang.launch_server` (a shim package on PYTHONPATH)."""

from __future__ import annotations

import socket
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def make_tiny_draft(target_dir: Path, out_dir: Path) -> Path:
    """An untrained draft for the tiny target, exported as SGLang loads it (04's final/)."""
    from eagle3.core.target import default_capture_layers, read_target_info
    from eagle3.draft.export import export_sglang
    from eagle3.draft.model import DraftConfig, Eagle3Draft

    info = read_target_info(target_dir)
    cfg = DraftConfig(hidden_size=info.hidden_size, num_attention_heads=4, num_key_value_heads=4,
                      head_dim=16, intermediate_size=128, vocab_size=info.vocab_size,
                      draft_vocab_size=info.vocab_size, target_hidden_size=info.hidden_size,
                      capture_layers=default_capture_layers(info.num_hidden_layers))
    draft = Eagle3Draft(cfg)
    draft.t2d.fill_(True)
    return export_sglang(draft, out_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def fake_sglang_shim(root: Path) -> str:
    """A `sglang.launch_server` that runs tests/bench_fake_server.py; the PYTHONPATH to use."""
    pkg = root / "shim" / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import sys\nfrom bench_fake_server import main\nmain(sys.argv[1:])\n")
    return f"{pkg.parent}:{TESTS}"
