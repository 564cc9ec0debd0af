"""Passkey ("needle in a haystack") prompts and their scorer.

Task: a 5-digit pass key sits on its own line inside filler text; the model is asked for it.
The passkey task follows Mohtashami & Jaggi, "Landmark Attention", 2023 (arXiv:2305.16300):
same filler sentences and needle wording. For a 135M model the prompt is chat-templated
(haystack inside the user turn with the question and "Answer with the number only.") and the
assistant turn is primed with "The pass key is " (measured: REPRODUCTION-CARD.md, "The small
real model on CPU"), so the first generated token is the first key digit.

Multi-needle variant (``variant="multi"``): ``MULTI_NEEDLES`` near-identical needles, one per vault
("The pass key for vault-B is 71284. ..."), whose keys differ from the target key in exactly one digit
(never the first) and from each other in two; the question asks for one vault, the assistant turn is
primed with "The pass key for vault-X is ". The target needle sits at ``depth``, the distractors at
``depth + j / MULTI_NEEDLES`` (mod 1), so the needles are spread evenly over the haystack. Scored by the
same ``score_answer`` against the target key (``answer_kind`` tells a distractor's key from other misses).
This is the multi-key retrieval of RULER (Hsieh et al., 2024, arXiv:2404.06654, "MK-NIAH"), with
hard distractors (one digit apart) instead of random ones.

Sanity prompts (``build_sanity_prompts``): a few fixed chat prompts whose greedy continuations are
compared across KV modes (``kvrepro.accuracy.sanity_metrics``).

Rules every prompt obeys (``check_prompt``):
- the needle's token ids occur exactly once, and the key's digit ids occur only inside it;
- no special token (BOS/EOS/any ``all_special_ids``) inside the user content: the tokenizer's
  BOS id occurs only where the chat template opens a turn (SmolLM2's BOS *is* ``<|im_start|>``);
- the prompt depends only on (tokenizer, context_length, depth, key, wording), never on the KV
  format: ``sha256`` of the token ids is recorded so runs can be compared across formats.
"""
from __future__ import annotations

import hashlib
import random
import re
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
MULTI_NEEDLES = 4
VAULTS = ("A", "B", "C", "D")
MULTI_NEEDLE = "The pass key for vault-{vault} is {key}. Remember it. {key} is the pass key for vault-{vault}."
MULTI_QUESTION = "What is the pass key for vault-{vault}? Answer with the number only."
MULTI_PRIME = "The pass key for vault-{vault} is "
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
        key: the pass key, a string of ``KEY_DIGITS`` digits.
        answer_ids: token ids of ``key`` as it follows ``ANSWER_PRIME`` (one id per digit for SmolLM2).
        context_length: the requested length (tokens); ``n_tokens <= context_length``.
        depth: requested needle depth in [0, 1] (0 = first line of the haystack, 1 = last).
        needle_start: index in ``input_ids`` of the needle's first token.
        sha256: hex SHA-256 of ``input_ids`` as little-endian int32 bytes.
        variant: "single" or "multi".
        vault: the vault asked for ("" for single).
        distractors: the other needles' keys, in vault order ("" vault letters skipped; empty for single).
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


def make_keys(num_keys: int, seed: int) -> list[str]:
    """``num_keys`` distinct 5-digit keys (no leading zero) from ``random.Random(seed)``."""
    if not is_int(num_keys) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
    return [str(k) for k in random.Random(seed).sample(range(10_000, 100_000), num_keys)]


def ids_sha256(ids: list[int]) -> str:
    """Hex SHA-256 of token ids as little-endian int32 bytes."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)).hexdigest()


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
    """``n`` (<= KEY_DIGITS - 1) distractor keys, each equal to ``key`` except one digit (never the
    first), at distinct positions, so they also differ from each other in two digits.
    Deterministic: ``random.Random(int(key))``."""
    if not 0 <= n <= KEY_DIGITS - 1:
        raise ValueError(f"n must be in [0, {KEY_DIGITS - 1}], got {n!r}")
    rng = random.Random(int(key))
    out = []
    for pos in rng.sample(range(1, KEY_DIGITS), n):
        digit = rng.choice([c for c in "0123456789" if c != key[pos]])
        out.append(key[:pos] + digit + key[pos + 1:])
    return out


def _needles(variant: str, key: str, depth: float):
    """``(placed, question, prime, target_needle, vault, distractors)`` of a variant."""
    if variant == "single":
        nd = NEEDLE.format(key=key)
        return [(depth, nd)], QUESTION, ANSWER_PRIME, nd, "", ()
    others = near_keys(key, MULTI_NEEDLES - 1)
    target_i = random.Random(int(key) + 1).randrange(MULTI_NEEDLES)
    vaults = VAULTS[:MULTI_NEEDLES]
    other_vaults = [v for i, v in enumerate(vaults) if i != target_i]
    vault = vaults[target_i]
    target = MULTI_NEEDLE.format(vault=vault, key=key)
    placed = [(depth, target)] + [((depth + j / MULTI_NEEDLES) % 1.0, MULTI_NEEDLE.format(vault=v, key=k))
                                  for j, (v, k) in enumerate(zip(other_vaults, others), start=1)]
    return (placed, MULTI_QUESTION.format(vault=vault), MULTI_PRIME.format(vault=vault), target, vault,
            tuple(others))


def build_prompt(tokenizer, context_length: int, depth: float, key: str, variant: str = "single") -> NeedlePrompt:
    """Passkey prompt of at most ``context_length`` tokens (as close as whole filler sentences allow).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        context_length: target prompt length in tokens (template included), >= 128.
        depth: (target) needle position in the haystack, 0.0 (first) .. 1.0 (last), by filler sentences.
        key: ``KEY_DIGITS`` digits, no leading zero.
        variant: "single" (one needle) or "multi" (``MULTI_NEEDLES`` near-identical needles, see module doc).

    Raises:
        ValueError: bad ``context_length``, ``depth``, ``key`` or ``variant`` (naming it), or a rule of
            ``check_prompt`` broken.
    """
    if not is_int(context_length) or context_length < 128:
        raise ValueError(f"context_length must be an integer >= 128 tokens, got {context_length!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if not (isinstance(key, str) and re.fullmatch(rf"[1-9]\d{{{KEY_DIGITS - 1}}}", key)):
        raise ValueError(f"key must be a string of {KEY_DIGITS} digits without a leading zero, got {key!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    placed, question, prime, target, vault, others = _needles(variant, key, float(depth))
    fixed = len(_encode(tokenizer, _render(tokenizer, [nd for _, nd in placed], question, prime)))
    per = [len(_encode(tokenizer, " " + s)) for s in FILLER]
    sentences: list[str] = []
    budget = context_length - fixed
    while budget > 0:
        i = len(sentences) % len(FILLER)
        if per[i] > budget:
            break
        sentences.append(FILLER[i])
        budget -= per[i]
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
                                distractors=[nd for _, nd in placed[1:]])
    return NeedlePrompt(ids, text, key, answer_ids, context_length, float(depth), needle_start, ids_sha256(ids),
                        variant, vault, others)


def check_prompt(tokenizer, ids: list[int], needle: str, answer_ids: list[int], question: str = QUESTION,
                 distractors=()) -> int:
    """Check the rules of the module docstring; return the (target) needle's start index.
    ``distractors``: the other needles' texts (multi-needle), each of which must also occur exactly once.

    Raises:
        ValueError: naming the broken rule.
    """
    for other in distractors:
        if len(find_subsequence(ids, _encode(tokenizer, other))) != 1:
            raise ValueError("a distractor needle's token ids do not occur exactly once in the prompt")
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


def build_sanity_prompts(tokenizer, seed: int = 0, include_long: bool = True) -> list[SanityPrompt]:
    """The ``SANITY_USER`` chat prompts (user turn, assistant generation prompt), plus, when
    ``include_long``, the ``SANITY_LONG`` passkey prompt (2K tokens, key ``make_keys(1, seed)[0]``)
    whose continuation runs on past the key over a long cache."""
    out = []
    for name, user in SANITY_USER:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        ids = _encode(tokenizer, text)
        out.append(SanityPrompt(name, ids, ids_sha256(ids)))
    if include_long:
        name, n, depth = SANITY_LONG
        p = build_prompt(tokenizer, n, depth, make_keys(1, seed)[0])
        out.append(SanityPrompt(name, p.input_ids, p.sha256))
    return out
