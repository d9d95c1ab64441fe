"""The real packages tasks are synthesized from, and their sources on the host.

Each package is pinned to one sdist on PyPI by version and sha256. `agentrl sandbox build`
downloads it once (`pip download --no-binary :all: --no-deps`), checks the hash and unpacks
it into the cache; nothing is fetched at run time. From the unpacked sdist two trees are
derived:

- `source/`: the package as the agent sees it, tests removed, laid out so that the workspace
  root is importable (`src/` layouts are flattened: `/workspace/semver/...`);
- `tests/`: the package's own test suite, the hidden tests of every task of that package.

Why these four: pure Python, no dependencies, suites that run in about a second or a few
with nothing but the base image's pytest 7.2 and python 3.11, and four different kinds of
code (functional utilities, string inflection, text parsing, version data model).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackageSpec:
    """One pinned sdist and how to split it into workspace source and hidden tests."""

    name: str
    """Short name used in task ids, image tags and the CLI (`--packages toolz,parse`)."""
    dist: str
    """The distribution's name on PyPI."""
    version: str
    sha256: str
    """Hash of the sdist; a download with another hash is refused."""
    kind: str
    """What sort of code it is, for reports."""
    sources: tuple[tuple[str, str], ...]
    """(path in the sdist, path in the workspace) for every source tree the workspace gets."""
    tests: tuple[tuple[str, str], ...]
    """(path in the sdist, path under the hidden tests root)."""
    exclude: tuple[str, ...] = ()
    """Workspace paths removed after copying (test folders that live inside the package)."""
    targets: tuple[str, ...] = ()
    """Workspace modules whose functions may be mutated (others are only imported)."""

    @property
    def image(self) -> str:
        return f"agentrl/repair-{self.name}:latest"

    @property
    def sdist_stem(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}"

    @property
    def source_dir_in_image(self) -> str:
        return f"/opt/src/{self.name}"


PACKAGES: dict[str, PackageSpec] = {
    spec.name: spec
    for spec in (
        PackageSpec(
            name="toolz",
            dist="toolz",
            version="1.2.0",
            sha256="9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            kind="functional utilities (iterators, dicts, function composition)",
            sources=(("toolz", "toolz"), ("tlz", "tlz")),
            # toolz ships its tests inside the package; toolz.sandbox's own tests are left out
            # (experimental code, not a mutation target), the package itself stays importable.
            tests=(("toolz/tests", "tests"),),
            exclude=("toolz/tests", "toolz/sandbox/tests"),
            targets=("toolz/itertoolz.py", "toolz/functoolz.py", "toolz/dicttoolz.py", "toolz/recipes.py"),
        ),
        PackageSpec(
            name="inflection",
            dist="inflection",
            version="0.5.1",
            sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
            kind="string inflection (camelize, pluralize, ordinals)",
            sources=(("inflection", "inflection"),),
            tests=(("test_inflection.py", "test_inflection.py"),),
            targets=("inflection/__init__.py",),
        ),
        PackageSpec(
            name="parse",
            dist="parse",
            version="1.22.4",
            sha256="706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
            kind="text parsing (the reverse of str.format)",
            sources=(("parse", "parse"),),
            tests=(("tests", "."),),
            targets=("parse/__init__.py",),
        ),
        PackageSpec(
            name="semver",
            dist="semver",
            version="3.1.1",
            sha256="149b26cabada6f63212f97e94505d21578cb1d280cf714827f328d5e70765fea",
            kind="semantic-version data model (parse, compare, bump)",
            sources=(("src/semver", "semver"),),
            tests=(("tests", "."),),
            targets=("semver/version.py", "semver/_deprecated.py", "semver/cli.py"),
        ),
    )
}

DEFAULT_PACKAGES: tuple[str, ...] = ("toolz", "inflection", "parse", "semver")


def cache_root() -> Path:
    """`$AGENTRL_PYTHON_REPAIR_CACHE`, else `$XDG_CACHE_HOME/agentrl/python-repair` (default `~/.cache/...`)."""
    explicit = os.environ.get("AGENTRL_PYTHON_REPAIR_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentrl" / "python-repair"


def get_spec(name: str) -> PackageSpec:
    if name not in PACKAGES:
        raise KeyError(f"unknown python-repair package {name!r}; known packages: {', '.join(PACKAGES)}")
    return PACKAGES[name]


def _log(msg: str) -> None:
    print(f"[python-repair] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_sdist(spec: PackageSpec, *, root: Path | None = None) -> Path:
    """The pinned sdist in the cache, downloaded from the package index on first need."""
    sdists = (root or cache_root()) / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    for candidate in sdists.glob(f"{spec.sdist_stem}.*"):
        if _sha256(candidate) == spec.sha256:
            return candidate
    with tempfile.TemporaryDirectory(prefix="agentrl-sdist-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--quiet",
            "--dest",
            tmp,
            f"{spec.dist}=={spec.version}",
        ]
        _log(f"downloading {spec.dist}=={spec.version} (sdist)")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".zip"))]
        if proc.returncode != 0 or not got:
            raise RuntimeError(
                f"could not download the sdist of {spec.dist}=={spec.version} with pip "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}\n"
                "The package index must be reachable when images are built (`agentrl sandbox build`)."
            )
        digest = _sha256(got[0])
        if digest != spec.sha256:
            raise RuntimeError(
                f"{got[0].name} has sha256 {digest}, expected {spec.sha256}: the index serves a "
                "different file than the one this package is pinned to; refusing to use it"
            )
        target = sdists / got[0].name
        shutil.move(str(got[0]), target)
        return target


def unpacked(spec: PackageSpec, *, root: Path | None = None, download: bool = True) -> Path:
    """The package's `source/` and `tests/` trees in the cache (see the module docstring)."""
    root = root or cache_root()
    out = root / "packages" / f"{spec.name}-{spec.version}"
    marker = out / ".complete"
    if marker.is_file() and marker.read_text().strip() == spec.sha256:
        return out
    if not download:
        raise FileNotFoundError(
            f"the sources of {spec.dist}=={spec.version} are not in {out}; build the images first with "
            "`agentrl sandbox build` (it downloads the pinned sdists)"
        )
    sdist = download_sdist(spec, root=root)
    with tempfile.TemporaryDirectory(prefix="agentrl-unpack-", dir=root) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        top = Path(tmp) / spec.sdist_stem
        if not top.is_dir():
            (top,) = [p for p in Path(tmp).iterdir() if p.is_dir()]
        staged = Path(tmp) / "out"
        for src, dst in spec.sources:
            _copy(top / src, staged / "source" / dst, what=f"source {src!r}", spec=spec)
        for rel in spec.exclude:
            shutil.rmtree(staged / "source" / rel, ignore_errors=True)
        for src, dst in spec.tests:
            _copy(top / src, staged / "tests" / dst, what=f"tests {src!r}", spec=spec)
        for junk in staged.rglob("__pycache__"):
            shutil.rmtree(junk, ignore_errors=True)
        for target in spec.targets:
            if not (staged / "source" / target).is_file():
                raise RuntimeError(f"{spec.name}: mutation target {target} is not in the sdist's sources")
        (staged / ".complete").write_text(spec.sha256 + "\n")
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), out)
    return out


def _copy(src: Path, dst: Path, *, what: str, spec: PackageSpec) -> None:
    if not src.exists():
        raise RuntimeError(
            f"{spec.dist} {spec.version}: the sdist has no {what}; the PackageSpec does not match the sdist"
        )
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def source_dir(spec: PackageSpec) -> Path:
    return unpacked(spec, download=False) / "source"


def tests_dir(spec: PackageSpec) -> Path:
    return unpacked(spec, download=False) / "tests"
