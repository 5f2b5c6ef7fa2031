//! kvroute-oci: writes kvroute's OCI image layouts, byte for byte reproducible.
//!
//! ```text
//! kvroute-oci --wasm target/wasm32-wasip1/release/kvroute.wasm --out target/oci \
//!     --version 0.1.0 --revision <git commit> --source https://github.com/kvroute/kvroute \
//!     --source-date-epoch <commit time> [--collector target/.../kvroute-collector --collector-arch amd64]
//! ```
//!
//! It writes one OCI image layout per variant under `--out`:
//!
//! - `kvroute-wasm/`: the Wasm artifact variant. Its manifest has exactly two
//!   layers, the runtime config JSON
//!   (`application/vnd.module.wasm.config.v1+json`) and the raw module
//!   (`application/vnd.module.wasm.content.layer.v1+wasm`). The manifest's
//!   config descriptor names the same runtime config blob.
//! - `kvroute-compat/`: the compat variant. One
//!   `application/vnd.oci.image.layer.v1.tar+gzip` layer holding
//!   `plugin.wasm` (and `runtime-config.json`), and the manifest annotation
//!   `module.wasm.image/variant=compat`.
//! - `kvroute-collector/` (with `--collector`): the collector image, the same
//!   image as the last stage of `oci/collector/Dockerfile`: one layer with the
//!   static binary at `/usr/local/bin/kvroute-collector`, user 65532.
//!
//! plus `build-info.json`: the inputs and every digest, so a second run can be
//! compared with the first.
//!
//! Reproducibility: every input is an argument. Tar entries are written in a
//! fixed order with mtime = `--source-date-epoch`, uid/gid 0, empty user and
//! group names and fixed modes. The gzip header carries mtime 0 and OS 255
//! ("unknown"). JSON documents are serialised with sorted keys and no
//! whitespace. `created` is `--source-date-epoch` in RFC 3339.

use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use oci_spec::image::{
    Arch, ConfigBuilder, Descriptor, DescriptorBuilder, Digest, HistoryBuilder,
    ImageConfigurationBuilder, ImageIndexBuilder, ImageManifestBuilder, MediaType, Os,
    RootFsBuilder, ANNOTATION_CREATED, ANNOTATION_DESCRIPTION, ANNOTATION_LICENSES,
    ANNOTATION_REF_NAME, ANNOTATION_REVISION, ANNOTATION_SOURCE, ANNOTATION_TITLE,
    ANNOTATION_VERSION,
};
use sha2::{Digest as _, Sha256};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// Media types of the Wasm artifact variant (Istio's and Envoy Gateway's fetchers).
const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.module.wasm.config.v1+json";
const WASM_LAYER_MEDIA_TYPE: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
/// The compat variant's manifest annotation.
const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";
/// proxy-wasm ABI the module exports (proxy-wasm Rust SDK 0.2.x).
const ABI_VERSION: &str = "proxy_abi_version_0_2_1";
const ROOT_ID: &str = "kvroute";
const LICENSE: &str = "Apache-2.0";
const COLLECTOR_PATH: &str = "usr/local/bin/kvroute-collector";
/// distroless' "nonroot" uid/gid; the image has no /etc/passwd, so numeric.
const COLLECTOR_USER: &str = "65532:65532";

const USAGE: &str =
    "usage: kvroute-oci --wasm FILE --out DIR --version V --revision R --source URL \
--source-date-epoch SECONDS [--collector FILE --collector-arch ARCH]";

struct Args {
    wasm: PathBuf,
    out: PathBuf,
    version: String,
    revision: String,
    source: String,
    epoch: u64,
    collector: Option<PathBuf>,
    collector_arch: String,
}

fn parse_args() -> Result<Args> {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let Some(name) = flag.strip_prefix("--") else {
            return Err(format!("unexpected argument {flag:?}\n{USAGE}").into());
        };
        let known = [
            "wasm",
            "out",
            "version",
            "revision",
            "source",
            "source-date-epoch",
            "collector",
            "collector-arch",
        ];
        if !known.contains(&name) {
            return Err(format!("unknown flag --{name}\n{USAGE}").into());
        }
        let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
        map.insert(name.to_owned(), value);
    }
    let mut take = |name: &str| -> Result<String> {
        map.remove(name)
            .ok_or_else(|| format!("--{name} is required\n{USAGE}").into())
    };
    let args = Args {
        wasm: take("wasm")?.into(),
        out: take("out")?.into(),
        version: take("version")?,
        revision: take("revision")?,
        source: take("source")?,
        epoch: take("source-date-epoch")?
            .parse()
            .map_err(|e| format!("--source-date-epoch: {e}"))?,
        collector: map.remove("collector").map(PathBuf::from),
        collector_arch: map
            .remove("collector-arch")
            .unwrap_or_else(|| "amd64".to_owned()),
    };
    if args.epoch > u64::from(u32::MAX) {
        return Err("--source-date-epoch: must fit the tar and gzip fields (< 2^32)".into());
    }
    Ok(args)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kvroute-oci: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    let created = rfc3339(args.epoch);
    let wasm = fs::read(&args.wasm).map_err(|e| format!("{}: {e}", args.wasm.display()))?;
    check_wasm(&wasm)?;
    fs::create_dir_all(&args.out)?;

    let annotations = |title: &str, description: &str| -> HashMap<String, String> {
        HashMap::from([
            (ANNOTATION_VERSION.to_owned(), args.version.clone()),
            (ANNOTATION_REVISION.to_owned(), args.revision.clone()),
            (ANNOTATION_SOURCE.to_owned(), args.source.clone()),
            (ANNOTATION_CREATED.to_owned(), created.clone()),
            (ANNOTATION_TITLE.to_owned(), title.to_owned()),
            (ANNOTATION_DESCRIPTION.to_owned(), description.to_owned()),
            (ANNOTATION_LICENSES.to_owned(), LICENSE.to_owned()),
        ])
    };

    // Runtime config of the Wasm image specification (type, ABI, root ids).
    let runtime_config = canonical_json(&serde_json::json!({
        "type": "envoy_proxy",
        "abiVersions": [ABI_VERSION],
        "config": {"rootIds": [ROOT_ID]},
    }))?;

    let mut info = serde_json::Map::new();
    info.insert(
        "inputs".into(),
        serde_json::json!({
            "wasm": args.wasm.display().to_string(),
            "wasmSha256": hex_sha256(&wasm),
            "wasmSize": wasm.len(),
            "version": args.version,
            "revision": args.revision,
            "source": args.source,
            "sourceDateEpoch": args.epoch,
            "created": created,
            "collector": args.collector.as_ref().map(|p| p.display().to_string()),
            "collectorArch": args.collector.as_ref().map(|_| args.collector_arch.clone()),
        }),
    );

    // --- Wasm artifact variant: [runtime config, module], both raw blobs.
    {
        let mut layout = Layout::new(args.out.join("kvroute-wasm"))?;
        let config_desc = layout.blob(
            &runtime_config,
            WASM_CONFIG_MEDIA_TYPE,
            Some(HashMap::from([(
                ANNOTATION_TITLE.to_owned(),
                "runtime-config.json".to_owned(),
            )])),
        )?;
        let wasm_desc = layout.blob(
            &wasm,
            WASM_LAYER_MEDIA_TYPE,
            Some(HashMap::from([(
                ANNOTATION_TITLE.to_owned(),
                "plugin.wasm".to_owned(),
            )])),
        )?;
        // The manifest's config names the same runtime config (without the
        // title annotation, which belongs to the layer).
        let manifest_config = DescriptorBuilder::default()
            .media_type(MediaType::Other(WASM_CONFIG_MEDIA_TYPE.to_owned()))
            .digest(config_desc.digest().clone())
            .size(config_desc.size())
            .build()?;
        let manifest = ImageManifestBuilder::default()
            .schema_version(2u32)
            .media_type(MediaType::ImageManifest)
            .config(manifest_config)
            .layers(vec![config_desc, wasm_desc])
            .annotations(annotations(
                "kvroute",
                "kvroute proxy-wasm filter (Wasm artifact variant)",
            ))
            .build()?;
        let digest = layout.finish(&manifest, &args.version)?;
        info.insert("wasm".into(), layout.summary(&digest));
    }

    // --- compat variant: one tar+gzip layer with plugin.wasm.
    {
        let mut layout = Layout::new(args.out.join("kvroute-compat"))?;
        let tar = tar_archive(
            &[
                Entry::file("plugin.wasm", &wasm, 0o644),
                Entry::file("runtime-config.json", &runtime_config, 0o644),
            ],
            args.epoch,
        )?;
        let manifest = image_manifest(
            &mut layout,
            &tar,
            args.epoch,
            &created,
            Arch::Wasm,
            Os::Other("wasip1".to_owned()),
            None,
            {
                let mut a = annotations(
                    "kvroute",
                    "kvroute proxy-wasm filter (compat variant: plugin.wasm in a tar+gzip layer)",
                );
                a.insert(VARIANT_ANNOTATION.to_owned(), "compat".to_owned());
                a
            },
        )?;
        let digest = layout.finish(&manifest, &args.version)?;
        info.insert("compat".into(), layout.summary(&digest));
    }

    // --- collector image: the static binary, non-root, no shell.
    if let Some(path) = &args.collector {
        let bin = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut layout = Layout::new(args.out.join("kvroute-collector"))?;
        let tar = tar_archive(
            &[
                Entry::dir("usr/"),
                Entry::dir("usr/local/"),
                Entry::dir("usr/local/bin/"),
                Entry::file(COLLECTOR_PATH, &bin, 0o755),
            ],
            args.epoch,
        )?;
        let arch = Arch::from(args.collector_arch.as_str());
        let manifest = image_manifest(
            &mut layout,
            &tar,
            args.epoch,
            &created,
            arch,
            Os::Linux,
            Some(
                ConfigBuilder::default()
                    .user(COLLECTOR_USER.to_owned())
                    .exposed_ports(vec!["9102/tcp".to_owned()])
                    .entrypoint(vec![format!("/{COLLECTOR_PATH}")])
                    .labels(annotations(
                        "kvroute-collector",
                        "kvroute fleet-state collector sidecar",
                    ))
                    .build()?,
            ),
            annotations("kvroute-collector", "kvroute fleet-state collector sidecar"),
        )?;
        let digest = layout.finish(&manifest, &args.version)?;
        let mut summary = layout.summary(&digest);
        if let Some(obj) = summary.as_object_mut() {
            obj.insert("binarySha256".into(), hex_sha256(&bin).into());
        }
        info.insert("collector".into(), summary);
    }

    let info = serde_json::Value::Object(info);
    fs::write(
        args.out.join("build-info.json"),
        serde_json::to_string_pretty(&info)? + "\n",
    )?;
    println!("{}", serde_json::to_string_pretty(&info)?);
    // A short table on stderr for people: layout, tag, manifest digest.
    if let Some(obj) = info.as_object() {
        for (name, v) in obj.iter().filter(|(k, _)| k.as_str() != "inputs") {
            eprintln!(
                "{name:10} {}  oci:{}:{}",
                v["manifestDigest"].as_str().unwrap_or("?"),
                v["layout"].as_str().unwrap_or("?"),
                args.version
            );
        }
    }
    Ok(())
}

/// A manifest for a runnable-style image: one tar+gzip layer and an image config.
#[allow(clippy::too_many_arguments)]
fn image_manifest(
    layout: &mut Layout,
    tar: &[u8],
    epoch: u64,
    created: &str,
    arch: Arch,
    os: Os,
    config: Option<oci_spec::image::Config>,
    annotations: HashMap<String, String>,
) -> Result<oci_spec::image::ImageManifest> {
    let gz = gzip(tar)?;
    let layer = layout.blob(&gz, MediaType::ImageLayerGzip.to_string().as_str(), None)?;
    let mut image_config = ImageConfigurationBuilder::default()
        .created(created.to_owned())
        .architecture(arch)
        .os(os)
        .rootfs(
            RootFsBuilder::default()
                .typ("layers".to_owned())
                .diff_ids(vec![format!("sha256:{}", hex_sha256(tar))])
                .build()?,
        )
        .history(vec![HistoryBuilder::default()
            .created(created.to_owned())
            .created_by(format!(
                "kvroute-oci {} (SOURCE_DATE_EPOCH={epoch})",
                env!("CARGO_PKG_VERSION")
            ))
            .build()?]);
    if let Some(config) = config {
        image_config = image_config.config(config);
    }
    let config_bytes = canonical_json(&image_config.build()?)?;
    let config_desc = layout.blob(
        &config_bytes,
        MediaType::ImageConfig.to_string().as_str(),
        None,
    )?;
    Ok(ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(config_desc)
        .layers(vec![layer])
        .annotations(annotations)
        .build()?)
}

/// An OCI image layout directory being written: `oci-layout`, `blobs/sha256/`, `index.json`.
struct Layout {
    dir: PathBuf,
    blobs: Vec<serde_json::Value>,
}

impl Layout {
    fn new(dir: PathBuf) -> Result<Self> {
        // Start from nothing: no blob of an earlier build may linger.
        if dir.exists() {
            fs::remove_dir_all(&dir)?;
        }
        fs::create_dir_all(dir.join("blobs").join("sha256"))?;
        Ok(Self {
            dir,
            blobs: Vec::new(),
        })
    }

    /// Stores `data` as a blob and returns its descriptor.
    fn blob(
        &mut self,
        data: &[u8],
        media_type: &str,
        annotations: Option<HashMap<String, String>>,
    ) -> Result<Descriptor> {
        let hex = hex_sha256(data);
        write_file(&self.dir.join("blobs").join("sha256").join(&hex), data)?;
        let digest = format!("sha256:{hex}");
        if !self.blobs.iter().any(|b| b["digest"] == digest.as_str()) {
            self.blobs.push(serde_json::json!({
                "mediaType": media_type,
                "digest": digest,
                "size": data.len(),
            }));
        }
        let mut b = DescriptorBuilder::default()
            .media_type(MediaType::from(media_type))
            .digest(Digest::from_str(&format!("sha256:{hex}"))?)
            .size(data.len() as u64);
        if let Some(a) = annotations {
            b = b.annotations(a);
        }
        Ok(b.build()?)
    }

    /// Writes the manifest blob, `index.json` (tagged `ref_name`) and `oci-layout`.
    fn finish(
        &mut self,
        manifest: &oci_spec::image::ImageManifest,
        ref_name: &str,
    ) -> Result<Digest> {
        let bytes = canonical_json(manifest)?;
        let mut desc = self.blob(&bytes, MediaType::ImageManifest.to_string().as_str(), None)?;
        desc.set_annotations(Some(HashMap::from([(
            ANNOTATION_REF_NAME.to_owned(),
            ref_name.to_owned(),
        )])));
        let digest = desc.digest().clone();
        let index = ImageIndexBuilder::default()
            .schema_version(2u32)
            .media_type(MediaType::ImageIndex)
            .manifests(vec![desc])
            .build()?;
        write_file(&self.dir.join("index.json"), &canonical_json(&index)?)?;
        write_file(
            &self.dir.join("oci-layout"),
            &canonical_json(&serde_json::json!({"imageLayoutVersion": "1.0.0"}))?,
        )?;
        Ok(digest)
    }

    fn summary(&self, manifest: &Digest) -> serde_json::Value {
        serde_json::json!({
            "layout": self.dir.display().to_string(),
            "manifestDigest": manifest.to_string(),
            "blobs": self.blobs,
        })
    }
}

fn write_file(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(data)?;
    Ok(())
}

/// JSON with sorted keys and no insignificant whitespace. oci-spec keeps
/// annotations in a HashMap, whose order changes from run to run; going
/// through `serde_json::Value` (a BTreeMap) sorts every object.
fn canonical_json<T: serde::Serialize>(value: &T) -> Result<Vec<u8>> {
    let v = serde_json::to_value(value)?;
    Ok(serde_json::to_vec(&v)?)
}

fn hex_sha256(data: &[u8]) -> String {
    let digest = Sha256::digest(data);
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The module must be a Wasm binary that exports the proxy-wasm ABI it declares.
fn check_wasm(wasm: &[u8]) -> Result<()> {
    if !wasm.starts_with(b"\0asm") {
        return Err("--wasm: not a WebAssembly binary (no \\0asm magic)".into());
    }
    let needle = ABI_VERSION.as_bytes();
    if !wasm.windows(needle.len()).any(|w| w == needle) {
        return Err(format!("--wasm: the module does not export {ABI_VERSION}").into());
    }
    Ok(())
}

struct Entry<'a> {
    path: &'a str,
    data: &'a [u8],
    mode: u32,
    dir: bool,
}

impl<'a> Entry<'a> {
    fn file(path: &'a str, data: &'a [u8], mode: u32) -> Self {
        Self {
            path,
            data,
            mode,
            dir: false,
        }
    }
    fn dir(path: &'a str) -> Self {
        Self {
            path,
            data: &[],
            mode: 0o755,
            dir: true,
        }
    }
}

/// A ustar archive of `entries`, in the given order, with fixed metadata.
fn tar_archive(entries: &[Entry<'_>], mtime: u64) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        h.set_path(e.path)?;
        h.set_entry_type(if e.dir {
            tar::EntryType::Directory
        } else {
            tar::EntryType::Regular
        });
        h.set_size(e.data.len() as u64);
        h.set_mode(e.mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_username("")?;
        h.set_groupname("")?;
        h.set_mtime(mtime);
        h.set_cksum();
        builder.append(&h, e.data)?;
    }
    Ok(builder.into_inner()?)
}

/// gzip with a fixed header: no file name, mtime 0, OS 255 (unknown).
fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::best());
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
fn rfc3339(epoch: u64) -> String {
    let days = epoch / 86_400;
    let secs = epoch % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian calendar).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn archives_are_deterministic() {
        let a = gzip(&tar_archive(&[Entry::file("plugin.wasm", b"x", 0o644)], 7).unwrap()).unwrap();
        let b = gzip(&tar_archive(&[Entry::file("plugin.wasm", b"x", 0o644)], 7).unwrap()).unwrap();
        assert_eq!(a, b);
        // gzip header: magic, deflate, no flags, mtime 0, OS 255.
        assert_eq!(&a[..8], &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0]);
        assert_eq!(a[9], 255);
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let m: HashMap<String, u8> = (0..20).map(|i| (format!("k{i:02}"), i)).collect();
        let s = String::from_utf8(canonical_json(&m).unwrap()).unwrap();
        assert!(s.starts_with("{\"k00\":0,\"k01\":1,"), "{s}");
    }
}
