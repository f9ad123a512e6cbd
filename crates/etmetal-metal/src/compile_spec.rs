//! Compile specs of the Metal delegate: key/value pairs stored with each
//! `BackendDelegate` in the `.pte`. `method_name` (UTF-8) names the method
//! the partition belongs to; other keys are kept and ignored, so files from
//! newer compilers still load.

use etmetal_core::{Error, Result};
use etmetal_pte::CompileSpec;

/// The key of the method-name spec.
pub const METHOD_NAME_KEY: &str = "method_name";

/// The compile spec naming the method (`"forward"`).
pub fn method_name_spec(method: &str) -> CompileSpec {
    CompileSpec {
        key: METHOD_NAME_KEY.to_string(),
        value: method.as_bytes().to_vec(),
    }
}

/// The method name among `specs`; the first `method_name` wins.
pub fn method_name(specs: &[CompileSpec]) -> Result<String> {
    let spec = specs
        .iter()
        .find(|s| s.key == METHOD_NAME_KEY)
        .ok_or_else(|| {
            let keys: Vec<&str> = specs.iter().map(|s| s.key.as_str()).collect();
            Error::format(format!(
                "Could not find method name in the compile specs (keys: {keys:?})"
            ))
        })?;
    String::from_utf8(spec.value.clone()).map_err(|e| {
        Error::format(format!(
            "compile spec `{METHOD_NAME_KEY}` is not UTF-8: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: &str, value: &[u8]) -> CompileSpec {
        CompileSpec {
            key: key.into(),
            value: value.to_vec(),
        }
    }

    #[test]
    fn custom_method_name_round_trips() {
        let s = method_name_spec("decode_step");
        assert_eq!(s.key, "method_name");
        assert_eq!(s.value, b"decode_step");
        assert_eq!(method_name(&[s]).unwrap(), "decode_step");
    }

    #[test]
    fn method_name_is_found_among_other_specs() {
        let specs = [
            spec("dtype", b"bf16"),
            method_name_spec("prefill"),
            spec("future_key", &[0xff, 0x00]),
        ];
        assert_eq!(method_name(&specs).unwrap(), "prefill");
    }

    #[test]
    fn missing_method_name_is_an_error() {
        let err = method_name(&[spec("dtype", b"f32")]).unwrap_err();
        assert!(
            err.to_string().contains("Could not find method name"),
            "{err}"
        );
        assert!(err.to_string().contains("dtype"), "{err}");
        assert!(method_name(&[]).is_err());
    }

    #[test]
    fn non_utf8_method_name_is_an_error() {
        let err = method_name(&[spec("method_name", &[0xc3, 0x28])]).unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
    }
}
