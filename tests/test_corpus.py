"""kvrepro.corpus: the packaged prose loads through `datasets` with no network and matches SOURCES.md (SHA-256,
characters, SmolLM2 token counts), token windows are slices of the tokenized text, bad inputs are refused naming
the parameter, and the Hub corpora call `datasets.load_dataset` with their documented arguments (a stand-in:
no Hub here)."""
import fnmatch
import gzip
import hashlib
import re
import socket
import tomllib

import pytest

from kvrepro import corpus

ROOT = corpus.CORPUS_DIR.parents[2]


def sources_md() -> tuple[dict[str, dict], dict]:
    """Per-text rows of SOURCES.md's table (chars, tokens, sha256) and the pd-books line's figures."""
    md = corpus.SOURCES_MD.read_text(encoding="utf-8")
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and re.fullmatch(r"`[0-9a-f]{64}`", cells[8]):
            rows[cells[0]] = {"chars": int(cells[6].replace(",", "")), "tokens": int(cells[7].replace(",", "")),
                              "sha256": cells[8].strip("`")}
    m = re.search(r"`pd-books`.*?([\d,]+) characters, \*\*([\d,]+) SmolLM2 tokens\*\*,\s+sha256 `([0-9a-f]{64})`",
                  md, re.S)
    assert m, "SOURCES.md lacks the pd-books line"
    pd = {"chars": int(m[1].replace(",", "")), "tokens": int(m[2].replace(",", "")), "sha256": m[3]}
    return rows, pd


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer, loaded as kvrepro.hf.load_smollm2 loads it, without its weights (~5 s instead of
    10-30 s on the 2-core machine)."""
    from transformers import AutoTokenizer
    from kvrepro.hf import smollm2_gguf_path

    directory, name = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def pd_ids(tok):
    """pd-books tokenized here from the gzip files, apart from kvrepro.corpus's loader."""
    text = "\n".join(gzip.decompress(corpus.TEXTS[t].path.read_bytes()).decode("utf-8") for t in corpus.PD_BOOKS_ORDER)
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    assert corpus.token_ids(tok, "pd-books") == ids
    return ids


@pytest.fixture
def no_network(monkeypatch):
    """HF offline variables set, and any socket connection fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:]!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_sources_md_matches_the_registry_and_the_files():
    rows, pd = sources_md()
    assert set(rows) == set(corpus.TEXTS) == set(corpus.PD_BOOKS_ORDER)
    for name, t in corpus.TEXTS.items():
        assert (rows[name]["sha256"], rows[name]["chars"], rows[name]["tokens"]) == (t.sha256, t.chars, t.tokens)
        raw = gzip.decompress(t.path.read_bytes())                  # read here without datasets
        assert hashlib.sha256(raw).hexdigest() == t.sha256, name
        text = raw.decode("utf-8")
        assert len(text) == t.chars and text.endswith("\n") and "\r" not in text
        assert "Project Gutenberg" not in text and "*** START" not in text   # headers and licences stripped
    assert (pd["sha256"], pd["tokens"]) == (corpus.PD_BOOKS_SHA256, corpus.PD_BOOKS_TOKENS)
    assert pd["chars"] == sum(t.chars for t in corpus.TEXTS.values()) + len(corpus.TEXTS) - 1   # "\n" joiners
    assert corpus.DEFAULT_CORPUS == "pd-books" and corpus.CORPORA["pd-books"].kind == "offline"


def test_the_wheel_ships_the_corpus():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = cfg["tool"]["setuptools"]["package-data"]["kvrepro"]
    for path in [t.path for t in corpus.TEXTS.values()] + [corpus.SOURCES_MD]:
        rel = path.relative_to(ROOT / "kvrepro").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
    assert any(d.startswith("datasets") for d in cfg["project"]["optional-dependencies"]["hf"])


def test_offline_corpus_loads_through_datasets_with_no_network(no_network, monkeypatch, tmp_path):
    import datasets

    calls = []
    real = datasets.load_dataset

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    offline_before = datasets.config.HF_HUB_OFFLINE
    rows, pd = sources_md()

    text, prov = corpus.load_text()                                  # the default: pd-books
    assert calls[0][0] == ("text",) and calls[0][1]["sample_by"] == "document"
    assert calls[0][1]["data_files"] == [str(corpus.TEXTS[t].path) for t in corpus.PD_BOOKS_ORDER]
    assert prov["name"] == "pd-books" and prov["kind"] == "offline" and prov["documents"] == 4
    assert prov["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest() == pd["sha256"]
    assert prov["characters"] == len(text) == pd["chars"]
    assert prov["licence"] == "public domain" and "brotli 1.2.1" in prov["source"]
    assert datasets.config.HF_HUB_OFFLINE == offline_before          # the switch is restored

    for name in corpus.TEXTS:                                          # each text by its own name, given cache
        t, p = corpus.load_text(name, cache_dir=str(tmp_path / name))
        assert p["sha256"] == rows[name]["sha256"] and p["characters"] == rows[name]["chars"]
        assert (tmp_path / name).is_dir()
        assert t in text


def test_token_counts_at_least_sources_md(tok, pd_ids):
    rows, pd = sources_md()
    assert len(pd_ids) >= pd["tokens"] >= 300_000
    for name in corpus.TEXTS:
        assert len(corpus.token_ids(tok, name)) >= rows[name]["tokens"], name
    assert not set(pd_ids) & set(tok.all_special_ids)                  # no BOS / EOS anywhere


def test_windows_are_consecutive_slices_of_the_tokenized_text(tok, pd_ids):
    w = corpus.token_windows(tok, "pd-books", 1000, 7)
    assert w == [pd_ids[i * 1000:(i + 1) * 1000] for i in range(7)]
    assert all(type(x) is int for x in w[3])
    ids = corpus.token_ids(tok, "alice")
    over = corpus.token_windows(tok, "alice", 4096, 3, stride=1500)
    assert over == [ids[i * 1500:i * 1500 + 4096] for i in range(3)]
    gaps = corpus.token_windows(tok, "alice", 100, 4, stride=5000)
    assert gaps == [ids[i * 5000:i * 5000 + 100] for i in range(4)]
    # the largest request that fits, and one token more
    n = len(ids)
    last = corpus.token_windows(tok, "alice", n // 2, 2)
    assert last[1] == ids[n // 2:2 * (n // 2)]
    m = n // 2 + 1
    with pytest.raises(ValueError, match=rf"corpus 'alice' has {n} tokens; num_windows=2 x "
                                         rf"window_tokens={m} \(stride {m}\) needs {2 * m}"):
        corpus.token_windows(tok, "alice", m, 2)


@pytest.mark.parametrize("kwargs, param", [
    ({"window_tokens": 0}, "window_tokens"), ({"window_tokens": -5}, "window_tokens"),
    ({"window_tokens": 2.0}, "window_tokens"), ({"window_tokens": True}, "window_tokens"),
    ({"num_windows": 0}, "num_windows"), ({"num_windows": "3"}, "num_windows"),
    ({"stride": 0}, "stride"), ({"stride": 1.5}, "stride"),
])
def test_bad_window_arguments_name_the_parameter(tok, kwargs, param):
    args = {"window_tokens": 128, "num_windows": 2, **kwargs}
    with pytest.raises(ValueError, match=rf"^{param} must be a positive int"):
        corpus.token_windows(tok, "pd-books", **args)


def test_unknown_corpus_lists_the_allowed_names(tok):
    for call in (lambda: corpus.load_text("pg-19"), lambda: corpus.token_windows(tok, "pg-19", 8, 1),
                 lambda: corpus.haystack_sentences("pg-19")):
        with pytest.raises(ValueError, match=r"unknown corpus name='pg-19'; allowed: pd-books, .*pg19, wikitext-103"):
            call()


def test_split_sentences_rules():
    text = ("Mr. Holmes came in. He said, 'Hello!' Then J. R. Kennedy left?\nYes, he\nleft.\n\n"
            "A new paragraph \"Quoted.\" (Bracketed.) end")
    assert corpus.split_sentences(text) == [
        "Mr. Holmes came in.", "He said, 'Hello!'", "Then J. R. Kennedy left?", "Yes, he left.",
        "A new paragraph \"Quoted.\"", "(Bracketed.) end"]


def test_haystack_sentences():
    s = corpus.haystack_sentences()
    assert len(s) > 10_000
    assert s == corpus.haystack_sentences()                            # deterministic
    for x in s:
        assert "\n" not in x and x == x.strip() and "  " not in x
        assert 4 <= len(x.split()) <= 60 and re.search(r"[.!?][\"')\]]*$", x)
        assert not re.search(r"[0-9]", x)
    assert "God saw the light, and saw that it was good." in s
    assert corpus.haystack_sentences(limit=25) == s[:25]
    with_digits = corpus.haystack_sentences("lcet10", allow_digits=True)
    assert any(re.search(r"[0-9]", x) for x in with_digits)
    assert len(with_digits) > len(corpus.haystack_sentences("lcet10"))
    for kwargs, param in (({"min_words": 0}, "min_words"), ({"max_words": -1}, "max_words"),
                          ({"limit": 0}, "limit"), ({"min_words": 9, "max_words": 8}, "min_words")):
        with pytest.raises(ValueError, match=param):
            corpus.haystack_sentences(**kwargs)


@pytest.mark.parametrize("name, args, rows, joined", [
    ("pg19", ("emozilla/pg19", None), ["BOOK ONE\nIt was.", "BOOK TWO"], "BOOK ONE\nIt was.\n\nBOOK TWO"),
    ("wikitext-103", ("Salesforce/wikitext", "wikitext-103-raw-v1"), [" = Title = \n", "", " Text .\n"],
     " = Title = \n Text .\n"),
])
def test_hub_corpora_call_load_dataset_with_their_arguments(monkeypatch, name, args, rows, joined):
    import datasets

    calls = []

    def fake(*a, **kw):
        calls.append((a, kw))
        return datasets.Dataset.from_dict({"text": rows, "other": [0] * len(rows)})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    text, prov = corpus.load_text(name, cache_dir="/tmp/hf-cache")
    assert calls == [(args, {"split": "test", "cache_dir": "/tmp/hf-cache"})]
    assert text == joined
    assert prov == {"name": name, "kind": "hub", "source": prov["source"], "licence": corpus.CORPORA[name].licence,
                    "sha256": hashlib.sha256(joined.encode("utf-8")).hexdigest(), "characters": len(joined),
                    "documents": len(rows)}
    assert args[0] in prov["source"] and "split test" in prov["source"]
    corpus.load_text(name)
    assert calls[1][1]["cache_dir"] is None                            # datasets' own cache by default


def test_hub_failure_names_the_corpus_and_the_offline_default(monkeypatch):
    import datasets

    def unreachable(*a, **kw):
        raise ConnectionError("Couldn't reach 'emozilla/pg19' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(RuntimeError, match=r"corpus 'pg19' could not be loaded from the Hugging Face Hub .*"
                                           r"ConnectionError.*name='pd-books'") as e:
        corpus.load_text("pg19")
    assert isinstance(e.value.__cause__, ConnectionError)
