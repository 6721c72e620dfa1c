"""Stream mode: 02b --stream and 04 --stream at the same time through a bounded spool.

The draft equals the offline 02b-then-04 draft to the byte (same records, order and seed; hf
batch size 1 on both sides) when the spool holds only the working window (every epoch extracted
again, 02b waiting for 04) and first 02b, then 04 are SIGKILLed mid-run and started again beside
the other. The spool keeping every record, and the sglang client, are
tests/extract/test_extract_stream_sglang.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import small_disk
from stream_helpers import stream_workdir

from eagle3.core.spool import Spool, SpoolError, SpoolPlan
from eagle3.core.stage import StageError
from eagle3.extract.stream import Chunk, make_chunks, window_bytes

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--epochs", "2", "--lr", "1e-3", "--max-seq-len", "512", "--num-workers", "1",
         "--eval-every", "100", "--log-every", "50", "--save-every", "20"]
EXTRACT = ["--backend", "hf", "--max-batch-size", "1"]
TOPK = ["--dtype", "fp8-topk", "--teacher-topk", "8"]  # the compact layout: 04 gets K from 02b


def _cmd(script: str, w: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / script), "--workdir", str(w), "--target",
            str(w / "target"), *extra]


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(procs: dict[str, subprocess.Popen], w: Path, timeout: float = 600) -> None:
    for name, proc in procs.items():
        rc = proc.wait(timeout=timeout)
        assert rc == 0, f"{name} exited {rc}:\n" + (w / f"{name}.log").read_text()[-4000:]


def _stream(w: Path, spool_gb: str, extract=(), spool=(), kills=()) -> None:
    """02b --stream and 04 --stream to the end; each of `kills` (side, when) SIGKILLs that side
    once `when()` holds, then starts it again beside the other, still running."""
    procs = {"02b": _spawn(_cmd("02b_extract_hidden_states_sglang.py", w, *EXTRACT, *extract,
                                "--stream", "--spool-gb", spool_gb, *spool), w / "02b.log"),
             "04": _spawn(_cmd("04_train.py", w, *TRAIN, "--stream", *spool), w / "04.log")}
    for side, when in kills:
        deadline = time.monotonic() + 300
        while not when():
            assert procs[side].poll() is None, f"{side} ended before the kill"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.killpg(procs[side].pid, signal.SIGKILL)
        procs[side].wait()
        procs[side] = _spawn(procs[side].args, w / f"{side}.log")
    _finish(procs, w)


def _offline(demo_run: Path, w: Path, *extract: str) -> Path:
    w = stream_workdir(demo_run, w)
    for cmd in (_cmd("02b_extract_hidden_states_sglang.py", w, *EXTRACT, *extract),
                _cmd("04_train.py", w, *TRAIN)):
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return w


@pytest.fixture(scope="module")
def offline_topk(demo_run, tmp_path_factory) -> Path:
    return _offline(demo_run, tmp_path_factory.mktemp("offline_topk") / "w", *TOPK)


def _draft_bytes(w: Path) -> bytes:
    return (w / "04_train/final/model.safetensors").read_bytes()


def _manifest(w: Path, stage: str) -> dict:
    return json.loads((w / stage / "manifest.json").read_text())


def test_stream_draft_equals_offline_draft_when_each_side_is_killed_and_rerun(
        demo_run, offline_topk, tmp_path):
    w = stream_workdir(demo_run, tmp_path / "w")
    budget = _window_gb(w)
    spool_files = lambda: list(spool.glob("train/e000/shard_*/data_*.pt"))  # noqa: E731
    checkpoint = w / "04_train/checkpoints/step_000020/COMPLETE"
    # fp8-topk files (04 takes K from 02b); the spool on a disk of its own, as small as the
    # budget allows (another mount, as a shared filesystem between two nodes would be), holding
    # just the working window: nothing is kept, every epoch is extracted again, 02b waits for
    # 04. 02b is killed mid-epoch; then 04 after its first checkpoint: the resumed 04 reads
    # again what it read since, which 02b extracts again.
    with small_disk(tmp_path / "spool", kib=int(budget * 1e9 / 1024) + 256) as disk:
        spool = disk or tmp_path / "spool"
        _stream(w, f"{budget:.9f}", TOPK, spool=("--spool", str(spool)),
                kills=[("02b", lambda: len(spool_files()) >= 8),
                       ("04", checkpoint.exists)])
        assert not list(spool.iterdir())  # 02b emptied it at the end
    assert _draft_bytes(w) == _draft_bytes(offline_topk)
    m = _manifest(w, "02b_hidden_states")["stream"]
    assert m["kept_records"] == 0 and m["prefill_passes"] == 2.0
    assert 0 < m["peak_bytes"] <= m["budget_bytes"]
    assert m["backpressure_s"] > 0  # 02b waited for 04 to read
    assert m["rewinds"] >= 1
    assert "spool peak" in (w / "02b.log").read_text()


def _window_gb(w: Path) -> float:
    """A budget just above the working window 02b computes for this plan (the rows 04 may hold
    ahead plus one chunk): no record fits beside it, so every epoch is extracted again."""
    from eagle3.core.cli import parse_config
    from eagle3.extract.stream import record_bytes
    from eagle3.train.config import TrainConfig
    from eagle3.train.stream import merged_train, stream_plan

    cfg = parse_config(TrainConfig, ["--workdir", str(w), "--target", str(w / "target"), *TRAIN])
    good, _, lengths = merged_train(w, vocab_size=1 << 30)
    evals = [len(json.loads(x)["input_ids"])
             for x in (w / "01c_merged/eval.jsonl").read_text().splitlines() if x.strip()]
    _, plan = stream_plan(cfg, lengths, evals, good, world=1)
    nbytes = {i: record_bytes(n, 64, "fp8-topk", 8) for i, n in zip(good, lengths)}
    reserve = window_bytes(plan, nbytes) + max(nbytes.values())
    return (reserve + min(nbytes.values()) - 1) / 1e9


def test_offline_04_refuses_a_streamed_02b_folder(demo_run, tmp_path):
    from importlib import import_module

    w = stream_workdir(demo_run, tmp_path / "w")
    (w / "02b_hidden_states").mkdir()
    (w / "02b_hidden_states/manifest.json").write_text(json.dumps(
        {"complete": True, "stream": {"peak_bytes": 1}, "capture_layers": [2, 3, 4]}))
    with pytest.raises(StageError, match="ran with --stream"):
        import_module("04_train").main(["--workdir", str(w), "--target", str(w / "target")])


def test_chunks_stay_in_one_epoch_and_link_kept_records_after_their_first_file():
    plan = SpoolPlan([[[0, 1], [2]], [[2, 0], [1]]], world=1, lookahead_rows=1)
    lengths = {0: 10, 1: 10, 2: 30}
    chunks = make_chunks(plan, lengths, kept={0}, max_tokens=40, max_batch=8)
    assert [c.epoch for c in chunks] == [0, 0, 1, 1]
    assert chunks[0].extract == [(0, 0), (1, 1)]  # 3 x 30 > 40: record 2 starts a new chunk
    assert chunks[1].extract == [(2, 2)]
    assert chunks[2] == Chunk(1, extract=[(3, 2)], link=[(4, 0)])  # a link takes no room
    assert chunks[3] == Chunk(1, extract=[(5, 1)])
    assert plan.row_starts() == [[0, 2], [3, 5]]
    # rows of 3, 4, 5 and 2 bytes; two consecutive rows at most (1 ahead + the one in use),
    # across the epoch boundary too: [2] then [2, 0]
    assert window_bytes(plan, {0: 1, 1: 2, 2: 4}) == 9


def test_producer_refuses_a_budget_below_the_working_window(tmp_path):
    from eagle3.core.faults import BadRecords
    from eagle3.extract.stream import Producer

    records = [{"id": f"r{i}", "input_ids": [1] * 100} for i in range(4)]
    plan = SpoolPlan([[[0, 1], [2, 3]]], world=1, lookahead_rows=1)
    p = Producer(Spool(tmp_path / "spool"), tmp_path, records,
                 {"hidden_size": 64, "dtype": "bf16", "topk": 0}, 10_000,
                 BadRecords(tmp_path, -1), None, backend=None, max_failures=-1)
    with pytest.raises(SpoolError, match="--spool-gb"):
        p.setup(plan, (1 << 20, 8))


def test_plan_json_is_refused_when_its_rows_were_edited(tmp_path):
    spool = Spool(tmp_path)
    spool.write_plan(SpoolPlan([[[0, 1]]], 1, 2))
    obj = json.loads((tmp_path / "plan.json").read_text())
    obj["epochs"][0][0] = [1, 0]
    (tmp_path / "plan.json").write_text(json.dumps(obj))
    with pytest.raises(SpoolError, match="edited"):
        spool.read_plan()
