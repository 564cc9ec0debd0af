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
    assert p.variant == "multi" and p.vault in needle.VAULTS and len(p.distractors) == needle.MULTI_NEEDLES - 1
    # independent of the builder: parse every needle line out of the decoded text
    found = re.findall(r"The pass key for vault-([A-D]) is (\d{5})\. Remember it\. \2 is the pass key for vault-\1\.",
                       text)
    assert sorted(v for v, _ in found) == list(needle.VAULTS)  # each vault exactly once
    keys = dict(found)
    assert keys[p.vault] == key and sorted(k for v, k in found if v != p.vault) == sorted(p.distractors)
    for d in p.distractors:  # near-identical: one digit apart (never the first) from the key ...
        diff = [i for i in range(5) if d[i] != key[i]]
        assert len(diff) == 1 and diff[0] > 0
    for a, b in itertools.combinations(p.distractors, 2):  # ... and two from each other
        assert sum(x != y for x, y in zip(a, b)) == 2
    assert text.count(key) == 2 and text.count("vault-" + p.vault) == 4  # 2 in its needle, question, prime
    assert f"What is the pass key for vault-{p.vault}? Answer with the number only." in text
    assert p.text.endswith(f"The pass key for vault-{p.vault} is ")
    # positions: the target at `depth`, the distractors at depth + j/4 (mod 1) of the haystack
    start = text.index("\n\n") + 2
    end = text.index("What is the pass key")
    pos = {v: (text.index(f"vault-{v} is") - start) / (end - start) for v in needle.VAULTS}
    others = sorted((v for v in needle.VAULTS if v != p.vault), key=lambda v: needle.VAULTS.index(v))
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
    vaults = [v for v in needle.VAULTS if v != p.vault]
    dis = [needle.MULTI_NEEDLE.format(vault=v, key=k) for v, k in zip(vaults, p.distractors)]
    target = needle.MULTI_NEEDLE.format(vault=p.vault, key="48213")
    q = needle.MULTI_QUESTION.format(vault=p.vault)
    assert check_prompt(tok, p.input_ids, target, p.answer_ids, q, dis) == p.needle_start
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
