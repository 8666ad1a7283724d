//! Python's methods on strings, dicts and lists, as chat templates call them
//! (`content.split('</think>')`, `args.items()`, `m.get('x')`), with Python's semantics;
//! what is not here falls back to minijinja-contrib's pycompat.

use super::pyenv::{py_capitalize, py_space, py_strip, py_title};
use super::pyfmt::py_str;
use minijinja::value::{Tuple, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

fn err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// An optional string argument (`None` and absent mean "not given").
fn opt_str<'a>(args: &'a [Value], i: usize, method: &str) -> Result<Option<&'a str>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() || v.is_undefined() => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| err(format!("{method}() argument must be str or None, not {}", v.kind()))),
    }
}

fn opt_int(args: &[Value], i: usize, default: i64, method: &str) -> Result<i64, Error> {
    match args.get(i) {
        None => Ok(default),
        Some(v) if v.is_none() => Ok(default),
        Some(v) => v.as_i64().ok_or_else(|| err(format!("{method}(): expected an integer, got {}", v.kind()))),
    }
}

fn no_args(args: &[Value], method: &str) -> Result<(), Error> {
    if args.is_empty() {
        Ok(())
    } else {
        Err(err(format!("{method}() takes no arguments ({} given)", args.len())))
    }
}

/// Python's `str.split(sep=None, maxsplit=-1)`.
pub fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    let max = if maxsplit < 0 { usize::MAX } else { maxsplit as usize };
    match sep {
        Some("") => Err(err("empty separator")),
        Some(sep) => {
            if max == usize::MAX {
                Ok(s.split(sep).map(String::from).collect())
            } else {
                Ok(s.splitn(max.saturating_add(1), sep).map(String::from).collect())
            }
        }
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(py_space);
            while !rest.is_empty() {
                if out.len() == max {
                    out.push(rest.to_string());
                    break;
                }
                let end = rest.find(py_space).unwrap_or(rest.len());
                out.push(rest[..end].to_string());
                rest = rest[end..].trim_start_matches(py_space);
            }
            Ok(out)
        }
    }
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`.
fn py_rsplit(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    if maxsplit < 0 {
        return py_split(s, sep, maxsplit);
    }
    let max = maxsplit as usize;
    let mut out = match sep {
        Some("") => return Err(err("empty separator")),
        Some(sep) => s.rsplitn(max + 1, sep).map(String::from).collect::<Vec<_>>(),
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_end_matches(py_space);
            while !rest.is_empty() {
                if out.len() == max {
                    out.push(rest.to_string());
                    break;
                }
                let start = rest.rfind(py_space).map_or(0, |i| i + rest[i..].chars().next().unwrap().len_utf8());
                out.push(rest[start..].to_string());
                rest = rest[..start].trim_end_matches(py_space);
            }
            out
        }
    };
    out.reverse();
    Ok(out)
}

/// Python's `str.splitlines(keepends=False)`.
fn py_splitlines(s: &str, keepends: bool) -> Vec<String> {
    let breaks = |c: char| {
        matches!(c, '\n' | '\r' | '\x0b' | '\x0c' | '\x1c' | '\x1d' | '\x1e' | '\u{85}' | '\u{2028}' | '\u{2029}')
    };
    let mut out = Vec::new();
    let mut start = 0;
    let mut iter = s.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        if breaks(c) {
            let mut end = i + c.len_utf8();
            if c == '\r' && iter.peek().map(|p| p.1) == Some('\n') {
                iter.next();
                end += 1;
            }
            out.push(if keepends { &s[start..end] } else { &s[start..i] }.to_string());
            start = end;
        }
    }
    if start < s.len() {
        out.push(s[start..].to_string());
    }
    out
}

/// `prefix` given as a string or a tuple / list of strings.
fn affix_matches(arg: &Value, method: &str, test: impl Fn(&str) -> bool) -> Result<bool, Error> {
    if let Some(p) = arg.as_str() {
        return Ok(test(p));
    }
    if matches!(arg.kind(), ValueKind::Seq | ValueKind::Iterable) {
        for p in arg.try_iter()? {
            let p = p.as_str().ok_or_else(|| err(format!("{method}(): the tuple must hold strings only")))?;
            if test(p) {
                return Ok(true);
            }
        }
        return Ok(false);
    }
    Err(err(format!("{method} first arg must be str or a tuple of str, not {}", arg.kind())))
}

fn char_index(s: &str, byte: Option<usize>) -> Value {
    Value::from(byte.map_or(-1, |b| s[..b].chars().count() as i64))
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Option<Result<Value, Error>> {
    let strs = |v: Vec<String>| Value::from(v);
    Some((|| -> Result<Value, Error> {
        Ok(match method {
            "strip" | "lstrip" | "rstrip" => {
                let chars = opt_str(args, 0, method)?;
                Value::from(py_strip(s, chars, method != "rstrip", method != "lstrip"))
            }
            "split" => strs(py_split(s, opt_str(args, 0, method)?, opt_int(args, 1, -1, method)?)?),
            "rsplit" => strs(py_rsplit(s, opt_str(args, 0, method)?, opt_int(args, 1, -1, method)?)?),
            "splitlines" => strs(py_splitlines(s, args.first().is_some_and(Value::is_true))),
            "startswith" => {
                let arg = args.first().ok_or_else(|| err("startswith() takes at least 1 argument"))?;
                Value::from(affix_matches(arg, method, |p| s.starts_with(p))?)
            }
            "endswith" => {
                let arg = args.first().ok_or_else(|| err("endswith() takes at least 1 argument"))?;
                Value::from(affix_matches(arg, method, |p| s.ends_with(p))?)
            }
            "replace" => {
                let (old, new) = match (args.first().and_then(Value::as_str), args.get(1).and_then(Value::as_str)) {
                    (Some(o), Some(n)) => (o, n),
                    _ => return Err(err("replace() takes two strings")),
                };
                let count = opt_int(args, 2, -1, method)?;
                Value::from(if count < 0 { s.replace(old, new) } else { s.replacen(old, new, count as usize) })
            }
            "upper" => Value::from(s.to_uppercase()),
            "lower" | "casefold" => Value::from(s.to_lowercase()),
            "title" => Value::from(py_title(s)),
            "capitalize" => Value::from(py_capitalize(s)),
            "swapcase" => Value::from(
                s.chars()
                    .flat_map(|c| {
                        if c.is_uppercase() {
                            c.to_lowercase().collect::<Vec<_>>()
                        } else {
                            c.to_uppercase().collect()
                        }
                    })
                    .collect::<String>(),
            ),
            "find" | "index" | "rfind" | "rindex" => {
                let needle = opt_str(args, 0, method)?.ok_or_else(|| err(format!("{method}() takes a string")))?;
                let at = if method.starts_with('r') { s.rfind(needle) } else { s.find(needle) };
                if at.is_none() && method.ends_with("index") {
                    return Err(err("substring not found"));
                }
                char_index(s, at)
            }
            "count" => {
                let needle = opt_str(args, 0, method)?.ok_or_else(|| err("count() takes a string"))?;
                Value::from(if needle.is_empty() { s.chars().count() + 1 } else { s.matches(needle).count() })
            }
            "removeprefix" => {
                let p = opt_str(args, 0, method)?.unwrap_or("");
                Value::from(s.strip_prefix(p).unwrap_or(s))
            }
            "removesuffix" => {
                let p = opt_str(args, 0, method)?.unwrap_or("");
                Value::from(s.strip_suffix(p).unwrap_or(s))
            }
            "partition" | "rpartition" => {
                let sep = opt_str(args, 0, method)?.ok_or_else(|| err(format!("{method}() takes a string")))?;
                let at = if method == "partition" { s.find(sep) } else { s.rfind(sep) };
                let parts = match at {
                    Some(i) => [&s[..i], sep, &s[i + sep.len()..]],
                    None if method == "partition" => [s, "", ""],
                    None => ["", "", s],
                };
                Value::from(Tuple::from(parts.map(Value::from)))
            }
            "join" => {
                let items = args.first().ok_or_else(|| err("join() takes exactly one argument"))?;
                let mut parts = Vec::new();
                for item in items.try_iter()? {
                    if item.kind() != ValueKind::String {
                        return Err(err(format!(
                            "sequence item {}: expected str instance, {} found",
                            parts.len(),
                            item.kind()
                        )));
                    }
                    parts.push(py_str(&item));
                }
                Value::from(parts.join(s))
            }
            "zfill" => {
                let width = opt_int(args, 0, 0, method)?.max(0) as usize;
                let n = s.chars().count();
                if n >= width {
                    Value::from(s)
                } else {
                    let (sign, digits) = match s.chars().next() {
                        Some(c @ ('+' | '-')) => (c.to_string(), &s[1..]),
                        _ => (String::new(), s),
                    };
                    Value::from(format!("{sign}{}{digits}", "0".repeat(width - n)))
                }
            }
            "ljust" | "rjust" | "center" => {
                let width = opt_int(args, 0, 0, method)?.max(0) as usize;
                let fill = opt_str(args, 1, method)?.and_then(|f| f.chars().next()).unwrap_or(' ');
                let n = s.chars().count();
                if n >= width {
                    Value::from(s)
                } else {
                    let pad = width - n;
                    let (left, right) = match method {
                        "ljust" => (0, pad),
                        "rjust" => (pad, 0),
                        // CPython's centering: the odd space goes left when the width is odd.
                        _ => {
                            let left = pad / 2 + (pad & width & 1);
                            (left, pad - left)
                        }
                    };
                    let f = |k: usize| std::iter::repeat_n(fill, k).collect::<String>();
                    Value::from(format!("{}{s}{}", f(left), f(right)))
                }
            }
            "isspace" => Value::from(!s.is_empty() && s.chars().all(py_space)),
            "isdigit" | "isdecimal" | "isnumeric" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_numeric())),
            "isalpha" => Value::from(!s.is_empty() && s.chars().all(char::is_alphabetic)),
            "isalnum" => Value::from(!s.is_empty() && s.chars().all(char::is_alphanumeric)),
            "isupper" => Value::from(s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase)),
            "islower" => Value::from(s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase)),
            "istitle" => Value::from(!s.is_empty() && py_title(s) == s && s.chars().any(char::is_alphabetic)),
            "isascii" => Value::from(s.is_ascii()),
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        })
    })())
    .filter(|r| !matches!(r, Err(e) if e.kind() == ErrorKind::UnknownMethod))
}

fn map_method(value: &Value, method: &str, args: &[Value]) -> Option<Result<Value, Error>> {
    let obj = value.as_object()?;
    let pairs = || obj.try_iter_pairs().into_iter().flatten();
    Some(match method {
        "items" => no_args(args, method).map(|_| pairs().map(|(k, v)| Value::from(Tuple::from([k, v]))).collect()),
        "keys" => no_args(args, method).map(|_| pairs().map(|(k, _)| k).collect()),
        "values" => no_args(args, method).map(|_| pairs().map(|(_, v)| v).collect()),
        "get" => match args {
            [key] | [key, _] => value.get_item(key).map(|v| {
                if v.is_undefined() {
                    args.get(1).cloned().unwrap_or_else(|| Value::from(()))
                } else {
                    v
                }
            }),
            _ => Err(err(format!("get expected 1 or 2 arguments, got {}", args.len()))),
        },
        _ => return None,
    })
}

fn seq_method(value: &Value, method: &str, args: &[Value]) -> Option<Result<Value, Error>> {
    let items = || value.try_iter().into_iter().flatten();
    Some(match (method, args) {
        ("count", [x]) => Ok(Value::from(items().filter(|i| i == x).count())),
        ("index", [x]) => items()
            .position(|i| &i == x)
            .map(Value::from)
            .ok_or_else(|| err(format!("{} is not in list", super::pyfmt::py_repr(x)))),
        ("copy", []) => Ok(items().collect()),
        _ => return None,
    })
}

/// The unknown-method callback: Python's methods on the value's type.
pub fn call_method(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let found = match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        ValueKind::Seq => seq_method(value, method, args),
        _ => None,
    };
    match found {
        Some(r) => r,
        None => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args).map_err(|e| {
            if e.kind() == ErrorKind::UnknownMethod {
                Error::new(ErrorKind::UnknownMethod, format!("{} has no method named {method}", python_type(value)))
            } else {
                e
            }
        }),
    }
}

/// The Python type name of a template value, for error messages.
fn python_type(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::String => "str",
        ValueKind::Map => "dict",
        ValueKind::Seq => "list",
        ValueKind::Number if v.is_integer() => "int",
        ValueKind::Number => "float",
        ValueKind::Bool => "bool",
        ValueKind::None => "NoneType",
        ValueKind::Undefined => "Undefined",
        _ => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_like_python() {
        assert_eq!(py_split("  a b  c ", None, -1).unwrap(), ["a", "b", "c"]);
        assert_eq!(py_split("  a b  c ", None, 1).unwrap(), ["a", "b  c "]);
        assert_eq!(py_split("a,,b", Some(","), -1).unwrap(), ["a", "", "b"]);
        assert_eq!(py_split("a,b,c", Some(","), 1).unwrap(), ["a", "b,c"]);
        assert!(py_split("", Some(""), -1).is_err());
        assert_eq!(py_split("", None, -1).unwrap(), Vec::<String>::new());
        assert_eq!(py_rsplit("a b c", None, 1).unwrap(), ["a b", "c"]);
        assert_eq!(py_rsplit("a,b,c", Some(","), 1).unwrap(), ["a,b", "c"]);
        assert_eq!(py_splitlines("a\r\nb\nc", false), ["a", "b", "c"]);
        assert_eq!(py_splitlines("a\r\nb\n", true), ["a\r\n", "b\n"]);
    }
}
