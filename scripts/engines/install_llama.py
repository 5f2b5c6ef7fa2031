"""Build llama.cpp's `llama-server` from source into a project-local folder,
for `make test-engines`.

Debian bookworm has no llama.cpp package, and these machines reach package
registries only, so the source comes from the PyPI sdist of
`llama-cpp-python`, which vendors llama.cpp (`vendor/llama.cpp`). The sdist
file is fetched from PyPI's simple index and checked against the pinned
SHA-256 (`pip download --no-binary` would run the sdist's build backend,
which tries to build cmake from source).

Build: Debian's cmake, static, AVX2/FMA/F16C without `-march=native` (the
binary runs on any x86-64 with AVX2), no tests, no examples, no OpenSSL,
and the web UI off: with the prebuilt-UI option on, the build downloads.
On 2 cores this takes 15-20 minutes; the binary is cached under
`.tools/llama.cpp-<version>/` and reused while the version is unchanged.

Usage: python scripts/engines/install_llama.py TOOLS_DIR VERSION
(VERSION: a llama-cpp-python release whose SHA-256 is pinned below).
Prints the path of `llama-server` on its last line.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

# The sdists this script will build, by version (PyPI's published digests).
PINNED = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}
INDEX = "https://pypi.org/simple/llama-cpp-python/"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DBUILD_SHARED_LIBS=OFF",
]


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def ensure_cmake() -> None:
    if shutil.which("cmake"):
        return
    if os.geteuid() != 0:
        raise SystemExit("cmake is missing: run as root, or: sudo apt-get install -y cmake")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "cmake"], env=env, stdout=subprocess.DEVNULL)


def fetch(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def with_retries(get, attempts: int = 3):
    """A download over CI's shared network: a broken-off read is tried again."""
    for attempt in range(1, attempts + 1):
        try:
            return get()
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, IncompleteRead
            if attempt == attempts:
                raise
            print(f"download failed ({e}), attempt {attempt} of {attempts}; again in {15 * attempt} s", flush=True)
            time.sleep(15 * attempt)


def fetch_sdist(dest: Path, version: str) -> Path:
    sha = PINNED[version]
    name = f"llama_cpp_python-{version}.tar.gz"
    path = dest / name
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        page = with_retries(lambda: fetch(INDEX, 60)).decode()
        m = re.search(r'href="([^"#]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
        if not m:
            raise SystemExit(f"{name} is not on {INDEX}")
        if m.group(2) != sha:
            raise SystemExit(f"{name}: the index's sha256 {m.group(2)} is not the pinned {sha}")
        print(f"downloading {m.group(1)}", flush=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(with_retries(lambda: fetch(m.group(1), 300)))
        got = hashlib.sha256(tmp.read_bytes()).hexdigest()
        if got != sha:
            tmp.unlink()
            raise SystemExit(f"{name}: sha256 {got}, pinned {sha}")
        tmp.rename(path)
    return path


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    version = sys.argv[2]
    if version not in PINNED:
        raise SystemExit(f"llama-cpp-python {version}: no pinned SHA-256 (known: {', '.join(PINNED)})")
    root = Path(sys.argv[1]).resolve() / f"llama.cpp-{version}"
    server = root / "bin" / "llama-server"
    if server.exists():
        print(server)
        return 0
    started = time.monotonic()
    ensure_cmake()
    root.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(root, version)
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(sdist) as t:
            prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
            members = []
            for m in t.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            t.extractall(src, members=members, filter="data")
    build = root / "build"
    run(["cmake", "-S", str(src), "-B", str(build)] + CMAKE_FLAGS)
    run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", server)
    print(f"llama-server built in {time.monotonic() - started:.0f} s", flush=True)
    print(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
