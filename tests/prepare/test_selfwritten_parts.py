"""The self-written source's parts: the template cut (Kimi's and ChatML's openings), the duplicate
filter, the judging of candidates and its counts, and the SGLang generator."""

from __future__ import annotations

from pathlib import Path

import pytest
from selfwritten_helpers import (
    CHATML_OPENING,
    KIMI_OPENING,
    ListGenerator,
    chatml_target,
    with_template,
)

from eagle3.core.chat import ChatRenderer
from eagle3.core.target import load_tokenizer
from eagle3.prepare.dedupe import DuplicateFilter
from eagle3.prepare.opening import TemplateCutError, derive_opening, next_user_ids
from eagle3.prepare.selfwritten import SelfWriter, SelfWrittenSpec, seed_of


@pytest.fixture(scope="module")
def targets(tiny_target_dir, tmp_path_factory) -> dict[str, Path]:
    """The embedded tiny target (Kimi's template) and a ChatML one."""
    return {"kimi": tiny_target_dir,
            "chatml": chatml_target(tmp_path_factory.mktemp("targets") / "chatml")}


def renderer(target: Path) -> ChatRenderer:
    return ChatRenderer(load_tokenizer(target), {"thinking": True})


# ---------------------------------------------------------------- the template cut


@pytest.mark.parametrize("kind,text", [("kimi", KIMI_OPENING), ("chatml", CHATML_OPENING)])
def test_opening_is_the_default_system_turn_then_a_user_header(targets, kind, text):
    r = renderer(targets[kind])
    opening = derive_opening(r, None)
    assert opening.text == text
    assert opening.ids == r.encode(text)
    assert opening.end_of_turn == "<|im_end|>"
    assert opening.stop_ids == [r.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_opening_holds_the_recipe_system_prompt_when_given(targets):
    opening = derive_opening(renderer(targets["kimi"]), "You write SQL.")
    assert opening.text == ("<|im_system|>system<|im_middle|>You write SQL.<|im_end|>"
                            "<|im_user|>user<|im_middle|>")
    chatml = derive_opening(renderer(targets["chatml"]), "You write SQL.")
    assert chatml.text == "<|im_start|>system\nYou write SQL.<|im_end|>\n<|im_start|>user\n"


@pytest.mark.parametrize("kind", ["kimi", "chatml"])
def test_later_user_turn_opens_after_the_rendered_reply(targets, kind):
    r = renderer(targets[kind])
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"}]
    full = r.render_text(messages + [{"role": "user", "content": "Next"}], None, False)
    assert r.tokenizer.decode(next_user_ids(r, messages)) == full[:full.index("Next")]


@pytest.mark.parametrize("template,why", [
    ("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
     "no special token closes a user turn"),
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>"
     "{% endfor %}", "does not render a user's text verbatim"),
    ("{% for m in messages %}<|im_start|>user {{ m['content'] | length }}\n{{ m['content'] }}"
     "<|im_end|>{% endfor %}", "before a user turn's content depends on the content"),
    ("{{ raise_exception('system turns only') }}", "fails to render a user turn"),
])
def test_template_that_cannot_be_cut_raises_naming_it_and_why(targets, tmp_path, template, why):
    target = with_template(targets["chatml"], tmp_path / "t", template)
    with pytest.raises(TemplateCutError, match=why) as e:
        derive_opening(renderer(target), None)
    assert f"the chat template of {target}" in str(e.value)


# ---------------------------------------------------------------- duplicates


def test_duplicate_filter_finds_exact_duplicates_whatever_the_case_and_punctuation():
    f = DuplicateFilter(0.8)
    f.add("How do I sort a list in Python?")
    assert f.check("how do i sort a LIST in python") == "exact duplicate"
    assert f.check("How do I sort a dict in Python?") is None


def test_duplicate_filter_bands_find_a_pair_at_the_threshold_with_probability_099():
    for t, rows in ((0.95, 8), (0.8, 4), (0.5, 2), (0.3, 1)):
        assert DuplicateFilter(t).rows == rows


def test_duplicate_filter_finds_near_duplicates_at_the_threshold_and_no_others():
    base = "please write a short poem about the sea and the wind at night for my little sister"
    f = DuplicateFilter(0.8)
    f.add(base)
    near = base + " today"  # 16 of 17 shingles shared: Jaccard 0.94
    assert f.check(near) == "near duplicate"
    half = " ".join(base.split()[:9]) + " then explain how tides work on other planets"
    assert f.check(half) is None  # Jaccard ~0.35
    assert DuplicateFilter(0.3).check(half) is None  # nothing added to that filter
    loose = DuplicateFilter(0.3)
    loose.add(base)
    assert loose.check(half) == "near duplicate"


def test_duplicate_filter_has_no_false_near_duplicates_among_distinct_texts():
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    f = DuplicateFilter(0.8)
    texts = [" ".join(rng.sample(words, 12)) for _ in range(500)]
    for t in texts:
        assert f.check(t) is None
        f.add(t)
    assert len(f) == 500


# ---------------------------------------------------------------- judging and its counts


def test_every_rejection_reason_is_counted_and_surplus_candidates_are_not_judged(
        targets, tmp_path):
    r = renderer(targets["kimi"])
    tok, eot, eos = r.tokenizer, r.end_of_turn_id, None

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = tok.convert_tokens_to_ids("[EOS]")
    keep = [ids(t) + [eot] for t in ("Explain how tides work on the coast",
                                     "Write a haiku about autumn leaves please")]
    outputs = [
        (keep[0], "stop"),
        (ids("an endless ramble that"), "length"),  # too long
        (ids("stopped by eos") + [eos], "stop"),  # not closed
        (ids("   ") + [eot], "stop"),  # empty
        (ids("a fake <|im_assistant|> header") + [eot], "stop"),  # special token
        (ids("bad \x07 bell text here") + [eot], "stop"),  # broken text
        (ids("hi") + [eot], "stop"),  # too short
        (ids("EXPLAIN how tides work on the coast!") + [eot], "stop"),  # exact duplicate
        (ids("Explain how tides work on the coast of Maine") + [eot], "stop"),  # near
        (keep[1], "stop"),
        (keep[1], "stop"),  # surplus: two wanted, two kept
    ]
    spec = SelfWrittenSpec(heldout=1, min_user_chars=8, near_dup_threshold=0.6,
                           max_user_tokens=32)
    writer = SelfWriter("ds", spec, r, tmp_path / "cache", count=1, seed=0, max_seq_len=4096,
                        batch_size=11, load_generator=lambda: ListGenerator(outputs))
    st = writer.run()
    assert st.rejected == {"too long": 1, "not closed": 1, "empty": 1, "special token": 1,
                           "broken text": 1, "too short": 1, "exact duplicate": 1,
                           "near duplicate": 1}
    assert (st.candidates, st.judged, st.surplus, st.kept) == (11, 10, 1, 2)
    assert st.heldout[0]["messages"] == [{"role": "user",
                                          "content": "Explain how tides work on the coast"}]
    assert st.conversations[0]["messages"][-1]["content"].startswith("Write a haiku")


def test_seed_of_is_stable_across_runs_and_distinct_per_place():
    assert seed_of(0, "user", 1, 0) == seed_of(0, "user", 1, 0)
    assert len({seed_of(0, "user", r, b) for r in range(5) for b in range(0, 64, 8)}) == 40
    assert seed_of(0, "user", 1, 0) == 3776956460396218137  # a change here changes every file


# ---------------------------------------------------------------- the SGLang generator


def test_server_generator_returns_the_servers_ids_and_sends_a_seed_per_sampled_request():
    from eagle3.prepare.server_generator import ServerGenerator, request_seed, sampling_params
    from eagle3.testing.fake_sglang import FakeSGLang, fake_output

    prompts = [[11, 12, 13], [14, 15], [16]]
    with FakeSGLang(eos_id=7) as server:
        gen = ServerGenerator([server.url], [7], concurrency=2)
        got = gen.generate_ids(prompts, 16, temperature=1.0, top_p=0.9, seed=5)
    assert got == [fake_output(p, 16, eos_id=7) for p in prompts]
    assert sampling_params(16, 1.0, 0.9, [7], request_seed(5, 1)) == {
        "max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "stop_token_ids": [7],
        "sampling_seed": request_seed(5, 1)}
    assert "sampling_seed" not in sampling_params(16, 0.0, 1.0, [7], 3)
    assert len({request_seed(5, row) for row in range(100)}) == 100
