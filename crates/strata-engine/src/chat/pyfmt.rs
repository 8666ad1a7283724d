//! Python's text forms of template values: `str()` (what `{{ x }}` prints), `repr()`
//! (how containers show their items) and `json.dumps` with its options, so that a
//! template prints what it prints under Jinja2.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};
use std::fmt::Write;

/// Python's `str(x)`: strings as they are, `None`, `True`, floats as `repr(float)`,
/// containers in `repr` form; undefined prints nothing (Jinja2's default `Undefined`).
pub fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        _ => py_repr(v),
    }
}

/// Python's `repr(x)`.
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    write_repr(v, &mut out);
    out
}

fn write_repr(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(v)),
        ValueKind::String => out.push_str(&repr_str(v.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            let tuple = v.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            if let Ok(items) = v.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(&item, out);
                    n += 1;
                }
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Some(pairs) = v.as_object().and_then(|o| o.try_iter_pairs()) {
                for (i, (k, val)) in pairs.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(&k, out);
                    out.push_str(": ");
                    write_repr(&val, out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// An int as digits, a float as Python's `repr(float)`.
pub fn py_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) => py_float(f),
        Err(_) => v.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, in positional form for
/// exponents -4..16 (`0.0001`, `1e+16`, `1.5e-05`), `.0` on whole numbers.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f < 0.0 { "-inf".into() } else { "inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. `1.5e16`, `-2e-5`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` exponent is an integer");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    };
    format!("{sign}{body}")
}

/// Whether Python's `str.isprintable()` holds for `c` (what `repr` leaves unescaped).
/// Control, format, separator (but the space), private-use and surrogate characters
/// are not; unassigned code points are treated as printable.
fn printable(c: char) -> bool {
    let u = c as u32;
    !(c.is_control()
        || matches!(u, 0xA0 | 0xAD | 0x1680 | 0x180E | 0x3000 | 0xFEFF | 0x061C | 0x070F | 0x08E2 | 0x110BD | 0x110CD)
        || (0x0600..=0x0605).contains(&u)
        || (0x2000..=0x200F).contains(&u)
        || (0x2028..=0x202F).contains(&u)
        || (0x205F..=0x2064).contains(&u)
        || (0x2066..=0x206F).contains(&u)
        || (0xFFF9..=0xFFFB).contains(&u)
        || (0xE000..=0xF8FF).contains(&u)
        || (0xF0000..=0x10FFFF).contains(&u)
        || (0xE0000..=0xE007F).contains(&u)
        || (0x1BCA0..=0x1BCA3).contains(&u)
        || (0x1D173..=0x1D17A).contains(&u))
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
pub fn repr_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
    out
}

/// The options of Python's `json.dumps` that chat templates use.
#[derive(Clone, Debug)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: a newline and `s` per level.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        Self { ensure_ascii: false, indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false }
    }
}

fn not_serializable(what: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("Object of type {what} is not JSON serializable"))
}

/// `json.dumps(value, ...)`, byte for byte.
pub fn json_dumps(v: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump(v, opts, 0, &mut out)?;
    Ok(out)
}

fn json_key(k: &Value) -> Result<String, Error> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number => py_number(k),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {}", k.kind()),
            ))
        }
    })
}

fn newline(opts: &JsonOptions, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump(v: &Value, opts: &JsonOptions, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined => return Err(not_serializable("Undefined")),
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let n = py_number(v);
            out.push_str(match n.as_str() {
                "nan" => "NaN",
                "inf" => "Infinity",
                "-inf" => "-Infinity",
                n => n,
            });
        }
        ValueKind::String => json_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                dump(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let obj = v.as_object().ok_or_else(|| not_serializable("object"))?;
            let mut pairs = Vec::new();
            for (k, val) in obj.try_iter_pairs().into_iter().flatten() {
                pairs.push((json_key(&k)?, val));
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, val)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                json_str(k, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                dump(val, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push('}');
        }
        ValueKind::Bytes => return Err(not_serializable("bytes")),
        _ => return Err(not_serializable(&v.kind().to_string())),
    }
    Ok(())
}

/// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other
/// control characters as `\u00XX`; with `ensure_ascii`, non-ASCII as `\uXXXX`
/// (surrogate pairs above the BMP).
fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1.5e16, "1.5e+16"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
            (3.0e-4, "0.0003"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn reprs_and_json_like_python() {
        let v =
            Value::from(minijinja::value::Serde(serde_json::json!({"b": [1, 2.0, null, true], "a": "it's \"x\"\n"})));
        assert_eq!(py_str(&v), r#"{'b': [1, 2.0, None, True], 'a': 'it\'s "x"\n'}"#);
        assert_eq!(repr_str("it's"), "\"it's\"");
        assert_eq!(repr_str("a\u{1}é\u{a0}"), "'a\\x01é\\xa0'");
        let d = JsonOptions::default();
        assert_eq!(json_dumps(&v, &d).unwrap(), r#"{"b": [1, 2.0, null, true], "a": "it's \"x\"\n"}"#);
        let ascii = JsonOptions { ensure_ascii: true, ..d.clone() };
        let s = Value::from("é😀\u{1f}");
        assert_eq!(json_dumps(&s, &ascii).unwrap(), r#""\u00e9\ud83d\ude00\u001f""#);
        let pretty = JsonOptions { indent: Some("  ".into()), item_sep: ",".into(), sort_keys: true, ..d };
        let nested = Value::from(minijinja::value::Serde(serde_json::json!({"z": {}, "a": [1, []]})));
        assert_eq!(json_dumps(&nested, &pretty).unwrap(), "{\n  \"a\": [\n    1,\n    []\n  ],\n  \"z\": {}\n}");
        assert!(json_dumps(&Value::UNDEFINED, &JsonOptions::default()).is_err());
    }
}
