"""The OCI artifacts of `make oci`, checked with real tools.

1. Reproducible: the builder run again on the recorded inputs writes the same
   bytes (every blob, manifest, index) as `make oci` did.
2. A real registry (Debian's docker-registry, started here on 127.0.0.1 with
   a temporary storage directory) takes both Wasm variants and the collector
   image from skopeo, and gives them back: same manifest digests, the media
   types Istio's and Envoy Gateway's fetchers expect, the layer counts, and
   wasm bytes equal to the built file (sha256).
3. Envoy (1.40) loads the pulled module of each variant and routes a request
   with it; the ingest role of the same module takes a snapshot.
4. The collector image: its config and layer match oci/collector/Dockerfile's
   last stage, and the static binary it holds runs (--help).

Needs `make oci` (target/oci), skopeo and docker-registry (`make oci-tools`).
They skip when missing, and fail instead with KVROUTE_REQUIRE_DEPLOY=1 (as
`make test` sets).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import yaml

import harness

OCI_DIR = Path(os.environ.get("KVROUTE_OCI_DIR", harness.REPO_ROOT / "target" / "oci"))
OCI_TOOL = Path(os.environ.get("KVROUTE_OCI_TOOL", harness.REPO_ROOT / "target" / "release" / "kvroute-oci"))
DOCKERFILE = harness.REPO_ROOT / "oci" / "collector" / "Dockerfile"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
WASM_CONFIG = "application/vnd.module.wasm.config.v1+json"
WASM_LAYER = "application/vnd.module.wasm.content.layer.v1+wasm"
VARIANT = "module.wasm.image/variant"
A = "org.opencontainers.image."


def need(ok: bool, reason: str) -> None:
    if not ok:
        if os.environ.get("KVROUTE_REQUIRE_DEPLOY") == "1":
            pytest.fail(reason + " (KVROUTE_REQUIRE_DEPLOY=1)")
        pytest.skip(reason)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def repo_path(p: str) -> Path:
    """A path from build-info.json (relative to the repository root, where make runs)."""
    path = Path(p)
    return path if path.is_absolute() else harness.REPO_ROOT / path


@pytest.fixture(scope="module")
def build_info() -> dict:
    path = OCI_DIR / "build-info.json"
    need(path.is_file(), f"{path} missing: run `make oci`")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def built_wasm(build_info) -> bytes:
    data = repo_path(build_info["inputs"]["wasm"]).read_bytes()
    assert sha256(data) == build_info["inputs"]["wasmSha256"], "the wasm changed since `make oci`: run it again"
    return data


# ----------------------------------------------------------- layout reading


class Layout:
    """An OCI image layout on disk (as written by kvroute-oci or skopeo)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.index = json.loads((self.path / "index.json").read_text())

    def blob(self, digest: str) -> bytes:
        algo, hexd = digest.split(":", 1)
        data = (self.path / "blobs" / algo / hexd).read_bytes()
        assert sha256(data) == hexd, f"blob {digest} does not match its digest"
        return data

    def manifest_descriptor(self, tag: str) -> dict:
        found = [m for m in self.index["manifests"] if m.get("annotations", {}).get(A + "ref.name") == tag]
        assert len(found) == 1, self.index
        return found[0]

    def manifest(self, tag: str) -> tuple[str, dict, bytes]:
        desc = self.manifest_descriptor(tag)
        raw = self.blob(desc["digest"])
        assert len(raw) == desc["size"]
        return desc["digest"], json.loads(raw), raw


def tar_members(layer_gz: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer_gz)), mode="r:") as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            out.append((m, f.read() if f else b""))
    return out


# ----------------------------------------------------------- reproducible


def test_layouts_are_reproducible(build_info, tmp_path: Path):
    """Same inputs, same bytes: a second build equals `make oci`'s, file for file."""
    need(OCI_TOOL.is_file(), f"{OCI_TOOL} missing: run `make oci`")
    i = build_info["inputs"]
    cmd = [
        str(OCI_TOOL), "--wasm", i["wasm"], "--out", str(tmp_path),
        "--version", i["version"], "--revision", i["revision"], "--source", i["source"],
        "--source-date-epoch", str(i["sourceDateEpoch"]),
    ]
    if i.get("collector"):
        cmd += ["--collector", i["collector"], "--collector-arch", i["collectorArch"]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=harness.REPO_ROOT)
    assert result.returncode == 0, result.stderr
    for name in ("wasm", "compat", "collector"):
        if name not in build_info:
            continue
        first = repo_path(build_info[name]["layout"])
        second = tmp_path / first.name
        files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
        for rel in files:
            assert (first / rel).read_bytes() == (second / rel).read_bytes(), f"{name}: {rel} differs"
    again = json.loads((tmp_path / "build-info.json").read_text())
    for name in ("wasm", "compat", "collector"):
        if name in build_info:
            assert again[name]["manifestDigest"] == build_info[name]["manifestDigest"]


def test_created_and_revision_come_from_the_inputs(build_info):
    i = build_info["inputs"]
    _, manifest, _ = Layout(OCI_DIR / "kvroute-wasm").manifest(i["version"])
    ann = manifest["annotations"]
    assert ann[A + "created"] == i["created"]
    assert ann[A + "revision"] == i["revision"]
    assert ann[A + "version"] == i["version"]
    assert ann[A + "source"] == i["source"]
    assert ann[A + "licenses"] == "Apache-2.0"


# ---------------------------------------------------------------- registry


class Registry:
    """Debian's docker-registry (distribution 2.8) on 127.0.0.1, storage in a temp dir."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = harness.free_ports(1)[0]
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        return f"{harness.LOCALHOST}:{self.port}"

    def start(self) -> "Registry":
        config = self.workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.workdir / 'storage'}\n"
            f"http:\n  addr: {self.host}\n"
        )
        log = open(self.workdir / "registry.log", "wb")
        try:
            self.proc = subprocess.Popen(
                [shutil.which("docker-registry"), "serve", str(config)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        harness.wait_for_port(self.port, 15, self.proc)
        status, _ = harness.http_get(f"http://{self.host}/v2/", timeout=5)
        assert status == 200, "registry /v2/ did not answer 200"
        return self

    def stop(self) -> None:
        harness.stop_process(self.proc)


def skopeo(*args: str, timeout: float = 180) -> str:
    result = subprocess.run(["skopeo", *args], capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"skopeo {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def registry(build_info):
    need(shutil.which("skopeo") is not None, "skopeo not installed: run `make oci-tools`")
    need(shutil.which("docker-registry") is not None, "docker-registry not installed: run `make oci-tools`")
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-registry-"))
    reg = Registry(workdir)
    try:
        reg.start()
        yield reg
    finally:
        reg.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# (layout dir, repository:tag suffix) of each image pushed
IMAGES = {
    "wasm": ("kvroute-wasm", "kvroute/kvroute", ""),
    "compat": ("kvroute-compat", "kvroute/kvroute", "-compat"),
    "collector": ("kvroute-collector", "kvroute/kvroute-collector", ""),
}


@pytest.fixture(scope="module")
def pulled(build_info, registry) -> dict[str, tuple[Layout, str]]:
    """Push each layout with skopeo, pull it back into a fresh layout."""
    version = build_info["inputs"]["version"]
    out: dict[str, tuple[Layout, str]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-pulled-"))
    try:
        for name, (layout_dir, repo, suffix) in IMAGES.items():
            if name not in build_info:
                continue
            ref = f"docker://{registry.host}/{repo}:{version}{suffix}"
            skopeo("copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
                   f"oci:{OCI_DIR / layout_dir}:{version}", ref)
            raw = skopeo("inspect", "--raw", "--tls-verify=false", ref)
            # The registry serves the manifest we built, byte for byte.
            assert "sha256:" + sha256(raw.encode()) == build_info[name]["manifestDigest"], name
            dest = workdir / name
            skopeo("copy", "--quiet", "--preserve-digests", "--src-tls-verify=false", ref, f"oci:{dest}:{version}")
            out[name] = (Layout(dest), version)
        yield out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_wasm_variant_pulled_back(pulled, build_info, built_wasm):
    layout, tag = pulled["wasm"]
    digest, m, _ = layout.manifest(tag)
    assert digest == build_info["wasm"]["manifestDigest"]
    assert m["schemaVersion"] == 2 and m["mediaType"] == OCI_MANIFEST
    assert m["config"]["mediaType"] == WASM_CONFIG
    # Exactly two layers: the runtime config JSON and the raw wasm.
    assert [l["mediaType"] for l in m["layers"]] == [WASM_CONFIG, WASM_LAYER]
    runtime = json.loads(layout.blob(m["layers"][0]["digest"]))
    assert runtime == {"type": "envoy_proxy", "abiVersions": ["proxy_abi_version_0_2_1"],
                       "config": {"rootIds": ["kvroute"]}}
    assert layout.blob(m["config"]["digest"]) == layout.blob(m["layers"][0]["digest"])
    wasm = layout.blob(m["layers"][1]["digest"])
    assert m["layers"][1]["digest"] == "sha256:" + sha256(built_wasm)
    assert wasm == built_wasm
    assert m["layers"][1]["annotations"][A + "title"] == "plugin.wasm"
    for key in ("version", "revision", "source", "created"):
        assert m["annotations"][A + key] == build_info["inputs"][key]


def test_compat_variant_pulled_back(pulled, build_info, built_wasm):
    layout, tag = pulled["compat"]
    digest, m, _ = layout.manifest(tag)
    assert digest == build_info["compat"]["manifestDigest"]
    assert m["mediaType"] == OCI_MANIFEST
    assert m["annotations"][VARIANT] == "compat"
    assert m["config"]["mediaType"] == OCI_CONFIG
    assert [l["mediaType"] for l in m["layers"]] == [OCI_LAYER_GZIP]
    layer = layout.blob(m["layers"][0]["digest"])
    # gzip header: no name, mtime 0, OS 255.
    assert layer[:4] == b"\x1f\x8b\x08\x00" and layer[4:8] == b"\0\0\0\0" and layer[9] == 255
    members = tar_members(layer)
    assert [mi.name for mi, _ in members] == ["plugin.wasm", "runtime-config.json"]
    epoch = build_info["inputs"]["sourceDateEpoch"]
    for mi, _ in members:
        assert (mi.mtime, mi.uid, mi.gid, mi.uname, mi.gname, mi.mode) == (epoch, 0, 0, "", "", 0o644), mi.name
    plugin = members[0][1]
    assert sha256(plugin) == sha256(built_wasm)
    config = json.loads(layout.blob(m["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == ["sha256:" + sha256(gzip.decompress(layer))]
    assert (config["architecture"], config["os"]) == ("wasm", "wasip1")
    assert config["created"] == build_info["inputs"]["created"]


def _extract_wasm(layout: Layout, tag: str, dest: Path) -> Path:
    _, m, _ = layout.manifest(tag)
    if m["layers"][-1]["mediaType"] == WASM_LAYER:
        data = layout.blob(m["layers"][-1]["digest"])
    else:  # compat: plugin.wasm from the tar+gzip layer, as Istio does
        data = dict((mi.name, b) for mi, b in tar_members(layout.blob(m["layers"][-1]["digest"])))["plugin.wasm"]
    dest.write_bytes(data)
    return dest


@pytest.mark.parametrize("variant", ["wasm", "compat"])
def test_envoy_loads_the_pulled_module(variant, pulled, tmp_path: Path):
    """`envoy --mode validate` loads it (and runs on_configure for both roles),
    then a live Envoy routes with it and its ingest role stores a snapshot."""
    layout, tag = pulled[variant]
    wasm = _extract_wasm(layout, tag, tmp_path / f"pulled-{variant}.wasm")
    cfg = harness.build_envoy_config(
        gateway_port=harness.free_ports(1)[0], admin_port=harness.free_ports(1)[0],
        endpoints=["127.0.0.1:8001"], wasm=wasm, ingest_port=harness.free_ports(1)[0],
    )
    for plugin in harness.wasm_filter_configs(cfg):
        assert plugin["vm_config"]["code"]["local"]["filename"] == str(wasm)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = harness.validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr

    with harness.Stack(replicas=2, wasm=wasm) as stack:
        reply = harness.send(stack.gateway_url, json_body=harness.chat_body(user_text="oci"), session="oci-1")
        assert reply.status == 200, reply.describe()
        assert reply.reason in ("session", "prefix", "spill"), reply.describe()
        assert reply.served_by in stack.live_hosts
        pushed = stack.push_fleet()
        assert pushed.status == 204, pushed


def test_collector_image_matches_dockerfile(pulled, build_info):
    """The daemonless collector image equals the Dockerfile's last stage:
    FROM scratch, the static binary at the same path, the same user and
    entrypoint."""
    layout, tag = pulled["collector"]
    digest, m, _ = layout.manifest(tag)
    assert digest == build_info["collector"]["manifestDigest"]
    config = json.loads(layout.blob(m["config"]["digest"]))
    assert (config["os"], config["architecture"]) == ("linux", build_info["inputs"]["collectorArch"])
    members = tar_members(layout.blob(m["layers"][0]["digest"]))
    names = [mi.name for mi, _ in members]
    assert names == ["usr", "usr/local", "usr/local/bin", "usr/local/bin/kvroute-collector"], names
    binary = members[-1]
    assert binary[0].mode == 0o755 and (binary[0].uid, binary[0].gid) == (0, 0)
    assert sha256(binary[1]) == build_info["collector"]["binarySha256"]

    stages = dockerfile_stages(DOCKERFILE.read_text())
    last = stages[-1]
    assert last["FROM"] == ["scratch"], "the image has no base: one static binary"
    copy = last["COPY"][-1].split()
    assert copy[-1] == "/" + names[-1], copy
    assert last["USER"] == [config["config"]["User"]]
    assert json.loads(last["ENTRYPOINT"][-1]) == config["config"]["Entrypoint"]
    assert [f"{p}/tcp" for p in last["EXPOSE"]] == sorted(config["config"]["ExposedPorts"])
    build = " ".join(sum((s.get("RUN", []) for s in stages[:-1]), []))
    assert "unknown-linux-musl" in build and "--locked" in build and "-p kvroute-collector" in build


def dockerfile_stages(text: str) -> list[dict[str, list[str]]]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    lines, buf = [], ""
    for raw in text.splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        buf = f"{buf} {s[:-1].strip()}" if s.endswith("\\") else f"{buf} {s}"
        if not s.endswith("\\"):
            lines.append(buf.strip())
            buf = ""
    stages: list[dict[str, list[str]]] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append({})
            rest = rest.split(" AS ")[0].split(" as ")[0].strip()
        if stages:
            stages[-1].setdefault(word, []).append(rest.strip())
    return stages


def test_static_collector_runs(build_info):
    """The binary inside the image: statically linked, and it runs."""
    path = repo_path(build_info["inputs"].get("collector") or "/nonexistent")
    need(path.is_file(), "the static collector is not built: run `make oci`")
    out = subprocess.run(["file", str(path)], capture_output=True, text=True) if shutil.which("file") else None
    if out is not None and out.returncode == 0:
        assert "statically linked" in out.stdout or "static-pie linked" in out.stdout, out.stdout
    interp = subprocess.run(["readelf", "-l", str(path)], capture_output=True, text=True) if shutil.which("readelf") else None
    if interp is not None and interp.returncode == 0:
        assert "Requesting program interpreter" not in interp.stdout, "dynamically linked"
    result = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "--engines" in result.stdout and "--gateways" in result.stdout
    version = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and build_info["inputs"]["version"] in version.stdout
