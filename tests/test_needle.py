"""Needle prompt builder and scorer (field-faults.md row 11), with SmolLM2's real tokenizer."""
import hashlib

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
