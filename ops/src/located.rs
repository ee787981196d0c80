//! Located errors in the text files users write (machine and hosts files): where a byte offset
//! is, which key it belongs to, and the numbers those files hold. Pure text helpers, shared so that
//! every file reports `file:line:col: field: message` alike.

use serde::Deserialize;

/// 1-based line and column of byte `offset`.
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map_or(before.len(), |nl| before.len() - nl - 1)
        + 1;
    (line, column)
}

/// The key of the `key = value` line holding `offset`, or empty: names the field of a TOML error
/// whose span is a value.
pub fn key_at(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    let line = &text[start..end];
    match line.split_once('=') {
        Some((key, _)) if !line.trim_start().starts_with('[') => {
            key.trim().trim_matches('"').to_string()
        }
        _ => String::new(),
    }
}

/// A TOML number: integers are accepted where a float is expected (`peak_gflops = 9300`).
#[derive(Clone, Copy, Debug)]
pub struct Number(pub f64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Number, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E>(self, v: f64) -> Result<Number, E> {
                Ok(Number(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v as f64))
            }
        }
        d.deserialize_any(V)
    }
}
