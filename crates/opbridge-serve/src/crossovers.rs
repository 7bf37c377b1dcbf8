//! The host/device crossovers that `ob.calibrate()` measured and saved (`crossovers.json` in
//! opbridge's cache folder, the one the Python package reads), for models configured with
//! `device = "auto"`. Each entry names the device it was measured on (chip and driver library):
//! the router ignores an entry whose device is no longer the same (`opbridge_ops::hybrid`).

use std::path::{Path, PathBuf};

use opbridge_ops::hybrid::{self, Crossover};
use opbridge_runtime::{DType, DeviceId};

/// Largest crossovers file read (a calibration writes a few kilobytes).
const MAX_BYTES: u64 = 1 << 20;

/// Where the Python package saves them: `$OPBRIDGE_CACHE_DIR`, else `$XDG_CACHE_HOME/opbridge`,
/// else `~/.cache/opbridge`; `None` without a home folder.
pub fn default_path() -> Option<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let folder = env("OPBRIDGE_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|c| c.join("opbridge")))
        .or_else(|| env("HOME").map(|h| h.join(".cache").join("opbridge")))?;
    Some(folder.join("crossovers.json"))
}

/// Reads `path` and puts its crossovers in force; the number applied. A missing file is none
/// (an uncalibrated `device = "auto"` model stays on the host); an unreadable or malformed one
/// is an error; malformed entries are skipped with a warning.
pub fn load(path: &Path) -> Result<usize, String> {
    let text = match read_small_regular_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        Ok(text) => text,
    };
    let entries: Vec<serde_json::Value> =
        serde_json::from_str(&text).map_err(|e| format!("{} is not a JSON list of crossovers: {e}", path.display()))?;
    let mut parsed = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        match parse(entry) {
            Some(found) => parsed.push(found),
            None => tracing::warn!(file = %path.display(), entry = i, "skipping a malformed crossover: {entry}"),
        }
    }
    let applied = parsed.len();
    hybrid::set_all(parsed);
    Ok(applied)
}

/// The file's text: a regular file (checked on the open handle, so it cannot be swapped for a
/// FIFO or a device between a check and the read; opened non-blocking, so a FIFO cannot hang the
/// open) of at most `MAX_BYTES`, read with that bound (files under /proc report size 0).
fn read_small_regular_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        const O_NONBLOCK: i32 = 0o4000; // Linux's value on the architectures opbridge builds for
        options.custom_flags(O_NONBLOCK);
    }
    let file = options.open(path)?;
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    if !file.metadata()?.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let mut text = String::new();
    file.take(MAX_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_BYTES {
        return Err(invalid(format!("larger than {MAX_BYTES} bytes")));
    }
    Ok(text)
}

/// `{"op", "dtype", "device", "elems" (an int or null), "identity"}`.
fn parse(entry: &serde_json::Value) -> Option<(String, Crossover)> {
    let text = |key: &str| entry.get(key)?.as_str();
    let op = text("op")?.to_string();
    let dtype = DType::from_name(text("dtype")?)?;
    let device = DeviceId::parse(text("device")?)?;
    let elems = match entry.get("elems")? {
        serde_json::Value::Null => None,
        n => Some(usize::try_from(n.as_u64()?).ok().filter(|&n| n > 0)?),
    };
    let identity = text("identity")?.to_string();
    Some((op, Crossover { device, dtype, elems, identity }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_and_malformed_ones_do_not() {
        let good = serde_json::json!({"op": "add", "dtype": "float32", "device": "ascend:0", "elems": 4096,
                                      "identity": "Ascend910B1 via /x/libascendcl.so"});
        let (op, c) = parse(&good).expect("well formed");
        assert_eq!(
            (op.as_str(), c.dtype, c.elems, c.device.to_string()),
            ("add", DType::F32, Some(4096), "ascend:0".into())
        );
        let never =
            serde_json::json!({"op": "add", "dtype": "float16", "device": "ascend:0", "elems": null, "identity": "x"});
        assert_eq!(parse(&never).expect("null: never faster").1.elems, None);
        for bad in [
            serde_json::json!({"op": "add", "dtype": "float32", "device": "ascend:0", "elems": 0, "identity": "x"}),
            serde_json::json!({"op": "add", "dtype": "complex", "device": "ascend:0", "elems": 1, "identity": "x"}),
            serde_json::json!({"op": "add", "dtype": "float32", "device": "tpu:0", "elems": 1, "identity": "x"}),
            serde_json::json!({"op": "add", "dtype": "float32", "device": "ascend:0", "elems": -3, "identity": "x"}),
            serde_json::json!({"dtype": "float32", "device": "ascend:0", "elems": 1, "identity": "x"}),
            serde_json::json!(["add"]),
        ] {
            assert!(parse(&bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_missing_file_is_none_and_a_broken_one_an_error() {
        let dir = std::env::temp_dir().join(format!("opbridge-crossovers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(load(&dir.join("missing.json")), Ok(0));
        std::fs::write(dir.join("broken.json"), "{not json").unwrap();
        assert!(load(&dir.join("broken.json")).unwrap_err().contains("not a JSON list"));
        assert!(load(&dir).unwrap_err().contains("not a regular file"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
