"""Passkey ("needle in a haystack") prompts and their scorer.

Task: a 5-digit pass key sits on its own line inside filler text; the model is asked for it.
The passkey task follows Mohtashami & Jaggi, "Landmark Attention", 2023 (arXiv:2305.16300):
same filler sentences and needle wording. For a 135M model the prompt is chat-templated
(haystack inside the user turn with the question and "Answer with the number only.") and the
assistant turn is primed with "The pass key is " (measured: REPRODUCTION-CARD.md, "The small
real model on CPU"), so the first generated token is the first key digit.

Multi-needle variant (``variant="multi"``): ``needles`` near-identical needles, one per key name
("The pass key for vault-B is 71284. ..."), whose values differ from the target value in exactly one digit
(never the first; at distinct positions while ``needles - 1 < value_digits``, so they also differ from each
other in two); the question asks for one name, the assistant turn is primed with "The pass key for
<name> is ". The target needle sits at ``depth``, the distractors at ``depth + j / needles`` (mod 1), so the
needles are spread evenly over the haystack. Scored by the same ``score_answer`` against the target value
(``answer_kind`` tells a distractor's value from other misses). Parameters: ``needles`` (>= 2), ``key_names``
(one distinct name per needle, e.g. the default "vault-A" .. "vault-D", or near-duplicates such as "room 1204",
"room 1240"; the asked one is drawn from the key) and ``value_digits`` (the digits of every value, default 5).
The defaults (4 vaults, 5 digits) give the prompts of the committed results byte for byte.
This is the multi-key retrieval of RULER (Hsieh et al., 2024, arXiv:2404.06654, "MK-NIAH"), with
hard distractors (one digit apart) instead of random ones.

Haystack (``haystack``): "filler" (default) = Landmark Attention's five filler sentences, repeated; or the name
of a ``kvrepro.corpus`` corpus (e.g. "pd-books") = real prose, its digit-free sentences
(``kvrepro.corpus.haystack_sentences``) in text order from a start sentence that depends on the key only
(``int(key) % len(sentences)``), wrapping around. Either way the prompt depends on no KV format, and the rules
below are checked on it (a corpus sentence holding a needle's words, e.g. "The pass key is", would break the
exactly-once rule and be refused).

Sanity prompts (``build_sanity_prompts``): a few fixed chat prompts whose greedy continuations are
compared across KV modes (``kvrepro.accuracy.sanity_metrics``).

Rules every prompt obeys (``check_prompt``):
- every needle's token ids occur exactly once, and each value's digit ids occur only inside its own needle
  (the asked key's, and with ``check_prompt(distractor_keys=...)`` every distractor's);
- no special token (BOS/EOS/any ``all_special_ids``) inside the user content: the tokenizer's
  BOS id occurs only where the chat template opens a turn (SmolLM2's BOS *is* ``<|im_start|>``);
- the prompt depends only on (tokenizer, context_length, depth, key, wording), never on the KV
  format: ``sha256`` of the token ids is recorded so runs can be compared across formats.
"""
from __future__ import annotations

import functools
import hashlib
import random
import re
import struct
from dataclasses import dataclass, field

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_PRIME = "The pass key is "
KEY_DIGITS = 5
ROLES = ("system", "user", "assistant")
VARIANTS = ("single", "multi")
MULTI_NEEDLES = 4  # default number of needles of the multi variant
VAULTS = ("A", "B", "C", "D")
VAULT_NAMES = tuple(f"vault-{v}" for v in VAULTS)  # the default key names
VALUE_DIGITS = (2, 12)  # allowed range of value_digits (the digits of a key / value)
MAX_KEY_NAME_CHARS = 40
HAYSTACK_FILLER = "filler"  # the default haystack: FILLER repeated (else a kvrepro.corpus corpus name)
MULTI_NEEDLE = "The pass key for {name} is {key}. Remember it. {key} is the pass key for {name}."
MULTI_QUESTION = "What is the pass key for {name}? Answer with the number only."
MULTI_PRIME = "The pass key for {name} is "
SANITY_USER = (
    ("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("bicycle", "Explain in simple words how a bicycle works."),
    ("planets", "List the planets of the solar system and give one fact about each."),
)
SANITY_LONG = ("passkey-2k", 2048, 0.5)  # name, context length, depth: a long prompt, continued past the key


@dataclass(frozen=True)
class NeedlePrompt:
    """One passkey prompt.

    Attributes:
        input_ids: token ids of the whole prompt (chat template included), length ``n_tokens``.
        text: the prompt text ``input_ids`` encode.
        key: the pass key, a string of ``value_digits`` digits (default ``KEY_DIGITS``).
        answer_ids: token ids of ``key`` as it follows ``ANSWER_PRIME`` (one id per digit for SmolLM2).
        context_length: the requested length (tokens); ``n_tokens <= context_length``.
        depth: requested needle depth in [0, 1] (0 = first line of the haystack, 1 = last).
        needle_start: index in ``input_ids`` of the needle's first token.
        sha256: hex SHA-256 of ``input_ids`` as little-endian int32 bytes.
        variant: "single" or "multi".
        vault: the key name asked for, as in the text (e.g. "vault-A", "room 1204"; "" for single).
        distractors: the other needles' keys, in the order of ``key_names`` (the asked name skipped; empty for
            single).
        key_names: every needle's key name, in the order given to ``build_prompt`` (empty for single).
        haystack: "filler" or the corpus the haystack's sentences come from.
    """

    input_ids: list[int] = field(repr=False)
    text: str = field(repr=False)
    key: str
    answer_ids: list[int]
    context_length: int
    depth: float
    needle_start: int
    sha256: str
    variant: str = "single"
    vault: str = ""
    distractors: tuple = ()
    key_names: tuple = ()
    haystack: str = HAYSTACK_FILLER

    @property
    def needles(self) -> int:
        """Number of needles in the prompt (1 for single)."""
        return 1 + len(self.distractors)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


def is_int(x) -> bool:
    """``x`` is an int and not a bool (parameter checks)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_needle_grid(depths, num_keys, seed) -> None:
    """The grid parameters the CPU and vLLM accuracy grids share (``AccuracyParams``, ``VllmGrid``).

    Raises:
        ValueError: ``depths`` not a non-empty list of numbers in [0, 1], ``num_keys`` not a positive
            integer or ``seed`` not an integer (the message names the parameter)."""
    if not isinstance(depths, (tuple, list)) or not depths:
        raise ValueError(f"depths must be a non-empty list, got {depths!r}")
    for x in depths:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
            raise ValueError(f"depths: {x!r} is not a number in [0, 1]")
    if not is_int(num_keys) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def check_value_digits(value_digits) -> int:
    """``value_digits`` (the digits of a key), checked: an integer in ``VALUE_DIGITS``; ValueError naming it."""
    lo, hi = VALUE_DIGITS
    if not is_int(value_digits) or not lo <= value_digits <= hi:
        raise ValueError(f"value_digits must be an integer in [{lo}, {hi}], got {value_digits!r}")
    return value_digits


def make_keys(num_keys: int, seed: int, value_digits: int = KEY_DIGITS) -> list[str]:
    """``num_keys`` distinct keys of ``value_digits`` digits (no leading zero) from ``random.Random(seed)``
    (for 5 digits the keys every committed result used)."""
    check_value_digits(value_digits)
    if not is_int(num_keys) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
    pool = range(10 ** (value_digits - 1), 10 ** value_digits)
    if num_keys > len(pool):
        raise ValueError(f"num_keys={num_keys} exceeds the {len(pool)} keys of {value_digits} digits")
    return [str(k) for k in random.Random(seed).sample(pool, num_keys)]


def default_key_names(needles: int) -> tuple:
    """The default key names of ``needles`` needles: "vault-A", "vault-B", ... (at most 26)."""
    if not is_int(needles) or not 2 <= needles <= 26:
        raise ValueError(f"needles must be an integer in [2, 26] with the default key names (pass key_names for "
                         f"more), got {needles!r}")
    return tuple(f"vault-{chr(ord('A') + i)}" for i in range(needles))


def check_multi(needles=MULTI_NEEDLES, key_names=None, value_digits: int = KEY_DIGITS) -> tuple:
    """Check the multi-needle parameters; return the key names (``default_key_names(needles)`` for None).

    Args:
        needles: number of needles, >= 2; at most 9 x (value_digits - 1) (the values one digit apart from the
            target's, never in the first digit).
        key_names: None, or one distinct name per needle (a list of strings of 1-40 characters, no line break,
            no leading/trailing space); near-duplicates such as "room 1204", "room 1240" are allowed.
        value_digits: digits of every value (``check_value_digits``).

    Raises:
        ValueError: naming the parameter (``needles``, ``key_names``, ``value_digits``).
    """
    check_value_digits(value_digits)
    if not is_int(needles) or needles < 2:
        raise ValueError(f"needles must be an integer >= 2, got {needles!r}")
    if needles - 1 > 9 * (value_digits - 1):
        raise ValueError(f"needles={needles}: at most {9 * (value_digits - 1) + 1} needles have distinct values one "
                         f"digit apart with value_digits={value_digits}")
    if key_names is None:
        return default_key_names(needles)
    if not isinstance(key_names, (list, tuple)) or len(key_names) != needles:
        raise ValueError(f"key_names must be a list of {needles} names (one per needle), got {key_names!r}")
    for n in key_names:
        if (not isinstance(n, str) or not 1 <= len(n) <= MAX_KEY_NAME_CHARS or n != n.strip()
                or any(c in n for c in "\n\r")):
            raise ValueError(f"key_names: {n!r} is not a name of 1-{MAX_KEY_NAME_CHARS} characters without line "
                             "breaks or surrounding spaces")
    dup = sorted({n for n in key_names if list(key_names).count(n) > 1})
    if dup:
        raise ValueError(f"key_names has duplicates: {dup}")
    return tuple(key_names)


def ids_sha256(ids: list[int]) -> str:
    """Hex SHA-256 of token ids as little-endian int32 bytes."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *map(int, ids))).hexdigest()


def find_subsequence(seq: list[int], sub: list[int]) -> list[int]:
    """Start indices of every occurrence of ``sub`` in ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _render(tokenizer, haystack_lines: list[str], question: str = QUESTION, prime: str = ANSWER_PRIME) -> str:
    user = INSTRUCTION + "\n\n" + "\n".join(haystack_lines) + "\n\n" + question
    head = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return head + prime


_TOKEN_COUNTS: dict = {}


def check_haystack(haystack) -> str:
    """``haystack`` checked: "filler" or a corpus name of ``kvrepro.corpus.CORPORA``; ValueError naming it."""
    from kvrepro import corpus

    if haystack != HAYSTACK_FILLER and haystack not in corpus.CORPORA:
        raise ValueError(f"haystack must be {HAYSTACK_FILLER!r} or a corpus of kvrepro.corpus "
                         f"({', '.join(corpus.CORPORA)}), got {haystack!r}")
    return haystack


@functools.lru_cache(maxsize=4)
def _corpus_sentences(name: str) -> tuple:
    from kvrepro import corpus

    return tuple(corpus.haystack_sentences(name))


def _sentence_tokens(tokenizer, s: str) -> int:
    """Tokens of ``" " + s`` (a sentence after a space), cached per tokenizer."""
    k = (id(tokenizer), s)
    if k not in _TOKEN_COUNTS:
        _TOKEN_COUNTS[k] = len(_encode(tokenizer, " " + s))
    return _TOKEN_COUNTS[k]


def _sentence_source(haystack: str, key: str):
    """``i -> the i-th haystack sentence`` of a prompt."""
    if haystack == HAYSTACK_FILLER:
        return lambda i: FILLER[i % len(FILLER)]
    pool = _corpus_sentences(haystack)
    start = int(key) % len(pool)
    return lambda i: pool[(start + i) % len(pool)]


def _haystack(sentences: list[str], placed: list[tuple[float, str]]) -> list[str]:
    """Lines of the haystack: filler split at ``round(depth x len(sentences))`` for each
    ``(depth, needle)`` (in the given order on ties), each needle on its own line."""
    cuts = sorted(((round(d * len(sentences)), i, nd) for i, (d, nd) in enumerate(placed)))
    lines, prev = [], 0
    for at, _, nd in cuts:
        lines += [" ".join(sentences[prev:at]), nd]
        prev = at
    lines.append(" ".join(sentences[prev:]))
    return [x for x in lines if x]


def near_keys(key: str, n: int) -> list[str]:
    """``n`` distinct distractor keys, each equal to ``key`` except one digit (never the first).
    ``n <= len(key) - 1``: at distinct positions, so they also differ from each other in two digits;
    up to ``9 x (len(key) - 1)``: distinct (position, digit) changes. Deterministic: ``random.Random(int(key))``."""
    d = len(key)
    if not is_int(n) or not 0 <= n <= 9 * (d - 1):
        raise ValueError(f"n must be in [0, {9 * (d - 1)}] for a key of {d} digits, got {n!r}")
    rng = random.Random(int(key))
    if n <= d - 1:
        out = []
        for pos in rng.sample(range(1, d), n):
            digit = rng.choice([c for c in "0123456789" if c != key[pos]])
            out.append(key[:pos] + digit + key[pos + 1:])
        return out
    changes = [(pos, c) for pos in range(1, d) for c in "0123456789" if c != key[pos]]
    return [key[:pos] + c + key[pos + 1:] for pos, c in rng.sample(changes, n)]


def _needles(variant: str, key: str, depth: float, names: tuple = VAULT_NAMES):
    """``(placed, question, prime, target_needle, name, distractors)`` of a variant; ``names``: the key names of
    the multi variant (one per needle)."""
    if variant == "single":
        nd = NEEDLE.format(key=key)
        return [(depth, nd)], QUESTION, ANSWER_PRIME, nd, "", ()
    needles = len(names)
    others = near_keys(key, needles - 1)
    target_i = random.Random(int(key) + 1).randrange(needles)
    other_names = [v for i, v in enumerate(names) if i != target_i]
    name = names[target_i]
    target = MULTI_NEEDLE.format(name=name, key=key)
    placed = [(depth, target)] + [((depth + j / needles) % 1.0, MULTI_NEEDLE.format(name=v, key=k))
                                  for j, (v, k) in enumerate(zip(other_names, others), start=1)]
    return (placed, MULTI_QUESTION.format(name=name), MULTI_PRIME.format(name=name), target, name,
            tuple(others))


def build_prompt(tokenizer, context_length: int, depth: float, key: str, variant: str = "single", *,
                 needles: int = MULTI_NEEDLES, key_names=None, value_digits: int = KEY_DIGITS,
                 haystack: str = HAYSTACK_FILLER) -> NeedlePrompt:
    """Passkey prompt of at most ``context_length`` tokens (as close as whole filler sentences allow).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        context_length: target prompt length in tokens (template included), >= 128.
        depth: (target) needle position in the haystack, 0.0 (first) .. 1.0 (last), by filler sentences.
        key: ``value_digits`` digits, no leading zero.
        variant: "single" (one needle) or "multi" (``needles`` near-identical needles, see module doc).
        needles, key_names: the multi variant's number of needles and their names (``check_multi``; ignored
            for "single").
        value_digits: digits of the key (and of every distractor value).
        haystack: "filler" or a ``kvrepro.corpus`` corpus name (module docstring).

    Raises:
        ValueError: bad ``context_length``, ``depth``, ``key``, ``variant``, ``needles``, ``key_names``,
            ``value_digits`` or ``haystack`` (naming it; ``needles`` also when the needles alone do not fit
            ``context_length``), or a rule of ``check_prompt`` broken.
    """
    if not is_int(context_length) or context_length < 128:
        raise ValueError(f"context_length must be an integer >= 128 tokens, got {context_length!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_value_digits(value_digits)
    if not (isinstance(key, str) and re.fullmatch(rf"[1-9]\d{{{value_digits - 1}}}", key)):
        raise ValueError(f"key must be a string of {value_digits} digits (value_digits) without a leading zero, "
                         f"got {key!r}")
    names = check_multi(needles, key_names, value_digits) if variant == "multi" else ()
    check_haystack(haystack)
    placed, question, prime, target, vault, others = _needles(variant, key, float(depth), names)
    fixed = len(_encode(tokenizer, _render(tokenizer, [nd for _, nd in placed], question, prime)))
    if fixed > context_length:
        what = f"needles: {len(placed)} needles" if variant == "multi" else "the needle"
        raise ValueError(f"{what} with the instruction and question take {fixed} tokens, more than "
                         f"context_length={context_length}")
    sentence = _sentence_source(haystack, key)
    sentences: list[str] = []
    budget = context_length - fixed
    while budget > 0:
        s = sentence(len(sentences))
        n = _sentence_tokens(tokenizer, s)
        if n > budget:
            break
        sentences.append(s)
        budget -= n
    while True:  # joins may tokenize slightly differently: trim until it fits
        text = _render(tokenizer, _haystack(sentences, placed), question, prime)
        ids = _encode(tokenizer, text)
        if len(ids) <= context_length or not sentences:
            break
        sentences.pop()
    if len(ids) > context_length:
        raise ValueError(f"context_length={context_length} is too short for the prompt ({len(ids)} tokens)")
    answer_ids = _encode(tokenizer, key)
    needle_start = check_prompt(tokenizer, ids, target, answer_ids, question=question,
                                distractors=[nd for _, nd in placed[1:]], distractor_keys=others)
    return NeedlePrompt(ids, text, key, answer_ids, context_length, float(depth), needle_start, ids_sha256(ids),
                        variant, vault, others, names, haystack)


def check_prompt(tokenizer, ids: list[int], needle: str, answer_ids: list[int], question: str = QUESTION,
                 distractors=(), distractor_keys=()) -> int:
    """Check the rules of the module docstring; return the (target) needle's start index.
    ``distractors``: the other needles' texts (multi-needle), each of which must also occur exactly once;
    ``distractor_keys``: their values (same order, or empty: not checked), each of whose digit ids must occur
    only inside its own needle.

    Raises:
        ValueError: naming the broken rule.
    """
    if distractor_keys and len(distractor_keys) != len(distractors):
        raise ValueError("distractor_keys must give one value per distractor needle")
    for i, other in enumerate(distractors):
        other_ids = _encode(tokenizer, other)
        hits = find_subsequence(ids, other_ids)
        if len(hits) != 1:
            raise ValueError("a distractor needle's token ids do not occur exactly once in the prompt")
        if distractor_keys:
            outside = ids[:hits[0]] + [-1] + ids[hits[0] + len(other_ids):]
            if find_subsequence(outside, _encode(tokenizer, distractor_keys[i])):
                raise ValueError(f"distractor value {distractor_keys[i]}'s token ids occur outside its needle")
    needle_ids = _encode(tokenizer, needle)
    hits = find_subsequence(ids, needle_ids)
    if len(hits) != 1:
        raise ValueError(f"needle token ids occur {len(hits)} times in the prompt, expected exactly once")
    start, end = hits[0], hits[0] + len(needle_ids)
    outside = ids[:start] + [-1] + ids[end:]
    if find_subsequence(outside, answer_ids):
        raise ValueError("the key's token ids occur outside the needle")
    special = set(tokenizer.all_special_ids)
    user_open = find_subsequence(ids, _encode(tokenizer, INSTRUCTION))
    user_close = find_subsequence(ids, _encode(tokenizer, question))
    if len(user_open) != 1 or len(user_close) != 1:
        raise ValueError("instruction/question not found exactly once in the prompt")
    if any(t in special for t in ids[user_open[0]:user_close[0]]):
        raise ValueError("a special token (BOS/EOS) occurs inside the user content")
    bos = tokenizer.bos_token_id
    if bos is not None:
        for p in (i for i, t in enumerate(ids) if t == bos):
            if not tokenizer.decode(ids[p + 1:p + 4]).lstrip().startswith(ROLES):
                raise ValueError(f"BOS token at position {p} does not open a chat turn (BOS in mid-prompt)")
    return start


_NUMBER = re.compile(r"\d+")


def answer_decided(text: str) -> bool:
    """True once ``text`` holds a complete first number (digits followed by a non-digit), i.e. once
    ``score_answer`` can no longer change by generating more tokens."""
    return re.search(r"\d+\D", text) is not None


def score_answer(text: str, key: str) -> int:
    """1 if the first whole number in ``text`` equals ``key``, else 0.

    "48213", "The pass key is 48213.", "Sure, it's 48213." score 1 for key "48213";
    "4821", "482130" and "" score 0 (whole-number match, not substring).
    """
    m = _NUMBER.search(text)
    return int(m is not None and m.group(0) == key)


def answer_kind(text: str, key: str, distractors=()) -> str:
    """"target" if ``score_answer(text, key)``, "distractor" if the first whole number is one of
    ``distractors`` (multi-needle: the model retrieved the wrong vault), else "other"."""
    if score_answer(text, key):
        return "target"
    m = _NUMBER.search(text)
    return "distractor" if m is not None and m.group(0) in set(distractors) else "other"


@dataclass(frozen=True)
class SanityPrompt:
    """A fixed prompt whose greedy continuation is compared across KV modes.

    Attributes:
        name: short label.
        input_ids: token ids (chat template, generation prompt included).
        sha256: ``ids_sha256(input_ids)``.
    """

    name: str
    input_ids: list[int] = field(repr=False)
    sha256: str


def sanity_long_name(context_length: int) -> str:
    """Name of the long sanity prompt of ``context_length`` tokens: "passkey-2k" for 2048, "passkey-8000"."""
    return f"passkey-{context_length // 1024}k" if context_length % 1024 == 0 else f"passkey-{context_length}"


def build_sanity_prompts(tokenizer, seed: int = 0, include_long: bool = True,
                         long_lengths=(SANITY_LONG[1],)) -> list[SanityPrompt]:
    """The ``SANITY_USER`` chat prompts (user turn, assistant generation prompt), plus, when
    ``include_long``, one passkey prompt per length of ``long_lengths`` (default: ``SANITY_LONG``'s 2K tokens;
    depth 0.5, key ``make_keys(1, seed)[0]``, named by ``sanity_long_name``) whose continuation runs on past
    the key over a long cache."""
    out = []
    for name, user in SANITY_USER:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        ids = _encode(tokenizer, text)
        out.append(SanityPrompt(name, ids, ids_sha256(ids)))
    if include_long:
        for n in long_lengths:
            p = build_prompt(tokenizer, n, SANITY_LONG[2], make_keys(1, seed)[0])
            out.append(SanityPrompt(sanity_long_name(n), p.input_ids, p.sha256))
    return out
