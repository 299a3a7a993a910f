"""Sessions: ``tests`` (default), ``lint`` (default) and ``bench``.

Pick one family by naming it first in the posargs; the rest goes to pytest:

    nox -s tests                      # every family (interpreter on a machine without a GPU)
    nox -s tests -- dropout           # tests/test_dropout*.py only
    nox -s tests -- dropout -k seed   # ... and pytest's -k
    nox -s bench -- layernorm         # benchmarks/bench_layernorm.py only
    nox -s bench -- transformers      # benchmarks/bench_transformers.py: whole transformers models
    nox -s bench -- host              # benchmarks/bench_host.py: host time per eager call, ours and torch's

Without a GPU the sessions install ``torch==2.13.0`` (CPU build) and ``triton==3.6.0`` from
``constraints/cpu.txt``, so no multi-GB CUDA build is pulled, and the kernels run under the Triton
interpreter. With a GPU the session's virtualenv sees the user's site packages and uses the torch and
triton already installed there.
"""

from __future__ import annotations

import glob
import shutil
import subprocess

import nox

nox.options.sessions = ["tests", "lint"]

FAMILIES = ("dropout", "layernorm", "attention")


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "GPU" in done.stdout


HAS_GPU = _has_gpu()
# With a GPU, reuse the environment's CUDA torch/triton instead of downloading them again.
VENV_PARAMS = ["--system-site-packages"] if HAS_GPU else []


def _install(session: nox.Session, extra: str) -> None:
    if HAS_GPU:
        session.install("-e", f".[{extra}]")
    else:
        session.install("-c", "constraints/cpu.txt", "-e", f".[{extra}]")


TEST_EXTRAS = "test,transformers"  # the transformers integration's tests run with the rest


def _targets(posargs: list[str], folder: str, pattern: str) -> tuple[list[str], list[str]]:
    """Split posargs into the files of a named family or suite (if the first posarg names one: a kernel family, or
    any NAME of a ``tests/test_NAME*.py`` / ``benchmarks/bench_NAME*.py``, such as transformers) and pytest args."""
    if posargs and posargs[0].isidentifier():
        name, rest = posargs[0], posargs[1:]
        files = sorted(glob.glob(f"{folder}/{pattern.format(family=name)}"))
        if files:
            return files, rest
        if name in FAMILIES:
            raise ValueError(f"no {folder} files for family {name!r}")
    return [folder], posargs


@nox.session(venv_params=VENV_PARAMS)
def tests(session: nox.Session) -> None:
    """Run the test suite (CUDA with a GPU, else the Triton interpreter). Posargs: [family] [pytest args]."""
    _install(session, TEST_EXTRAS)
    files, args = _targets(session.posargs, "tests", "test_{family}*.py")
    session.run("python", "-m", "pytest", *files, *args)


@nox.session(venv_params=VENV_PARAMS)
def bench(session: nox.Session) -> None:
    """Run the benchmarks, writing benchmarks/results/<gpu>/ (smoke mode without a GPU).

    Posargs: [family] [pytest args]."""
    _install(session, "bench,transformers")
    files, args = _targets(session.posargs, "benchmarks", "bench_{family}*.py")
    session.run("python", "-m", "pytest", *files, *args)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff over the whole repository."""
    session.install("ruff==0.17.6")  # pinned: a newer ruff may add rules under the selected prefixes
    session.run("ruff", "check", ".", *session.posargs)
