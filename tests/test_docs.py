"""The documentation matches the repository and stands alone.

- Every file path and every backticked private name (``_name``) that a README, a TUNING.md or a kernel
  file's header mentions exists: a renamed kernel or a moved record fails here, not in a reader's hands.
- No file points outside the repository for what a target or a rule means: no planning documents that
  are not in it, no issue-tracker numbers.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH_LIKE = re.compile(r"^[\w./*<>-]+\.(py|md|sh|txt|json|png|toml|jsonl)$"
                       r"|^(kernels|reference|tests|benchmarks|scripts|examples|constraints|\.ci)/[\w./<>*-]*$")
PRIVATE_NAME = re.compile(r"^(?:[\w.]+\.)?(_[A-Za-z]\w*)(?:\(.*\))?$")


def _tracked(*patterns: str) -> list[Path]:
    """The repository's files (matching ``patterns``): git's list in a checkout, else (a copy of the tree, such as an
    unpacked source archive) every file outside hidden and generated folders."""
    if not (ROOT / ".git").exists():
        return sorted(p for pattern in (patterns or ("*",)) for p in ROOT.rglob(pattern)
                      if p.is_file() and not any(part.startswith((".", "__pycache__")) or part == "cpu-smoke"
                                                 for part in p.relative_to(ROOT).parts))
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def _documents() -> list[Path]:
    docs = [p for p in _tracked("*.md") if "benchmarks/results" not in p.as_posix()]
    return docs + sorted(ROOT.glob("kernels/*/_kernels.py")) + sorted(ROOT.glob("kernels/_common/*.py"))


def _text_of(doc: Path) -> str:
    """A Markdown file whole; a Python file's module docstring (its header)."""
    if doc.suffix == ".md":
        return doc.read_text()
    return ast.get_docstring(ast.parse(doc.read_text())) or ""


@cache
def _python_words() -> frozenset[str]:
    words = set()
    for p in _tracked("*.py"):
        words.update(re.findall(r"\b_\w+", p.read_text()))
    return frozenset(words)


@cache
def _file_names() -> frozenset[str]:
    return frozenset(p.name for p in _tracked())


def _ignored(span: str) -> bool:
    """Whether git ignores ``span`` (a folder the tools write, such as benchmarks/results/cpu-smoke/); outside a
    checkout, whether a path pattern of .gitignore names it."""
    if (ROOT / ".git").exists():  # a folder's pattern (name/) matches a path that is not there only as name/
        return any(subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
                   for path in (span, span.rstrip("/") + "/"))
    patterns = [line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                if "/" in line.strip().rstrip("/") and not line.startswith("#")]
    return any(span.rstrip("/") == pattern.rstrip("/") or span.startswith(pattern) for pattern in patterns)


def _exists(span: str, doc: Path) -> bool:
    if _ignored(span):
        return True
    span = span.split("::")[0].split(":")[0].rstrip("/")
    placeholder = re.compile(r"<[^>]*>|\*|(?<![A-Za-z])[A-Z][A-Z_]+(?![A-Za-z])")  # <gpu>, *, NAME
    if placeholder.search(span):  # a pattern such as results/<gpu>/ or test_*.py: a file it matches, or its prefix
        if any(ROOT.glob(re.sub(r"\*+", "*", placeholder.sub("*", span)))):
            return True
        prefix = re.split(r"[<>*]", span)[0].rstrip("/")
        return not prefix or (ROOT / prefix).exists() or (doc.parent / prefix).exists()
    if (ROOT / span).exists() or (doc.parent / span).exists():
        return True
    return "/" not in span and span in _file_names()  # a bare file name: a record or tool somewhere here


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_private_name_a_document_mentions_exists(doc):
    missing = []
    for span in re.findall(r"`([^`\n]+)`", _text_of(doc)):
        span = span.strip()
        if " " in span or span.startswith(("http", "-", "$", "torch.", "triton.", "tl.", "F.")):
            continue
        name = PRIVATE_NAME.match(span)
        known = name.group(1) in _python_words() if name else not PATH_LIKE.match(span) or _exists(span, doc)
        if not known:
            missing.append(span)
    assert not missing, f"{doc.relative_to(ROOT)} mentions what is not in the repository: {missing}"


# Built from parts so that this file does not match itself.
OUTSIDE_REFERENCES = [
    re.compile("TARGETS" + r"\.md"),
    re.compile("DESIGN" + r"\.md"),
    re.compile(r"\b[Ii]ssue" + r"s?\s+#?\d+"),
    re.compile(r"\bthe extras " + "issue"),
]


def test_no_file_points_outside_the_repository():
    offenders = []
    for path in _tracked():
        if path.suffix not in (".md", ".py", ".sh", ".toml", ".txt", ".cfg") and path.name != "run":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE_REFERENCES):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_the_suite_collects_from_a_copy_of_the_tree_that_is_not_a_git_checkout(tmp_path):
    """A user testing an unpacked source archive (no .git) collects every test: what needs git falls back."""
    import shutil
    import sys

    for source in _tracked():
        if "benchmarks/results" in source.as_posix():
            continue
        target = tmp_path / source.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ tests collected in [\d.]+s", summary), run.stdout[-2000:]


def test_the_top_readme_is_a_short_reference_with_the_calls_first():
    """The top-level README stays a reference a newcomer reads in minutes: at most 150 lines, a Python quick start
    within its first 40 (what the project is, then how to call it); the details live in the family READMEs and
    docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the details to docs/ or a family README"
    head = "\n".join(lines[:40])
    assert "```python" in head and "import kernels" in head, "the quick start must come within the first 40 lines"


CODE_PATH = re.compile(r"(?<![\w/.])((?:kernels|reference|tests|benchmarks|scripts|examples|docs)/[\w./<>*-]*[\w>*])")
SCRIPT_MODULE = re.compile(r"\bscripts\.([a-z_]+)\b")


@pytest.mark.parametrize("source", _tracked("*.py"), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_script_a_code_comment_mentions_exists(source):
    """Comments and docstrings name files (records, tools, kernels) that exist: a removed probe script or a moved
    record fails here."""
    import io
    import tokenize

    text = []
    for token in tokenize.generate_tokens(io.StringIO(source.read_text()).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.startswith(
                ('"""', "'''", 'r"""'))):
            text.append(token.string)
    text = "\n".join(text)
    missing = [span for span in CODE_PATH.findall(text) if not _exists(span.rstrip("."), source)]
    missing += [f"scripts.{name}" for name in SCRIPT_MODULE.findall(text)
                if not (ROOT / "scripts" / f"{name}.py").exists() and name not in ("py", "sh")]
    assert not missing, f"{source.relative_to(ROOT)} mentions what is not in the repository: {sorted(set(missing))}"


#: Each family README is a reference of about 300 lines (the history lives in its TUNING.md).
README_LINES = {"dropout": 300, "layernorm": 300, "attention": 300}
#: A kernel module's header says what it implements, its design, limits and trade-off in about 40 lines.
KERNEL_HEADER_LINES = 40


@pytest.mark.parametrize("family", sorted(README_LINES))
def test_family_readmes_stay_references(family):
    lines = len((ROOT / "kernels" / family / "README.md").read_text().splitlines())
    assert lines <= README_LINES[family], f"kernels/{family}/README.md has {lines} lines: history goes to TUNING.md"


@pytest.mark.parametrize("module", sorted(p for p in ROOT.glob("kernels/*/_*.py") if "@triton.jit" in p.read_text()
                                          or "@gluon.jit" in p.read_text()), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernel_headers_stay_short(module):
    header = ast.get_docstring(ast.parse(module.read_text()), clean=False) or ""
    lines = len(header.splitlines())
    assert lines <= KERNEL_HEADER_LINES, f"{module.relative_to(ROOT)}'s header has {lines} lines: history to TUNING.md"
