"""Needle prompt builder and scorer (the prompt rules of kvrepro.needle), with SmolLM2's real tokenizer."""
import hashlib
import itertools
import re

import pytest

from kvrepro import needle
from kvrepro.needle import build_prompt, check_prompt, make_keys, score_answer

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def tok():
    from kvrepro.hf import load_smollm2

    return load_smollm2()[1]  # cached per process: the model tests reuse the same load


@pytest.mark.parametrize("text,expected", [
    ("48213", 1), ("The pass key is 48213.", 1), ("Sure, it's 48213.", 1), ("48213<|im_end|>", 1),
    ("4821", 0), ("482130", 0), ("148213", 0), ("", 0), ("The pass key is 12345, not 48213", 0),
])
def test_score_whole_number(text, expected):
    assert score_answer(text, "48213") == expected


@pytest.fixture(scope="module")
def prompts_8k(tok):
    return [build_prompt(tok, 8192, d, "48213") for d in DEPTHS]


def test_needle_rules_at_8k(tok, prompts_8k):
    starts = []
    for p in prompts_8k:
        assert 8192 - 16 <= p.n_tokens <= 8192
        assert tok(p.text, add_special_tokens=False).input_ids == p.input_ids  # ids encode the text
        # independent of the builder's token search: count in the decoded text
        decoded = tok.decode(p.input_ids)
        assert decoded.count(needle.NEEDLE.format(key="48213")) == 1
        assert decoded.count("48213") == 2  # both occurrences are inside the one needle
        needle_ids = tok(needle.NEEDLE.format(key="48213"), add_special_tokens=False).input_ids
        hits = [i for i in range(p.n_tokens) if p.input_ids[i:i + len(needle_ids)] == needle_ids]
        assert hits == [p.needle_start]
        # SmolLM2's BOS is <|im_start|>: exactly the 3 turn openings (system, user, assistant), none mid-prompt
        bos_at = [i for i, t in enumerate(p.input_ids) if t == tok.bos_token_id]
        assert len(bos_at) == 3 and bos_at[0] == 0
        assert all(tok.decode(p.input_ids[i + 1:i + 4]).startswith(("system", "user", "ass")) for i in bos_at)
        assert tok.eos_token_id not in p.input_ids[bos_at[1]:bos_at[2] - 2]  # only the user turn's own end
        assert p.text.endswith(needle.ANSWER_PRIME) and p.answer_ids == tok("48213").input_ids
        assert p.sha256 == hashlib.sha256(
            b"".join(int(i).to_bytes(4, "little", signed=True) for i in p.input_ids)).hexdigest()
        starts.append(p.needle_start / p.n_tokens)
    assert starts == sorted(starts) and starts[0] < 0.02 and starts[-1] > 0.97  # depth 0 first, 1.0 last
    for lo, d in zip(starts[1:4], DEPTHS[1:4]):
        assert abs(lo - d) < 0.02


def test_prompt_is_deterministic_and_key_specific(tok):
    a, b = build_prompt(tok, 1024, 0.5, "48213"), build_prompt(tok, 1024, 0.5, "48213")
    assert a.input_ids == b.input_ids and a.sha256 == b.sha256
    c = build_prompt(tok, 1024, 0.5, "51234")
    assert c.sha256 != a.sha256 and c.n_tokens == a.n_tokens


def test_check_prompt_catches_broken_prompts(tok):
    p = build_prompt(tok, 512, 0.5, "48213")
    text = needle.NEEDLE.format(key="48213")
    ids = list(p.input_ids)
    mid = p.needle_start - 5
    with pytest.raises(ValueError, match="BOS"):
        check_prompt(tok, ids[:mid] + [tok.bos_token_id] + ids[mid:], text, p.answer_ids)
    twice = ids[:mid] + tok(text, add_special_tokens=False).input_ids + ids[mid:]
    with pytest.raises(ValueError, match="exactly once"):
        check_prompt(tok, twice, text, p.answer_ids)
    leak = ids[:mid] + tok(" 48213", add_special_tokens=False).input_ids + ids[mid:]
    with pytest.raises(ValueError, match="outside the needle"):
        check_prompt(tok, leak, text, p.answer_ids)


@pytest.mark.parametrize("kwargs,name", [
    (dict(context_length=64), "context_length"), (dict(context_length=-5), "context_length"),
    (dict(depth=1.5), "depth"), (dict(depth=-0.1), "depth"), (dict(key="04821"), "key"),
    (dict(key="4821"), "key"), (dict(key=48213), "key"),
])
def test_bad_arguments_name_the_parameter(tok, kwargs, name):
    args = dict(context_length=512, depth=0.5, key="48213") | kwargs
    with pytest.raises(ValueError, match=name):
        build_prompt(tok, **args)


def test_make_keys():
    keys = make_keys(6, seed=3)
    assert keys == make_keys(6, seed=3) and len(set(keys)) == 6
    assert all(len(k) == 5 and k[0] != "0" for k in keys)
    with pytest.raises(ValueError, match="num_keys"):
        make_keys(0, seed=0)


@pytest.mark.parametrize("text,decided", [("", False), ("6", False), ("60494", False), ("60494.", True),
                                          ("The pass key is 6", False), ("Sure, it's 48213.", True)])
def test_answer_decided_only_when_the_first_number_is_complete(text, decided):
    assert needle.answer_decided(text) == decided
    if decided:  # more tokens can no longer change the score
        assert score_answer(text + "999", "60494") == score_answer(text, "60494")


# ---------------------------------------------------------------- multi-needle variant

@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multi_needle_prompt_rules(tok, depth):
    key = "71234"
    p = build_prompt(tok, 2048, depth, key, "multi")
    text = tok.decode(p.input_ids)
    assert tok(p.text, add_special_tokens=False).input_ids == p.input_ids and 2048 - 16 <= p.n_tokens <= 2048
    assert p.variant == "multi" and p.vault in needle.VAULT_NAMES and len(p.distractors) == needle.MULTI_NEEDLES - 1
    assert p.key_names == ("vault-A", "vault-B", "vault-C", "vault-D") and p.needles == 4
    # independent of the builder: parse every needle line out of the decoded text
    found = re.findall(r"The pass key for (vault-[A-D]) is (\d{5})\. Remember it\. \2 is the pass key for \1\.",
                       text)
    assert sorted(v for v, _ in found) == list(needle.VAULT_NAMES)  # each vault exactly once
    keys = dict(found)
    assert keys[p.vault] == key and sorted(k for v, k in found if v != p.vault) == sorted(p.distractors)
    for d in p.distractors:  # near-identical: one digit apart (never the first) from the key ...
        diff = [i for i in range(5) if d[i] != key[i]]
        assert len(diff) == 1 and diff[0] > 0
    for a, b in itertools.combinations(p.distractors, 2):  # ... and two from each other
        assert sum(x != y for x, y in zip(a, b)) == 2
    assert text.count(key) == 2 and text.count(p.vault) == 4  # 2 in its needle, question, prime
    assert f"What is the pass key for {p.vault}? Answer with the number only." in text
    assert p.text.endswith(f"The pass key for {p.vault} is ")
    # positions: the target at `depth`, the distractors at depth + j/4 (mod 1) of the haystack
    start = text.index("\n\n") + 2
    end = text.index("What is the pass key")
    pos = {v: (text.index(f"{v} is") - start) / (end - start) for v in needle.VAULT_NAMES}
    others = [v for v in needle.VAULT_NAMES if v != p.vault]
    assert abs(pos[p.vault] - depth) < 0.03
    for j, v in enumerate(others, start=1):
        assert abs(pos[v] - (depth + j / 4) % 1.0) < 0.03


def test_multi_needle_deterministic_and_distinct_from_single(tok):
    a = build_prompt(tok, 1024, 0.33, "60494", "multi")
    assert a.input_ids == build_prompt(tok, 1024, 0.33, "60494", "multi").input_ids
    assert a.sha256 != build_prompt(tok, 1024, 0.33, "60494").sha256
    assert needle.near_keys("60494", 3) == list(a.distractors)
    with pytest.raises(ValueError, match="variant"):
        build_prompt(tok, 1024, 0.5, "60494", "triple")


def test_check_prompt_catches_a_repeated_distractor(tok):
    p = build_prompt(tok, 512, 0.5, "48213", "multi")
    vaults = [v for v in needle.VAULT_NAMES if v != p.vault]
    dis = [needle.MULTI_NEEDLE.format(name=v, key=k) for v, k in zip(vaults, p.distractors)]
    target = needle.MULTI_NEEDLE.format(name=p.vault, key="48213")
    q = needle.MULTI_QUESTION.format(name=p.vault)
    assert check_prompt(tok, p.input_ids, target, p.answer_ids, q, dis, p.distractors) == p.needle_start
    # a distractor's value outside its needle breaks the rule for that value too
    leak = tok(" " + p.distractors[0], add_special_tokens=False).input_ids
    leaked = p.input_ids[:p.needle_start] + leak + p.input_ids[p.needle_start:]
    with pytest.raises(ValueError, match=f"distractor value {p.distractors[0]}'s token ids occur outside its needle"):
        check_prompt(tok, leaked, target, p.answer_ids, q, dis, p.distractors)
    extra = tok(dis[0], add_special_tokens=False).input_ids
    twice = p.input_ids[:p.needle_start] + extra + p.input_ids[p.needle_start:]
    with pytest.raises(ValueError, match="distractor"):
        check_prompt(tok, twice, target, p.answer_ids, q, dis)


@pytest.mark.parametrize("text,kind", [("71234.", "target"), ("71284.", "distractor"), ("7128", "other"),
                                       ("", "other"), ("The key is 71294", "distractor")])
def test_answer_kind(text, kind):
    assert needle.answer_kind(text, "71234", ("71284", "71294")) == kind


def test_sanity_prompts(tok):
    ps = needle.build_sanity_prompts(tok)
    assert [p.name for p in ps] == [n for n, _ in needle.SANITY_USER] + [needle.SANITY_LONG[0]]
    for p, (_, user) in zip(ps, needle.SANITY_USER):
        assert user in tok.decode(p.input_ids) and tok.decode(p.input_ids).endswith("<|im_start|>assistant\n")
        assert p.sha256 == hashlib.sha256(b"".join(int(i).to_bytes(4, "little", signed=True)
                                                   for i in p.input_ids)).hexdigest()
    assert ps[-1].input_ids == build_prompt(tok, 2048, 0.5, make_keys(1, 0)[0]).input_ids


# ---------------------------------------------------------------- multi-needle parameters

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
ROOMS = ["room 1204", "room 1240", "room 1024", "room 2104"]


def test_defaults_reproduce_the_committed_prompts(tok):
    """The default multi-needle parameters (4 vaults, 5-digit values) give the committed CPU results' prompts byte
    for byte (their SHA-256), and the default keys are the committed grid's."""
    import pandas as pd

    for name, variant in (("03_multi.csv", "multi"), ("03_default.csv", "single")):
        d = pd.read_csv(ROOT / "results" / "accuracy" / name, dtype={"key": str})
        d = d[(d["format"] == "bf16") & (d["context_length"] <= 2048)]
        assert len(d) >= 8 and set(d["key"]) <= set(make_keys(2, 0))
        for _, r in d.iterrows():
            p = build_prompt(tok, int(r["context_length"]), float(r["depth"]), r["key"], variant)
            assert p.sha256 == r["prompt_sha256"]
            assert p.vault == ("" if variant == "single" else f"vault-{r['vault']}")
            assert " ".join(p.distractors) == ("" if pd.isna(r.get("distractors")) else str(r["distractors"]))


def _needles_in(text):
    return re.findall(r"The pass key for ([^\n]+?) is (\d+)\. Remember it\. \2 is the pass key for \1\.", text)


@pytest.mark.parametrize("needles,depth", [(2, 0.0), (3, 0.5), (4, 1.0)])
def test_multi_needle_with_near_duplicate_room_names(tok, needles, depth):
    names = ROOMS[:needles]
    key = "60494"
    p = build_prompt(tok, 1024, depth, key, "multi", needles=needles, key_names=names)
    text = tok.decode(p.input_ids)
    found = _needles_in(text)
    assert sorted(n for n, _ in found) == sorted(names) and p.key_names == tuple(names) and p.needles == needles
    values = dict(found)
    assert p.vault in names and values[p.vault] == key
    assert sorted(v for n, v in found if n != p.vault) == sorted(p.distractors)
    for v in values.values():  # every value's digits only inside its own needle (twice), never in a room number
        assert text.count(v) == 2
    assert text.count(f"for {p.vault}?") == 1 and p.text.endswith(f"The pass key for {p.vault} is ")
    for other in set(names) - {p.vault}:  # near-duplicates, each its own needle line once
        assert text.count(f"for {other} is") == 1


def test_multi_needle_value_digits_and_many_needles(tok):
    p = build_prompt(tok, 2048, 0.25, "731", "multi", needles=3, value_digits=3)
    assert p.answer_ids == tok("731", add_special_tokens=False).input_ids and len(p.distractors) == 2
    assert all(len(d) == 3 and d[0] == "7" and sum(a != b for a, b in zip(d, "731")) == 1 for d in p.distractors)
    # more needles than digit positions: distinct (position, digit) changes, still one digit apart, never the first
    q = build_prompt(tok, 2048, 0.5, "48213", "multi", needles=10)
    assert q.key_names == tuple(f"vault-{c}" for c in "ABCDEFGHIJ") and len(set(q.distractors)) == 9
    assert all(sum(a != b for a, b in zip(d, "48213")) == 1 and d[0] == "4" for d in q.distractors)
    assert sorted(v for _, v in _needles_in(tok.decode(q.input_ids))) == sorted([*q.distractors, "48213"])
    assert make_keys(3, 0, value_digits=3) == make_keys(3, 0, value_digits=3)
    assert all(len(k) == 3 and k[0] != "0" for k in make_keys(50, 1, value_digits=3))
    assert make_keys(4, 0) == make_keys(4, 0, value_digits=5)
    with pytest.raises(ValueError, match="n must be in"):
        needle.near_keys("48213", 37)


@pytest.mark.parametrize("kw,match", [
    (dict(needles=1), "needles must be an integer >= 2"),
    (dict(needles="3"), "needles must be an integer >= 2"),
    (dict(needles=27), r"needles must be an integer in \[2, 26\] with the default key names"),
    (dict(needles=11, value_digits=2, key="48"), "needles=11: at most 10 needles"),
    (dict(needles=2, key_names=["room 1204", "room 1204"]), r"key_names has duplicates: \['room 1204'\]"),
    (dict(needles=3, key_names=["room 1204", "room 1240"]), "key_names must be a list of 3 names"),
    (dict(needles=2, key_names=["room 1204", "room\n1240"]), "key_names: 'room.*is not a name of 1-40 characters"),
    (dict(needles=2, key_names=["room 1204", " room 1240"]), "key_names"),
    (dict(needles=2, key_names=["room 1204", ""]), "key_names"),
    (dict(value_digits=1), r"value_digits must be an integer in \[2, 12\]"),
    (dict(value_digits=13), "value_digits"),
    (dict(value_digits="5"), "value_digits"),
    (dict(value_digits=6), r"key must be a string of 6 digits \(value_digits\)"),
    (dict(variant="triple"), "variant must be one of"),
    (dict(needles=20, context_length=256), r"needles: 20 needles with the instruction and question take \d+ tokens, "
                                           r"more than context_length=256"),
    (dict(needles=2, key_names=["room 48213", "room 1"]), "the key's token ids occur outside the needle"),
])
def test_multi_needle_bad_parameters_name_it(tok, kw, match):
    args = dict(context_length=1024, depth=0.5, key="48213", variant="multi") | kw
    with pytest.raises(ValueError, match=match):
        build_prompt(tok, **args)


def test_long_sanity_prompts(tok):
    ps = needle.build_sanity_prompts(tok, long_lengths=(2048, 4096, 3000))
    assert [p.name for p in ps][-3:] == ["passkey-2k", "passkey-4k", "passkey-3000"]
    assert ps[-1].input_ids == build_prompt(tok, 3000, 0.5, make_keys(1, 0)[0]).input_ids
    assert [p.sha256 for p in needle.build_sanity_prompts(tok)] == [p.sha256 for p in ps[:4]]


# ---------------------------------------------------------------- haystack: real prose from kvrepro.corpus

@pytest.mark.parametrize("variant", ["single", "multi"])
def test_corpus_haystack_keeps_the_rules(tok, variant):
    """haystack="pd-books": the haystack is the corpus' digit-free sentences in text order, from a start that
    depends on the key only; the needles and the question are the filler prompt's, and every rule holds."""
    from kvrepro import corpus

    key = "60494"
    p = build_prompt(tok, 2048, 0.5, key, variant, haystack="pd-books")
    f = build_prompt(tok, 2048, 0.5, key, variant)
    assert p.haystack == "pd-books" and f.haystack == "filler" and 2048 - 64 <= p.n_tokens <= 2048
    assert p.sha256 != f.sha256
    assert p.input_ids == build_prompt(tok, 2048, 0.5, key, variant, haystack="pd-books").input_ids
    text = tok.decode(p.input_ids)
    single = r"The pass key is (\d+)\. Remember it\. \1 is"
    needles = _needles_in(text) if variant == "multi" else re.findall(single, text)
    assert len(needles) == (4 if variant == "multi" else 1) and "The grass is green." not in text
    body = text[text.index("\n\n") + 2:text.index("What is the pass key")]
    prose = [ln for ln in body.split("\n") if ln and "pass key" not in ln]
    assert not re.search(r"\d", " ".join(prose))                       # digits only in the needles
    pool = corpus.haystack_sentences("pd-books")
    start = int(key) % len(pool)
    assert " ".join(prose).startswith(pool[start]) and pool[start + 1] in " ".join(prose)
    assert build_prompt(tok, 2048, 0.5, "60495", variant, haystack="pd-books").text != p.text   # another key, start
    with pytest.raises(ValueError, match="haystack must be 'filler' or a corpus of kvrepro.corpus"):
        build_prompt(tok, 2048, 0.5, key, variant, haystack="novels")
