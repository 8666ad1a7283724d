//! The template environment transformers gives chat templates (Jinja2's
//! `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`, loop controls,
//! the `{% generation %}` block, `raise_exception`, `strftime_now` and its own `tojson`),
//! rebuilt on minijinja with Python's behaviour where minijinja's differs: how values
//! print, Python's string / dict / list methods, and the filters and tests templates use.

use super::pyfmt::{json_dumps, py_str, JsonOptions};
use minijinja::value::{Rest, ValueKind, ValueOrKwargs};
use minijinja::{Environment, Error, ErrorKind, State, Value};
use std::sync::Arc;

/// Where `strftime_now` reads the time: the local clock, or a fixed instant (tests).
#[derive(Clone, Copy, Debug, Default)]
pub enum Clock {
    #[default]
    Local,
    /// Seconds since the epoch and microseconds, formatted as a naive UTC time.
    Fixed(i64, u32),
}

fn err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// Python's `str.isspace()` for one character.
pub fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Splits trailing keyword arguments off filter / method arguments (marking them used,
/// which minijinja checks).
fn split_kwargs(args: &[Value]) -> (&[Value], Vec<(String, Value)>) {
    match args.last() {
        Some(last) if last.is_kwargs() => {
            let mut pairs = Vec::new();
            if let Ok(kw) = minijinja::value::Kwargs::try_from(last.clone()) {
                let names: Vec<String> = kw.args().map(String::from).collect();
                for k in names {
                    if let Ok(v) = kw.get::<Value>(&k) {
                        pairs.push((k, v));
                    }
                }
            }
            (&args[..args.len() - 1], pairs)
        }
        _ => (args, Vec::new()),
    }
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` over `json.dumps`.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args: Vec<Value> = args.0.into_iter().map(ValueOrKwargs::into_value).collect();
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    let (pos, kw) = split_kwargs(&args);
    if pos.len() > NAMES.len() {
        return Err(err(format!("tojson() takes at most {} arguments ({} given)", NAMES.len(), pos.len())));
    }
    let mut vals: [Value; 4] = Default::default();
    for (i, v) in pos.iter().enumerate() {
        vals[i] = v.clone();
    }
    for (k, v) in kw {
        let i = NAMES
            .iter()
            .position(|n| *n == k)
            .ok_or_else(|| err(format!("tojson() got an unexpected keyword argument '{k}'")))?;
        if i < pos.len() {
            return Err(err(format!("tojson() got multiple values for argument '{k}'")));
        }
        vals[i] = v;
    }
    let set = |v: &Value| !v.is_undefined() && !v.is_none();
    let mut opts = JsonOptions { ensure_ascii: vals[0].is_true(), ..Default::default() };
    if set(&vals[1]) {
        opts.indent = Some(match vals[1].kind() {
            ValueKind::String => vals[1].as_str().unwrap_or_default().to_string(),
            ValueKind::Number | ValueKind::Bool => " "
                .repeat(i64::try_from(vals[1].clone()).map_err(|_| err("tojson(): indent must be an integer"))?.max(0)
                    as usize),
            k => return Err(err(format!("tojson(): indent must be an int or a string, not {k}"))),
        });
        opts.item_sep = ",".into();
    }
    if set(&vals[2]) {
        let seps: Vec<Value> = vals[2].try_iter()?.collect();
        match seps.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_sep = a.as_str().unwrap().to_string();
                opts.key_sep = b.as_str().unwrap().to_string();
            }
            _ => return Err(err("tojson(): separators must be a pair of strings")),
        }
    }
    opts.sort_keys = vals[3].is_true();
    Ok(Value::from(json_dumps(value, &opts)?))
}

/// Jinja2's `join(value, d='', attribute=None)`, items through Python's `str()`.
fn join(state: &State, value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args: Vec<Value> = args.0.into_iter().map(ValueOrKwargs::into_value).collect();
    let (pos, kw) = split_kwargs(&args);
    let mut sep = pos.first().map(py_str).unwrap_or_default();
    let mut attribute = pos.get(1).cloned();
    for (k, v) in kw {
        match k.as_str() {
            "d" => sep = py_str(&v),
            "attribute" => attribute = Some(v),
            _ => return Err(err(format!("join() got an unexpected keyword argument '{k}'"))),
        }
    }
    if value.kind() == ValueKind::String {
        let s = value.as_str().unwrap_or_default();
        return Ok(Value::from(s.chars().map(String::from).collect::<Vec<_>>().join(&sep)));
    }
    let mut out = String::new();
    for (i, item) in value.try_iter()?.enumerate() {
        if i > 0 {
            out.push_str(&sep);
        }
        let item = match &attribute {
            Some(a) if a.as_str().is_some() => {
                let mut v = item;
                for part in a.as_str().unwrap().split('.') {
                    v = v.get_attr(part)?;
                }
                v
            }
            _ => item,
        };
        out.push_str(&py_str(&item));
        state.consume_fuel((out.len() / 1024) as u64).ok();
    }
    Ok(Value::from(out))
}

/// Jinja2's `title` filter: the first letter of each word (after `-`, whitespace,
/// brackets) upper-cased, the rest lower-cased.
fn jinja_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut start = true;
    for c in s.chars() {
        if py_space(c) || "-({[<".contains(c) {
            start = true;
            out.push(c);
        } else if start {
            out.extend(c.to_uppercase());
            start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// Python's `str.title()`.
pub fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_lowercase() || c.is_uppercase();
    }
    out
}

/// Python's `str.capitalize()`.
pub fn py_capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars.flat_map(char::to_lowercase)).collect(),
        None => String::new(),
    }
}

/// Python's `str.strip(chars)` (and its one-sided forms).
pub fn py_strip<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let keep = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_space(c),
    };
    let s = if left { s.trim_start_matches(keep) } else { s };
    if right {
        s.trim_end_matches(keep)
    } else {
        s
    }
}

/// markupsafe's `escape`, which Jinja2's `e` / `escape` filters use.
fn escape(value: &Value) -> Value {
    if value.is_safe() {
        return value.clone();
    }
    let s = py_str(value);
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    Value::from_safe_string(out)
}

/// Python's `fmt % args` for the conversions templates use (`%s`, `%r`, `%d`, `%i`,
/// `%f`, `%.Nf`, `%%`), as Jinja2's `format` filter does.
fn percent_format(fmt: &str, args: &[Value]) -> Result<String, Error> {
    let mut out = String::new();
    let mut next = args.iter();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut precision = None;
        if chars.peek() == Some(&'.') {
            chars.next();
            let mut digits = String::new();
            while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                digits.push(*d);
                chars.next();
            }
            precision = digits.parse::<usize>().ok();
        }
        let conv = chars.next().ok_or_else(|| err("format(): incomplete format"))?;
        if conv == '%' {
            out.push('%');
            continue;
        }
        let arg = next.next().ok_or_else(|| err("format(): not enough arguments for format string"))?;
        match conv {
            's' => out.push_str(&py_str(arg)),
            'r' => out.push_str(&super::pyfmt::py_repr(arg)),
            'd' | 'i' => {
                let f = f64::try_from(arg.clone()).map_err(|_| err("format(): %d needs a number"))?;
                out.push_str(&format!("{}", f.trunc() as i64));
            }
            'f' => {
                let f = f64::try_from(arg.clone()).map_err(|_| err("format(): %f needs a number"))?;
                out.push_str(&format!("{:.*}", precision.unwrap_or(6), f));
            }
            c => return Err(err(format!("format(): unsupported format character '{c}'"))),
        }
    }
    Ok(out)
}

/// `strftime_now(format)`: `datetime.now().strftime(format)` (C `strftime`, as
/// CPython uses it, with Python's own `%f` and empty `%z` / `%Z` for a naive time).
pub fn strftime_now(clock: Clock, format: &str) -> Result<String, Error> {
    let (secs, micros) = match clock {
        Clock::Local => {
            let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            (d.as_secs() as i64, d.subsec_micros())
        }
        Clock::Fixed(s, us) => (s, us),
    };
    let mut fmt = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            fmt.push(c);
            continue;
        }
        match chars.next() {
            Some('f') => fmt.push_str(&format!("{micros:06}")),
            Some('z' | 'Z') => {}
            Some(':') if chars.peek() == Some(&'z') => {
                chars.next();
            }
            Some(o) => {
                fmt.push('%');
                fmt.push(o);
            }
            None => fmt.push('%'),
        }
    }
    // SAFETY: plain C calls on a zeroed `tm` and buffers that outlive them.
    unsafe {
        let t: libc::time_t = secs as libc::time_t;
        let mut tm: libc::tm = std::mem::zeroed();
        let ok = match clock {
            Clock::Local => !libc::localtime_r(&t, &mut tm).is_null(),
            Clock::Fixed(..) => !libc::gmtime_r(&t, &mut tm).is_null(),
        };
        if !ok {
            return Err(err("strftime_now: the clock is out of range"));
        }
        let cfmt = std::ffi::CString::new(fmt).map_err(|_| err("strftime_now: the format has a NUL byte"))?;
        let mut size = 256;
        loop {
            let mut buf = vec![0u8; size];
            let n = libc::strftime(buf.as_mut_ptr().cast(), size, cfmt.as_ptr(), &tm);
            if n > 0 || size > 1 << 16 || format.is_empty() {
                buf.truncate(n);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            size *= 4;
        }
    }
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (transformers' extension, which
/// renders its body) with the equivalent scoped block `{% with %}` / `{% endwith %}`,
/// keeping whitespace control.
pub fn rewrite_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} with {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endwith {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Sets up `env` as transformers sets up Jinja2 for chat templates.
pub fn configure(env: &mut Environment<'static>, clock: Clock) -> Result<(), Error> {
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_formatter(|out, _state, value| write!(out, "{}", py_str(value)).map_err(|_| err("write failed")));
    env.set_unknown_method_callback(super::pymethods::call_method);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    let clock = Arc::new(clock);
    env.add_function("strftime_now", move |fmt: String| strftime_now(*clock, &fmt));
    env.add_filter("tojson", tojson);
    env.add_filter("join", join);
    env.add_filter("string", |v: &Value| Value::from(py_str(v)));
    env.add_filter("trim", |v: &Value, chars: Option<String>| {
        Value::from(py_strip(&py_str(v), chars.as_deref(), true, true))
    });
    env.add_filter("title", |v: &Value| Value::from(jinja_title(&py_str(v))));
    env.add_filter("capitalize", |v: &Value| Value::from(py_capitalize(&py_str(v))));
    env.add_filter("upper", |v: &Value| Value::from(py_str(v).to_uppercase()));
    env.add_filter("lower", |v: &Value| Value::from(py_str(v).to_lowercase()));
    env.add_filter("e", escape);
    env.add_filter("escape", escape);
    env.add_filter("format", |fmt: &Value, args: Rest<Value>| -> Result<Value, Error> {
        Ok(Value::from(percent_format(&py_str(fmt), &args)?))
    });
    // Jinja2's `sequence`: anything with a length and indexing (strings and dicts too).
    env.add_test("sequence", |v: &Value| {
        v.is_undefined() || matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::String | ValueKind::Bytes)
    });
    // Jinja2's `iterable`: whatever Python can `iter()` (not `None`).
    env.add_test("iterable", |v: &Value| {
        v.is_undefined()
            || matches!(
                v.kind(),
                ValueKind::Seq | ValueKind::Map | ValueKind::String | ValueKind::Bytes | ValueKind::Iterable
            )
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_scoped_blocks() {
        let src = "a{% generation %}b{%- endgeneration -%}c{{ x }}{% if y %}{% endif %}";
        assert_eq!(rewrite_generation_blocks(src), "a{% with %}b{%- endwith -%}c{{ x }}{% if y %}{% endif %}");
    }

    #[test]
    fn strftime_formats_a_fixed_clock() {
        // 2026-03-14 15:09:26.535897 UTC
        let clock = Clock::Fixed(1_773_500_966, 535_897);
        assert_eq!(strftime_now(clock, "%d %b %Y").unwrap(), "14 Mar 2026");
        assert_eq!(strftime_now(clock, "%Y-%m-%dT%H:%M:%S.%f%z").unwrap(), "2026-03-14T15:09:26.535897");
        assert_eq!(strftime_now(clock, "").unwrap(), "");
        assert_eq!(strftime_now(clock, "%A %%").unwrap(), "Saturday %");
    }

    #[test]
    fn python_string_helpers() {
        assert_eq!(py_title("they're bill's-x 2nd"), "They'Re Bill'S-X 2Nd");
        assert_eq!(jinja_title("hello wORLD-foo"), "Hello World-Foo");
        assert_eq!(py_capitalize("hELLO"), "Hello");
        assert_eq!(py_strip("\x1c a \n", None, true, true), "a");
        assert_eq!(py_strip("xxaxx", Some("x"), false, true), "xxa");
        assert_eq!(
            percent_format("%s=%d (%.2f) %%", &[Value::from("a"), Value::from(3), Value::from(0.5)]).unwrap(),
            "a=3 (0.50) %"
        );
    }
}
