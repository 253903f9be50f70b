"""Build the text files the quality measurements use, from Debian packages.

Two outputs, from two disjoint sets of packages:

  calib   escha/model/data/calib_en.txt.xz, the default calibration corpus shipped with escha:
          the Python 3.11 documentation (python3.11-doc: tutorial, FAQ, HOWTOs, language
          reference, glossary; PSF License 2.0), the Jargon File 4.4.7 (jargon-text; public
          domain) and Ambrose Bierce's The Devil's Dictionary (dict-devil; public domain).
  kjv     the King James Version of the Bible as plain text (bible-kjv-text, read through the
          `bible` program of bible-kjv; public domain), the evaluation text of bench_llm.py.

    apt-get download python3.11-doc jargon-text dict-devil     # then:
    python benchmarks/corpora.py calib --debs DIR               # DIR holds the three .deb files
    apt-get install bible-kjv && python benchmarks/corpora.py kjv --out kjv.txt

The calibration builder is deterministic for given packages: the corpus can be rebuilt and
compared byte for byte (its README records the package versions and the SHA-256).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "escha", "model", "data", "calib_en.txt.xz")

# -- plain-text clean-up ---------------------------------------------------------------------


def paragraphs(text: str) -> list[list[str]]:
    """Blocks of non-blank lines."""
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line.rstrip())
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def reflow(block: list[str]) -> str:
    """A prose paragraph (every line at one indent) becomes one line; anything else (verse,
    code, tables) keeps its line breaks, dedented."""
    base = min(_indent(line) for line in block)
    if all(_indent(line) == base for line in block):
        return " ".join(line.strip() for line in block)
    return "\n".join(line[base:] for line in block)


# -- reStructuredText (Python documentation) --------------------------------------------------

# Directives whose argument line and body are text a reader sees; every other directive
# (index, toctree, labels, module markers, includes, tables of options...) is dropped.
KEEP_DIRECTIVES = {"note", "warning", "seealso", "versionadded", "versionchanged", "deprecated",
                   "function", "method", "class", "attribute", "data", "exception", "describe",
                   "decorator", "classmethod", "staticmethod", "code-block", "impl-detail",
                   "admonition", "tip", "important", "attention", "caution", "hint", "topic",
                   "sourcecode", "doctest", "opcode", "envvar", "cmdoption", "option", "coroutinefunction",
                   "coroutinemethod", "abstractmethod", "pdbcommand", "glossary"}
VERSION_NOTES = {"versionadded": "New in version", "versionchanged": "Changed in version",
                 "deprecated": "Deprecated since version"}
ADORNMENT = re.compile(r"^\s*([=\-*~^\"#+`:'.])\1{2,}\s*$")
DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
REF = re.compile(r"`([^`]+)`_{1,2}")
LITERAL = re.compile(r"``(.+?)``")
STRONG = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
FOOTNOTE = re.compile(r"\s*\[(?:#\w*|\d+)\]_")
EMPH = re.compile(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")


def _role_text(m: re.Match) -> str:
    t = m.group(1)
    label = re.match(r"^(.*?)\s*<[^>]*>$", t, re.S)
    if label and label.group(1):
        return label.group(1)
    t = t.lstrip("!")
    if t.startswith("~"):
        t = t[1:].rsplit(".", 1)[-1]
    return t


def clean_rst(text: str) -> str:
    """reST source -> readable text: roles, links and literals unwrapped, headings' underlines,
    labels, index entries and comments removed, code blocks kept."""
    lines = text.splitlines()
    out: list[str] = []
    skip_indent: int | None = None  # inside a dropped directive or comment: its indent
    for line in lines:
        if skip_indent is not None:
            if not line.strip() or _indent(line) > skip_indent:
                continue
            skip_indent = None
        if ADORNMENT.match(line):
            continue
        d = DIRECTIVE.match(line)
        if d:
            indent, name, arg = len(d.group(1)), d.group(2).split(":")[-1], d.group(3)
            if name in KEEP_DIRECTIVES:
                if name in VERSION_NOTES:  # rendered as Sphinx renders them
                    out.append(" " * indent + f"{VERSION_NOTES[name]} {arg.split()[0] if arg else ''}.".replace(" .", "."))
                elif arg and name not in ("code-block", "sourcecode", "doctest", "impl-detail"):
                    out.append(" " * indent + arg)
                continue  # the body follows, indented; it is kept (dedented by reflow)
            skip_indent = indent
            continue
        if COMMENT.match(line):
            skip_indent = _indent(line)
            continue
        out.append(line)
    blocks = []
    for block in paragraphs("\n".join(out)):
        base = min(_indent(line) for line in block)
        prose = all(_indent(line) == base for line in block) and not block[0].lstrip().startswith(">>>")
        if prose:
            t = reflow(block)
            for pat, rep in ((ROLE, _role_text), (LINK, r"\1"), (REF, r"\1"), (LITERAL, r"\1"),
                             (STRONG, r"\1"), (EMPH, r"\1")):
                t = pat.sub(rep, t)
            t = FOOTNOTE.sub("", t.replace("\\ ", ""))
            if t.endswith(" ::"):
                t = t[:-3]
            elif t.endswith("::"):
                t = t[:-1]
            if t.strip() in ("", ":"):
                continue
            blocks.append(t)
        else:  # lists, code, tables: markup that code never contains is still unwrapped
            t = "\n".join(line[base:] for line in block)
            if not t.startswith(">>>"):
                for pat, rep in ((ROLE, _role_text), (LINK, r"\1"), (REF, r"\1"), (LITERAL, r"\1")):
                    t = pat.sub(rep, t)
            blocks.append(t)
    return "\n\n".join(blocks)


# -- the three calibration sources ------------------------------------------------------------

PYDOC_PARTS = ("tutorial", "faq", "howto", "reference", "glossary.rst.txt")


def python_docs(root: str) -> list[str]:
    """One document per reST page of the chosen parts, in sorted path order."""
    src = os.path.join(root, "usr/share/doc/python3.11/html/_sources")
    files: list[str] = []
    for part in PYDOC_PARTS:
        p = os.path.join(src, part)
        files += [p] if os.path.isfile(p) else sorted(glob.glob(os.path.join(p, "**", "*.rst.txt"), recursive=True))
    docs = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            t = clean_rst(fh.read().replace("\u00a0", " "))
        if len(t) > 500:
            docs.append(t)
    return docs


def jargon_file(root: str) -> list[str]:
    """Chapters 1-12, the lexicon and Appendix A-C of the Jargon File; the table of contents,
    the list of headwords and the bibliography are left out."""
    with gzip.open(os.path.join(root, "usr/share/doc/jargon-text/jargon.txt.gz"), "rt", encoding="utf-8") as f:
        text = f.read().replace("\u00a0", " ")
    start = text.index("\nChapter 1. ")
    end = text.index("\nBibliography", start)
    body = text[start:end]
    # The lexicon opens with a list of its headwords (one per paragraph): skip it.
    g = body.index("\nGlossary\n")
    blocks = paragraphs(body[g + len("\nGlossary\n"):])
    first = next(i for i, b in enumerate(blocks) if sum(len(x) for x in b) > 200)
    head = [reflow(b) for b in paragraphs(body[:g])]
    entries = [reflow(b) for b in blocks[max(0, first - 2):]]
    return _split_docs(head + entries, 6000)


def devils_dictionary(root: str) -> list[str]:
    """The preface and all entries of The Devil's Dictionary (dictd's database header dropped)."""
    with gzip.open(os.path.join(root, "usr/share/dictd/devil.dict.dz"), "rt", encoding="utf-8", errors="replace") as f:
        text = f.read().replace("\u00a0", " ")
    start = text.index("PREFACE")
    blocks = [reflow(b) for b in paragraphs(text[start:])]
    return _split_docs(blocks, 6000)


def _split_docs(blocks: list[str], size: int) -> list[str]:
    """Consecutive paragraphs grouped into documents of about ``size`` characters."""
    docs, cur, n = [], [], 0
    for b in blocks:
        cur.append(b)
        n += len(b)
        if n >= size:
            docs.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def interleave(sources: list[list[str]]) -> list[str]:
    """Merge document lists so that each source is spread evenly over the result (by position
    as a fraction of its own length): any stretch of the corpus mixes the registers."""
    keyed = []
    for s, docs in enumerate(sources):
        total = sum(len(d) for d in docs)
        pos = 0
        for d in docs:
            keyed.append(((pos + len(d) / 2) / total, s, d))
            pos += len(d)
    return [d for _, _, d in sorted(keyed, key=lambda k: (k[0], k[1]))]


def unpack_deb(deb: str, dest: str) -> None:
    """Extract a .deb's data archive (dpkg-deb where present, else ar + tar by hand)."""
    if shutil.which("dpkg-deb"):
        subprocess.run(["dpkg-deb", "-x", deb, dest], check=True)
        return
    with open(deb, "rb") as f:
        data = f.read()
    i = 8
    while i < len(data):
        name = data[i:i + 16].decode().strip().rstrip("/")
        size = int(data[i + 48:i + 58].decode().strip())
        body = data[i + 60:i + 60 + size]
        if name.startswith("data.tar"):
            with tempfile.NamedTemporaryFile(suffix=name) as t:
                t.write(body)
                t.flush()
                with tarfile.open(t.name) as tar:
                    tar.extractall(dest, filter="data")
            return
        i += 60 + size + (size & 1)
    raise ValueError(f"{deb}: no data archive")


def build_calib(debs: str, out: str) -> dict:
    """Write the calibration corpus from the three .deb files in ``debs``; returns its summary."""
    found = {}
    for pkg in ("python3.11-doc", "jargon-text", "dict-devil"):
        m = sorted(glob.glob(os.path.join(debs, f"{pkg}_*.deb")))
        if not m:
            raise SystemExit(f"corpora.py: error: no {pkg}_*.deb in {debs} (apt-get download {pkg})")
        found[pkg] = m[-1]
    with tempfile.TemporaryDirectory() as tmp:
        for pkg, deb in found.items():
            unpack_deb(deb, os.path.join(tmp, pkg))
        sources = [python_docs(os.path.join(tmp, "python3.11-doc")),
                   jargon_file(os.path.join(tmp, "jargon-text")),
                   devils_dictionary(os.path.join(tmp, "dict-devil"))]
    text = "\n\n".join(interleave(sources)) + "\n"
    raw = text.encode("utf-8")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "wb") as f:
        f.write(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    summary = {"packages": {p: os.path.basename(d) for p, d in found.items()},
               "characters": len(text), "bytes": len(raw), "words": len(text.split()),
               "compressed_bytes": os.path.getsize(out), "sha256": hashlib.sha256(raw).hexdigest(),
               "per_source_characters": [sum(len(d) for d in s) for s in sources]}
    return summary


# -- the evaluation text ----------------------------------------------------------------------

VERSE = re.compile(r"^\s*\d+\s+(.*)$")


def kjv_text(bible: str = "bible") -> str:
    """The whole KJV as plain text: a heading line per chapter ("Genesis 1"), then one line per
    verse without its number, chapters separated by blank lines."""
    if shutil.which(bible) is None:
        raise FileNotFoundError("the `bible` program is missing: apt-get install bible-kjv")
    res = subprocess.run([bible, "-l", "100000", "Genesis 1:1-Revelation 22:21"], capture_output=True,
                         text=True, check=True)
    chapters, cur = [], None
    for line in res.stdout.splitlines():
        if not line.strip():
            continue
        m = VERSE.match(line)
        if m and cur is not None:
            cur.append(m.group(1).strip())
        elif m is None and not line.startswith(" "):
            cur = [line.strip()]
            chapters.append(cur)
        elif cur is not None:  # a continuation line (should not occur with -l 100000)
            cur[-1] += " " + line.strip()
    return "\n\n".join("\n".join(c) for c in chapters) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calib", help="build escha/model/data/calib_en.txt.xz from .deb files")
    c.add_argument("--debs", required=True, help="folder with python3.11-doc, jargon-text, dict-devil .debs")
    c.add_argument("--out", default=CORPUS)
    k = sub.add_parser("kjv", help="write the KJV as plain text (needs the bible-kjv package)")
    k.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "calib":
        s = build_calib(args.debs, args.out)
        for key, v in s.items():
            print(f"{key}: {v}")
    else:
        text = kjv_text()
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}: {len(text):,} characters, {len(text.split()):,} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
