"""Rebuild the offline test assets: tests/assets/c4_test and tests/assets/tokenizer.

The corpus is the English prose of the Python 3.11 documentation (PSF License),
read from the reStructuredText sources that Debian's python3.11-doc package
installs. Markup, code samples, tables and other non-prose fragments are
dropped; the remaining paragraphs are grouped into C4-style JSON-lines
documents. A 2000-token byte-level BPE tokenizer is then trained on that corpus.

Usage, from the repository root:

    apt-get install python3.11-doc        # provides the documentation sources
    .venv/bin/python scripts/build_test_assets.py

Options: --doc-dir (where the *.rst.txt sources live), --out-dir (default
tests/assets), --max-chars (corpus size cap). The output is byte-for-byte
identical when rerun against the same python3.11-doc and tokenizers versions;
tests/assets/c4_test/README.md records the versions the committed copy used.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DEFAULT_DOC_DIR = "/usr/share/doc/python3.11/html/_sources"
# Tutorial-like sections first, so the size cap trims reference material.
SECTIONS = ["tutorial", "faq", "howto", "glossary.rst.txt", "using", "extending",
            "reference", "whatsnew", "library", "c-api"]
VOCAB_SIZE = 2000
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MIN_DOC, MAX_DOC = 300, 3000

# Directives whose indented body is prose (API descriptions, admonitions).
# Every other directive, and every comment or link target, is dropped whole.
KEEP_BODY = set("""
    method function attribute data class exception decorator decoratormethod
    coroutinemethod coroutinefunction classmethod staticmethod abstractmethod
    awaitablefunction describe object opcode cmdoption envvar pdbcommand note
    seealso warning deprecated deprecated-removed impl-detail topic sidebar
    important caution tip hint glossary epigraph admonition c:function
    c:member c:type c:var c:macro c:struct""".split())
DIRECTIVE = re.compile(r"^(\s*)\.\.(?:\s+([\w:-]+)::|\s|$)")
HEADING = re.compile(r"^([=\-~^\"'*+#`.:_])\1{2,}\s*$")
BULLET = re.compile(r"^(?:[*+-]|#\.|\d+\.|\(\d+\))\s+")
STOPWORDS = {"the", "a", "an", "is", "are", "to", "of", "and", "in", "that",
             "it", "this", "be", "for", "with", "as", "or", "can", "not"}


def indent_of(line):
    return len(line) - len(line.lstrip(" "))


def skip_block(lines, i, base):
    """Index of the first line after the block indented deeper than base."""
    while i < len(lines) and (not lines[i].strip() or indent_of(lines[i]) > base):
        i += 1
    return i


def blocks(text):
    """Yield ("para", lines) items, and ("break",) at titles and directives."""
    lines = text.expandtabs(8).splitlines()
    para, para_indent, i = [], 0, 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if para and (not stripped or indent_of(line) != para_indent):
            yield ("para", para)
            literal, para = para[-1].endswith("::"), []
            if literal:
                # A paragraph ending in "::" introduces an indented literal block.
                j = i
                while j < len(lines) and not lines[j].strip():
                    j += 1
                if j < len(lines) and indent_of(lines[j]) > para_indent:
                    i = skip_block(lines, j, para_indent)
                    continue
        if not stripped:
            i += 1
            continue
        m = DIRECTIVE.match(line)
        if m:
            base = len(m.group(1))
            i += 1
            if m.group(2) in KEEP_BODY:
                # Drop the signature, its continuation lines and options.
                while i < len(lines) and lines[i].strip() and indent_of(lines[i]) > base:
                    i += 1
            else:
                i = skip_block(lines, i, base)
            yield ("break",)
            continue
        if HEADING.match(stripped) or (
                not para and HEADING.match(nxt) and len(nxt) >= len(stripped)):
            # A transition, a title's overline, or a title and its underline.
            i += 1 if HEADING.match(stripped) else 2
            yield ("break",)
            continue
        if stripped.startswith((">>>", "+-", "|", "==")) or (
                stripped.startswith(":") and not para):
            # Doctest, grid table, line block, simple table or field list.
            while i < len(lines) and lines[i].strip():
                i += 1
            continue
        bullet = BULLET.match(stripped)
        if bullet:
            if para:
                yield ("para", para)
            para = [stripped[bullet.end():]]
            para_indent = indent_of(line) + bullet.end()
            i += 1
            continue
        if not para:
            para_indent = indent_of(line)
        para.append(stripped)
        i += 1
    if para:
        yield ("para", para)


INLINE = [
    (re.compile(r":[\w:-]+:`~?!?([^`<]*?)\s*<[^`]*>`"), r"\1"),      # :ref:`text <t>`
    (re.compile(r":(pep|rfc):`(\d+)`"), lambda m: f"{m[1].upper()} {m[2]}"),
    (re.compile(r":[\w:-]+:`~[\w.]*?\.?(\w+(?:\(\))?)`"), r"\1"),   # :func:`~a.b`
    (re.compile(r":[\w:-]+:`!?([^`]*)`"), r"\1"),                   # :role:`x`
    (re.compile(r"``([^`]+)``"), r"\1"),
    (re.compile(r"`([^`<]*?)\s*<[^`]*>`__?"), r"\1"),               # link
    (re.compile(r"`([^`]+)`_{0,2}"), r"\1"),
    (re.compile(r"\s*\[(?:#\w*|\d+|\*)\]_"), ""),                   # footnote ref
    (re.compile(r"\*\*([^*]+)\*\*"), r"\1"),
    (re.compile(r"(?<![\w*])\*([^\s*](?:[^*]*[^\s*])?)\*(?![\w*])"), r"\1"),
    (re.compile(r"\|(\w+)\|"), r"\1"),
    (re.compile(r"\\ "), ""),                                     # escaped space
    (re.compile(r"\\([*_`|\\])"), r"\1"),
    (re.compile(r"\s+---\s+|---"), " \u2014 "),
    (re.compile(r"\s+"), " "),
]


def clean(lines):
    text = " ".join(lines)
    if text.endswith("::"):
        # reST renders "text::" as "text:" and drops a detached " ::".
        text = text[:-3] if text.endswith(" ::") else text[:-1]
    for pattern, repl in INLINE:
        text = pattern.sub(repl, text)
    return text.strip()


def is_prose(text):
    words = text.split()
    if len(words) < 8 or len(text) > MAX_DOC or text[-1] not in ".!?:)\"'":
        return False
    chars = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    symbols = sum(c in "{}[]()=<>_\\|#@$;`%~^*/" for c in chars)
    plain = sum(w.strip(".,;:!?\"'()").isalpha() and w.islower() for w in words)
    return (letters >= 0.78 * len(chars) and symbols <= 0.03 * len(chars)
            and plain >= 0.55 * len(words) and len(chars) / len(words) <= 9
            and any(w.lower() in STOPWORDS for w in words)
            and ".." not in text[:3] and "::" not in text)


def documents(text):
    """Group the prose paragraphs of one file into documents."""
    doc, size = [], 0
    for item in blocks(text):
        if item[0] == "para":
            para = clean(item[1])
            if not is_prose(para):
                continue
            if doc and size + len(para) > MAX_DOC:
                yield "\n".join(doc)
                doc, size = [], 0
            doc.append(para)
            size += len(para) + 1
        elif size >= MIN_DOC:
            yield "\n".join(doc)
            doc, size = [], 0
    if size >= MIN_DOC:
        yield "\n".join(doc)


def source_files(doc_dir):
    for section in SECTIONS:
        path = Path(doc_dir, section)
        yield from [path] if path.is_file() else sorted(path.rglob("*.rst.txt"))


def write(path, text):
    Path(path).write_text(text, encoding="utf-8", newline="\n")


def package_version(name):
    try:
        return subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_corpus(doc_dir, out_dir, max_chars):
    os.makedirs(out_dir, exist_ok=True)
    version = package_version("python3.11-doc")
    texts, lines, total = [], [], 0
    for path in source_files(doc_dir):
        if total >= max_chars:
            break
        rel = path.relative_to(doc_dir).as_posix().removesuffix(".txt")
        for text in documents(path.read_text(encoding="utf-8")):
            source = f"python3.11-doc {version}: {rel}"
            # ensure_ascii keeps the file ASCII; other characters become \uXXXX.
            lines.append(json.dumps({"text": text, "source": source}, ensure_ascii=True))
            texts.append(text)
            total += len(text)
    write(os.path.join(out_dir, "data.json"), "\n".join(lines) + "\n")
    # The PSF License asks that its text travel with derivative works.
    shutil.copyfile(os.path.join(doc_dir, "license.rst.txt"), os.path.join(out_dir, "LICENSE"))
    print(f"corpus: {len(texts)} documents, {total} characters, python3.11-doc {version}")
    return texts


def build_tokenizer(texts, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    write(os.path.join(out_dir, "tokenizer.json"), tok.to_str(pretty=True) + "\n")
    special = {"lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True}
    # torchtitan's HuggingFaceTokenizer finds BOS/EOS through these keys.
    config = {"added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, **special}
                                       for t in (BOS, EOS)},
              "bos_token": BOS, "eos_token": EOS, "clean_up_tokenization_spaces": False,
              "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    write(os.path.join(out_dir, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")
    print(f"tokenizer: vocab {tok.get_vocab_size()}, "
          f"bos {tok.token_to_id(BOS)}, eos {tok.token_to_id(EOS)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-dir", default=DEFAULT_DOC_DIR)
    parser.add_argument("--out-dir", default=os.path.join("tests", "assets"))
    parser.add_argument("--max-chars", type=int, default=2_800_000)
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.doc_dir, "tutorial", "index.rst.txt")):
        parser.error(f"no Python documentation sources in {args.doc_dir}; "
                     "install them with: apt-get install python3.11-doc")
    texts = build_corpus(args.doc_dir, os.path.join(args.out_dir, "c4_test"), args.max_chars)
    build_tokenizer(texts, os.path.join(args.out_dir, "tokenizer"))


if __name__ == "__main__":
    main()
