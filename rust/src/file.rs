//! The one versioned JSON file of every format (`docs/formats.md`, `docs/checkpointable.md`):
//! `schema` and `version` beside the body's own fields. A file's header is checked before its
//! body is read, so that a file of another format or version fails with a clear message rather
//! than on some field that changed.

use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A body written as a versioned file.
pub(crate) trait Format {
    /// `schema` of its files.
    const SCHEMA: &'static str;
    /// The only version of its files this crate reads and writes.
    const VERSION: u64;
    /// The error a malformed file of this format is, from what is wrong with it.
    fn invalid(message: String) -> Error;
}

#[derive(Serialize)]
struct Written<'a, T> {
    schema: &'static str,
    version: u64,
    #[serde(flatten)]
    body: &'a T,
}

/// The body of a file of format `T`, its header checked.
pub(crate) fn read<T: Format + DeserializeOwned>(text: &str) -> Result<T> {
    let mut raw: serde_json::Value =
        serde_json::from_str(text).map_err(|e| T::invalid(format!("not JSON: {e}")))?;
    check_header(&raw, T::SCHEMA, T::VERSION).map_err(T::invalid)?;
    if let Some(fields) = raw.as_object_mut() {
        fields.remove("schema");
        fields.remove("version");
    }
    serde_json::from_value(raw).map_err(|e| T::invalid(format!("bad field: {e}")))
}

/// The file text of `body`.
pub(crate) fn write<T: Format + Serialize>(body: &T) -> String {
    let file = Written {
        schema: T::SCHEMA,
        version: T::VERSION,
        body,
    };
    serde_json::to_string(&file).expect("a file body always serializes")
}

fn check_header(
    raw: &serde_json::Value,
    schema: &str,
    version: u64,
) -> std::result::Result<(), String> {
    let found_schema = raw.get("schema").and_then(|s| s.as_str());
    if found_schema != Some(schema) {
        return Err(format!(
            "expected \"schema\": \"{schema}\", found {:?}",
            raw.get("schema")
        ));
    }
    match raw.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == version => Ok(()),
        _ => Err(format!(
            "unsupported {schema} version {:?}: this remat reads version {version}",
            raw.get("version")
        )),
    }
}
