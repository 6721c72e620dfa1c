"""Stage 01's self-written datasets on a server (`--gen-backend sglang`): every dataset's rounds in
one event loop over one generator's requests in flight, every batch of a phase sent at once, so
that no batch, round or dataset waits for another's last replies; yet each dataset's rounds,
fingerprint folder and files are the ones the in-process writer makes of the same answers, and a
run killed or stopped by SIGTERM resumes to the files of an uninterrupted one.

The server is the fake SGLang server answering what `ScriptedGenerator` answers in process
(selfwritten_helpers.scripted_server: the call's seed and the row come from the rid), logging
each request's arrival and answer times; `slow_ids` makes one request slow: a tail.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
from pathlib import Path

import pytest
from selfwritten_helpers import ScriptedGenerator, scripted_server

from eagle3.core.chat import ChatRenderer
from eagle3.core.faults import Interrupted
from eagle3.core.target import load_tokenizer
from eagle3.generate.jobs import seed_of
from eagle3.prepare import selfwritten_run
from eagle3.prepare.selfwritten import SelfWriter, SelfWrittenSpec
from eagle3.prepare.server_generator import ServerGenerator
from eagle3.testing.fake_sglang import Faults

PREPARED = "01_prepared"
BATCH = 4  # --gen-batch-size: the batch of the seeds, and the server's requests in flight
DATASETS = {  # name -> (count, seed, heldout, turns)
    "a": (14, 0, 2, [[1, 0.5], [2, 0.3], [3, 0.2]]),
    "b": (9, 1, 1, [[1, 1.0]]),
    "c": (11, 2, 0, [[1, 0.4], [2, 0.6]]),
}


@pytest.fixture(scope="module")
def scripted(tiny_target_dir):
    tok = load_tokenizer(tiny_target_dir)
    return tok, tok.convert_tokens_to_ids("<|im_end|>")


def _recipe(path: Path, datasets: dict = DATASETS) -> Path:
    path.write_text(json.dumps({"name": "t", "datasets": [
        {"name": name, "count": count, "seed": seed, "max_seq_len": 2048,
         "self_written": {"heldout": heldout, "max_user_tokens": 48, "min_user_chars": 4,
                          "reply_max_new_tokens": 64, "turns": turns}}
        for name, (count, seed, heldout, turns) in datasets.items()]}))
    return path


def _run01(workdir: Path, recipe: Path, target: Path, url: str | None = None) -> int:
    """01 with the server generator at `url`, or in process (the generator the test set)."""
    backend = ["--gen-backend", "sglang", "--server-url", url] if url else []
    return importlib.import_module("01_prepare_datasets").main([
        "--recipe", str(recipe), "--target", str(target), "--workdir", str(workdir),
        "--num-workers", "1", "--gen-batch-size", str(BATCH), "--log-level", "WARNING",
        *backend])


def _written(workdir: Path, datasets=DATASETS) -> dict[str, bytes]:
    """What the self-written datasets leave: 01's files, and each round file, stats.json and
    manifest entry without its times (and without the backend and fingerprint, which name the
    generator)."""
    out = {}
    manifest = json.loads((workdir / PREPARED / "manifest.json").read_text())
    for name in datasets:
        for f in ("conversations.jsonl", "heldout.jsonl"):
            out[f"{name}/{f}"] = (workdir / PREPARED / name / f).read_bytes()
        (cache,) = (workdir / PREPARED / ".self_written" / name).iterdir()
        for path in sorted(cache.glob("round_*.json")) + [cache / "stats.json"]:
            data = {k: v for k, v in json.loads(path.read_text()).items()
                    if k not in ("seconds", "backend", "fingerprint")}
            out[f"{name}/{path.name}"] = json.dumps(data, sort_keys=True).encode()
        info = {k: v for k, v in manifest["outputs"]["datasets"][name]["self_written"].items()
                if k not in ("seconds", "backend", "fingerprint")}
        out[f"{name}/manifest"] = json.dumps(info, sort_keys=True).encode()
    return out


def _fingerprints(workdir: Path) -> dict[str, str]:
    return {name: next((workdir / PREPARED / ".self_written" / name).iterdir()).name
            for name in DATASETS}


def _rid(name: str, where: tuple, row: int) -> str:
    """The rid of row `row` of the batch `where` (e.g. ("user", round, offset)) of `name`."""
    return f"sw-{seed_of(DATASETS[name][1], name, *where):x}-{row}"


# ---------------------------------------------------------------- the same files


def test_datasets_written_together_on_a_server_equal_the_in_process_writer_byte_for_byte(
        tmp_path, tiny_target_dir, scripted, monkeypatch):
    """Answers in scrambled order (random latencies), three datasets (multi-turn, held out)
    together on the server, and the in-process writer one batch and one dataset after
    another: the same rounds and files."""
    tok, eot = scripted
    recipe = _recipe(tmp_path / "r.json")
    with scripted_server(tok, eot, Faults(delay_s=(0.0, 0.02), seed=4)) as server:
        assert _run01(tmp_path / "server", recipe, tiny_target_dir, server.url) == 0
    with monkeypatch.context() as m:
        m.setattr(selfwritten_run, "build_generator",
                  lambda cfg, renderer: ScriptedGenerator(tok, eot))
        assert _run01(tmp_path / "in_process", recipe, tiny_target_dir) == 0
    got, want = _written(tmp_path / "server"), _written(tmp_path / "in_process")
    assert sorted(got) == sorted(want)
    assert [n for n in want if got[n] != want[n]] == []
    entry = json.loads(got["a/manifest"])
    assert entry["user_turns"].get("2") and entry["heldout"] == 2  # multi-turn, held out
    assert max(r["inflight_at_start"] for r in server.requests) <= BATCH  # over every dataset


# ---------------------------------------------------------------- no waiting for tails


def test_batches_and_datasets_on_a_server_do_not_wait_for_one_slow_reply(
        tmp_path, tiny_target_dir, scripted):
    """Row 0 of `a`'s first batch takes 3 s: `a`'s other batches of that round, and `b`'s
    requests, are sent and answered meanwhile (one after another, nothing would start before
    it is in)."""
    tok, eot = scripted
    sets = {"a": DATASETS["a"], "b": DATASETS["b"]}
    slow = _rid("a", ("user", 1, 0), 0)
    with scripted_server(tok, eot, Faults(delay_s=(0.005, 0.01), slow_ids=frozenset({slow}),
                                          slow_s=3.0)) as server:
        assert _run01(tmp_path, _recipe(tmp_path / "r.json", sets), tiny_target_dir,
                      server.url) == 0
    by_rid = {r["rid"]: r for r in server.requests if r["path"] == "/generate"}
    assert by_rid[slow]["kind"] == "slow"
    slow_end = by_rid[slow]["end"]
    others = [by_rid[_rid("a", ("user", 1, b), 0)] for b in range(BATCH, 5 * BATCH, BATCH)]
    assert all(r["start"] < slow_end for r in others)  # a's later batches: sent meanwhile
    b_seeds = {f"sw-{seed_of(1, 'b', 'user', r, o):x}" for r in range(1, 6)
               for o in range(0, 16 * BATCH, BATCH)}
    of_b = [r for rid, r in by_rid.items() if rid.rsplit("-", 1)[0] in b_seeds]
    assert len(of_b) >= sets["b"][0] + sets["b"][2]  # every candidate of every round of b
    assert max(r["end"] for r in of_b) < slow_end  # b written whole during a's one slow reply
    assert max(r["inflight_at_start"] for r in by_rid.values()) <= BATCH


def test_writer_run_with_no_loop_sends_a_servers_batches_one_after_another_alike(
        tmp_path, tiny_target_dir, scripted):
    """`SelfWriter.run` (blocking, no event loop) over the server generator: each batch sent
    once the one before is in, as 01 did before, and the conversations of the scripted writer
    in process."""
    tok, eot = scripted
    renderer = ChatRenderer(tok, {"thinking": True})
    spec = SelfWrittenSpec(heldout=1, max_user_tokens=48, min_user_chars=4,
                           reply_max_new_tokens=64, turns=[[1, 0.5], [2, 0.5]])
    writers = {}
    with scripted_server(tok, eot, Faults(delay_s=(0.0, 0.01))) as server:
        for way, gen in (("server", ServerGenerator([server.url], [eot], BATCH)),
                         ("in_process", ScriptedGenerator(tok, eot))):
            writers[way] = SelfWriter("a", spec, renderer, tmp_path / way, count=9, seed=0,
                                      max_seq_len=2048, batch_size=BATCH,
                                      load_generator=lambda g=gen: g)
            writers[way].run()
    states = {way: (w.state.conversations, w.state.heldout) for way, w in writers.items()}
    assert states["server"] == states["in_process"] and states["server"][0]
    batches: dict[str, list[dict]] = {}
    for r in server.requests:
        batches.setdefault(r["rid"].rsplit("-", 1)[0], []).append(r)
    spans = sorted((min(r["start"] for r in b), max(r["end"] for r in b))
                   for b in batches.values())
    assert len(spans) > 2 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


# ---------------------------------------------------------------- kills and signals


@pytest.mark.parametrize("when", ["early", "late"])
def test_datasets_written_together_killed_resume_to_the_files_of_an_uninterrupted_run(
        tmp_path, tiny_target_dir, scripted, monkeypatch, when):
    """A call to the server generator dies (a kill: the other datasets' calls in flight are
    lost with it), early (no round written yet) or late (some datasets' rounds written); the
    re-run replays the rounds written and ends with the rounds, fingerprints and files of a run
    never killed."""
    tok, eot = scripted
    recipe = _recipe(tmp_path / "r.json")
    calls, die_at = [], [0]
    real = ServerGenerator.agenerate_ids

    async def counted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == die_at[0]:
            raise KeyboardInterrupt
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(ServerGenerator, "agenerate_ids", counted)
    with scripted_server(tok, eot, Faults(delay_s=(0.0, 0.02), seed=6)) as server:
        assert _run01(tmp_path / "whole", recipe, tiny_target_dir, server.url) == 0
        die_at[0] = 3 if when == "early" else len(calls) - 1
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            _run01(tmp_path / "killed", recipe, tiny_target_dir, server.url)
        rounds = list((tmp_path / "killed" / PREPARED / ".self_written").glob("*/*/round_*"))
        assert not (tmp_path / "killed" / PREPARED / "manifest.json").exists()
        die_at[0] = 0
        assert _run01(tmp_path / "killed", recipe, tiny_target_dir, server.url) == 0
    assert (when == "late") == bool(rounds)
    assert _fingerprints(tmp_path / "killed") == _fingerprints(tmp_path / "whole")
    got, want = _written(tmp_path / "killed"), _written(tmp_path / "whole")
    assert sorted(got) == sorted(want) and [n for n in want if got[n] != want[n]] == []


def test_sigterm_stops_every_dataset_without_sending_more_and_a_rerun_finishes_them(
        tmp_path, tiny_target_dir, scripted):
    tok, eot = scripted
    recipe = _recipe(tmp_path / "r.json")
    server = scripted_server(tok, eot, Faults(delay_s=(0.01, 0.02)))
    answer = server.answer
    signalled = []

    def terminating(body: dict):
        if len(server.requests) == 30 and not signalled:
            signalled.append(len(server.requests))
            os.kill(os.getpid(), signal.SIGTERM)  # the stage's handler only flags it
        return answer(body)

    server.answer = terminating
    with server:
        with pytest.raises(Interrupted) as e:
            _run01(tmp_path / "w", recipe, tiny_target_dir, server.url)
        after = len(server.requests) - signalled[0]
        assert e.value.signum == signal.SIGTERM
        assert after <= 2 * BATCH  # those in flight or already let through, no more
        assert _run01(tmp_path / "w", recipe, tiny_target_dir, server.url) == 0
        assert _run01(tmp_path / "whole", recipe, tiny_target_dir, server.url) == 0
    got, want = _written(tmp_path / "w"), _written(tmp_path / "whole")
    assert [n for n in want if got[n] != want[n]] == []
