//! Route traces: every routing decision, one record per (forward, batch row, layer),
//! observed before batch-union dedup.
//!
//! Text format (`--trace PATH`), one record per line, whitespace-separated:
//!
//! ```text
//! # strata route trace v1: segment forward row layer experts...
//! 0 0 0 3 17 201 5 88 140 9 33 60
//! ```
//!
//! `segment` is the turn (LFRU heat halves between segments), `forward` numbers the
//! model forwards, `row` the batch row within the forward, `layer` the model layer id,
//! then the row's selected expert ids in router rank order. An expert may be written as
//! `id:gate` (the C engine's trace token); the gate is ignored. Blank lines and lines
//! starting with `#` are skipped.

use std::fmt;
use std::io::{self, BufRead, Write};

use serde::Serialize;

/// The header line [`TraceWriter`] starts a trace with.
pub const TRACE_HEADER: &str = "# strata route trace v1: segment forward row layer experts...";

/// One row's routing at one layer of one forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceRecord {
    pub segment: u32,
    pub forward: u64,
    pub row: u32,
    pub layer: usize,
    pub experts: Vec<usize>,
}

impl TraceRecord {
    /// The record's line, without the newline.
    pub fn to_line(&self) -> String {
        use fmt::Write as _;
        let mut line = format!("{} {} {} {}", self.segment, self.forward, self.row, self.layer);
        for e in &self.experts {
            let _ = write!(line, " {e}");
        }
        line
    }

    /// Parses one line; `Ok(None)` for blank and comment lines.
    pub fn parse_line(line: &str) -> Result<Option<TraceRecord>, String> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return Ok(None);
        }
        let mut fields = line.split_whitespace();
        let mut header = |name: &str| -> Result<u64, String> {
            let field = fields
                .next()
                .ok_or_else(|| format!("missing {name}: expected `segment forward row layer experts...`"))?;
            field.parse().map_err(|_| format!("invalid {name} {field:?}"))
        };
        let segment = header("segment")?;
        let forward = header("forward")?;
        let row = header("row")?;
        let layer = header("layer")?;
        let segment = u32::try_from(segment).map_err(|_| format!("segment {segment} is out of range"))?;
        let row = u32::try_from(row).map_err(|_| format!("row {row} is out of range"))?;
        let layer = usize::try_from(layer).map_err(|_| format!("layer {layer} is out of range"))?;
        let experts = fields
            .map(|token| {
                let id = token.split_once(':').map_or(token, |(id, _gate)| id);
                id.parse::<usize>().map_err(|_| format!("invalid expert {token:?}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(TraceRecord { segment, forward, row, layer, experts }))
    }
}

/// A malformed trace line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// 1-based line number (0 for an I/O error).
    pub line: usize,
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "route trace: {}", self.message)
        } else {
            write!(f, "route trace line {}: {}", self.line, self.message)
        }
    }
}

impl std::error::Error for TraceError {}

/// Parses a whole trace held in memory.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, TraceError> {
    read_trace(text.as_bytes())
}

/// Parses a trace from a reader (e.g. a `BufReader<File>`).
pub fn read_trace(reader: impl BufRead) -> Result<Vec<TraceRecord>, TraceError> {
    let mut records = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| TraceError { line: 0, message: e.to_string() })?;
        match TraceRecord::parse_line(&line) {
            Ok(Some(record)) => records.push(record),
            Ok(None) => {}
            Err(message) => return Err(TraceError { line: index + 1, message }),
        }
    }
    Ok(records)
}

/// Writes a whole trace: the header line, then one line per record.
pub fn write_trace(out: impl Write, records: &[TraceRecord]) -> io::Result<()> {
    let mut writer = TraceWriter::new(out)?;
    for record in records {
        writer.write(record)?;
    }
    writer.finish().map(|_| ())
}

/// Streams records as they are routed (wrap the file in a `BufWriter`).
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    /// Writes the header line.
    pub fn new(mut out: W) -> io::Result<Self> {
        writeln!(out, "{TRACE_HEADER}")?;
        Ok(TraceWriter { out })
    }

    pub fn write(&mut self, record: &TraceRecord) -> io::Result<()> {
        writeln!(self.out, "{}", record.to_line())
    }

    /// Records every row of one router call: `routes[row]` is that row's top-k.
    pub fn write_routes(&mut self, segment: u32, forward: u64, layer: usize, routes: &[&[usize]]) -> io::Result<()> {
        for (row, experts) in routes.iter().enumerate() {
            write!(self.out, "{segment} {forward} {row} {layer}")?;
            for e in experts.iter() {
                write!(self.out, " {e}")?;
            }
            writeln!(self.out)?;
        }
        Ok(())
    }

    /// Flushes and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(segment: u32, forward: u64, row: u32, layer: usize, experts: &[usize]) -> TraceRecord {
        TraceRecord { segment, forward, row, layer, experts: experts.to_vec() }
    }

    #[test]
    fn write_then_parse_round_trips() {
        let records = vec![
            rec(0, 0, 0, 3, &[17, 201, 5]),
            rec(0, 0, 1, 3, &[5, 9]),
            rec(1, 7, 0, 78, &[]),
            rec(u32::MAX, u64::MAX, 2, 4, &[0]),
        ];
        let mut bytes = Vec::new();
        write_trace(&mut bytes, &records).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with(TRACE_HEADER));
        assert!(text.contains("\n0 0 0 3 17 201 5\n"), "{text}");
        assert_eq!(parse_trace(&text).unwrap(), records);
    }

    #[test]
    fn streaming_writer_numbers_rows() {
        let mut w = TraceWriter::new(Vec::new()).unwrap();
        w.write_routes(2, 5, 7, &[&[1, 2], &[2, 3]]).unwrap();
        let text = String::from_utf8(w.finish().unwrap()).unwrap();
        assert_eq!(parse_trace(&text).unwrap(), vec![rec(2, 5, 0, 7, &[1, 2]), rec(2, 5, 1, 7, &[2, 3])]);
    }

    #[test]
    fn parser_skips_comments_and_accepts_gates() {
        let text = "# comment\n\n  1 2 3 4 5:0.2500 6:0.1250  \r\n";
        assert_eq!(parse_trace(text).unwrap(), vec![rec(1, 2, 3, 4, &[5, 6])]);
    }

    #[test]
    fn malformed_lines_name_the_line_and_the_problem() {
        let cases = [
            ("0 0 0 3 1\n0 0\n", 2, "missing row"),
            ("x 0 0 3 1\n", 1, "invalid segment \"x\""),
            ("0 0 0 3 1 -2\n", 1, "invalid expert \"-2\""),
            ("0 0 0 3 1 a:0.5\n", 1, "invalid expert \"a:0.5\""),
            ("4294967296 0 0 3\n", 1, "segment 4294967296 is out of range"),
            ("0 0 0 -3 1\n", 1, "invalid layer \"-3\""),
        ];
        for (text, line, needle) in cases {
            let err = parse_trace(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
            assert!(err.to_string().starts_with(&format!("route trace line {line}:")));
        }
    }
}
