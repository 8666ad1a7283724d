//! Route traces: every routing decision, one record per (forward, batch row, layer),
//! observed before batch-union dedup.
//!
//! Two text formats, one record per line, whitespace-separated; readers take either
//! (and a mix), deciding per line.
//!
//! strata's v1 (`segment forward row layer experts...`):
//!
//! ```text
//! # strata route trace v1: segment forward row layer experts...
//! 0 0 0 3 17 201 5 88 140 9 33 60
//! ```
//!
//! `segment` is the turn (LFRU heat halves between segments), `forward` numbers the
//! model forwards, `row` the batch row within the forward, `layer` the model layer id,
//! then the row's selected expert ids in router rank order. An expert may be written as
//! `id:gate`; the gate is checked and ignored.
//!
//! The reference (C engine) format, v2 here (`call row layer id:gate...`):
//!
//! ```text
//! # strata route trace v2 (reference format): call row layer id:gate...
//! # segment 0
//! 0 0 3 17:0.2500 201:0.1250 5:0.0625
//! ```
//!
//! `call` numbers MoE calls (one per layer per forward), then the batch row, the layer,
//! and each selected expert as `id:gate` with the gate (routing weight) written with 4
//! decimals. strata's superset: a comment line `# segment N` sets the turn of the lines
//! that follow (0 before any); other readers skip it as a comment. A reference line is
//! read as a record with `forward = call`.
//!
//! Detection: a line whose fourth field has no `:` is v1 (it has at least four integer
//! fields); otherwise (fewer than four fields, or `id:gate` from the fourth on) it is
//! the reference format. Blank lines and other lines starting with `#` are skipped.

use std::fmt;
use std::io::{self, BufRead, Write};

use serde::Serialize;

/// The header line [`TraceWriter::new`] starts a v1 trace with.
pub const TRACE_HEADER: &str = "# strata route trace v1: segment forward row layer experts...";
/// The header line [`TraceWriter::new_gated`] starts a reference-format trace with.
pub const GATED_TRACE_HEADER: &str = "# strata route trace v2 (reference format): call row layer id:gate...";
/// The comment that sets the segment of the reference-format lines after it.
const SEGMENT_COMMENT: &str = "# segment ";

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

    /// Parses one line of either format; `Ok(None)` for blank and comment lines.
    /// Reference-format lines get segment 0 (see [`read_trace`] for `# segment N`).
    pub fn parse_line(line: &str) -> Result<Option<TraceRecord>, String> {
        Self::parse_line_in(line, 0)
    }

    fn parse_line_in(line: &str, segment: u32) -> Result<Option<TraceRecord>, String> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return Ok(None);
        }
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let v1 = tokens.get(3).is_some_and(|t| !t.contains(':'));
        let names: &[&str] = if v1 { &["segment", "forward", "row", "layer"] } else { &["call", "row", "layer"] };
        let expected = if v1 { "`segment forward row layer experts...`" } else { "`call row layer id:gate...`" };
        let mut header = Vec::with_capacity(4);
        for (i, name) in names.iter().enumerate() {
            let field = tokens.get(i).ok_or_else(|| format!("missing {name}: expected {expected}"))?;
            header.push(field.parse::<u64>().map_err(|_| format!("invalid {name} {field:?}"))?);
        }
        let (segment, forward, row, layer) = if v1 {
            (header[0], header[1], header[2], header[3])
        } else {
            (segment as u64, header[0], header[1], header[2])
        };
        let segment = u32::try_from(segment).map_err(|_| format!("segment {segment} is out of range"))?;
        let row = u32::try_from(row).map_err(|_| format!("row {row} is out of range"))?;
        let layer = usize::try_from(layer).map_err(|_| format!("layer {layer} is out of range"))?;
        let experts = tokens[names.len()..]
            .iter()
            .map(|token| {
                let (id, gate) = match token.split_once(':') {
                    Some((id, gate)) => (id, Some(gate)),
                    None if v1 => (*token, None),
                    None => return Err(format!("invalid expert {token:?}: expected `id:gate`")),
                };
                if let Some(gate) = gate {
                    gate.parse::<f32>().map_err(|_| format!("invalid gate in {token:?}"))?;
                }
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
    let mut segment = 0u32;
    for (index, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| TraceError { line: 0, message: e.to_string() })?;
        if let Some(n) = line.trim().strip_prefix(SEGMENT_COMMENT) {
            segment = n.trim().parse().map_err(|_| TraceError {
                line: index + 1,
                message: format!("invalid segment {:?} in `# segment N`", n.trim()),
            })?;
            continue;
        }
        match TraceRecord::parse_line_in(&line, segment) {
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

    /// Starts a reference-format trace (`call row layer id:gate...`): writes its header
    /// line. Write records with [`Self::write_gated`], turns with [`Self::segment`].
    pub fn new_gated(mut out: W) -> io::Result<Self> {
        writeln!(out, "{GATED_TRACE_HEADER}")?;
        Ok(TraceWriter { out })
    }

    /// Marks the start of turn `segment` in a reference-format trace (`# segment N`).
    pub fn segment(&mut self, segment: u32) -> io::Result<()> {
        writeln!(self.out, "{SEGMENT_COMMENT}{segment}")
    }

    /// Records every row of one MoE call in the reference format: `rows[row]` is that
    /// row's (expert ids, gate weights) in router rank order; gates are written with 4
    /// decimals. Fails (writing nothing) when a row's ids and gates differ in length.
    pub fn write_gated(&mut self, call: u64, layer: usize, rows: &[(&[usize], &[f32])]) -> io::Result<()> {
        if let Some((row, (ids, gates))) = rows.iter().enumerate().find(|(_, (i, g))| i.len() != g.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "route trace: call {call} layer {layer} row {row}: {} experts but {} gates",
                    ids.len(),
                    gates.len()
                ),
            ));
        }
        for (row, (ids, gates)) in rows.iter().enumerate() {
            write!(self.out, "{call} {row} {layer}")?;
            for (e, g) in ids.iter().zip(gates.iter()) {
                write!(self.out, " {e}:{g:.4}")?;
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
    fn reference_format_round_trips_and_is_detected_per_line() {
        let mut w = TraceWriter::new_gated(Vec::new()).unwrap();
        w.segment(0).unwrap();
        w.write_gated(0, 3, &[(&[17, 201], &[0.25, 0.125]), (&[5, 17], &[0.7, 0.3])]).unwrap();
        w.write_gated(1, 4, &[(&[9], &[1.0 / 3.0])]).unwrap();
        w.segment(2).unwrap();
        w.write_gated(2, 3, &[(&[], &[])]).unwrap();
        let text = String::from_utf8(w.finish().unwrap()).unwrap();
        assert!(text.starts_with(GATED_TRACE_HEADER), "{text}");
        assert!(text.contains("\n0 0 3 17:0.2500 201:0.1250\n"), "{text}");
        assert!(text.contains("\n1 0 4 9:0.3333\n"), "{text}");
        assert!(text.contains("\n# segment 2\n2 0 3\n"), "{text}");
        assert_eq!(
            parse_trace(&text).unwrap(),
            vec![rec(0, 0, 0, 3, &[17, 201]), rec(0, 0, 1, 3, &[5, 17]), rec(0, 1, 0, 4, &[9]), rec(2, 2, 0, 3, &[])]
        );
        // Both formats in one file: v1 keeps its own segment.
        let mixed = "7 9 0 3 1 2\n4 0 5 6:0.5000\n";
        assert_eq!(parse_trace(mixed).unwrap(), vec![rec(7, 9, 0, 3, &[1, 2]), rec(0, 4, 0, 5, &[6])]);
        // Mismatched ids and gates are refused before anything is written.
        let mut w = TraceWriter::new_gated(Vec::new()).unwrap();
        assert!(w.write_gated(0, 3, &[(&[1, 2], &[0.5])]).is_err());
        assert_eq!(String::from_utf8(w.finish().unwrap()).unwrap(), format!("{GATED_TRACE_HEADER}\n"));
    }

    #[test]
    fn malformed_lines_name_the_line_and_the_problem() {
        let cases = [
            ("0 0 0 3 1\n0 0\n", 2, "missing layer"),
            ("x 0 0 3 1\n", 1, "invalid segment \"x\""),
            ("0 0 0 3 1 -2\n", 1, "invalid expert \"-2\""),
            ("0 0 0 3 1 a:0.5\n", 1, "invalid expert \"a:0.5\""),
            ("4294967296 0 0 3\n", 1, "segment 4294967296 is out of range"),
            ("0 0 0 -3 1\n", 1, "invalid layer \"-3\""),
            ("0 0 3 5:x\n", 1, "invalid gate in \"5:x\""),
            ("0 0 3 5:0.5 6\n", 1, "invalid expert \"6\": expected `id:gate`"),
            ("0 0\n", 1, "missing layer: expected `call row layer id:gate...`"),
            ("# segment x\n", 1, "invalid segment \"x\""),
        ];
        for (text, line, needle) in cases {
            let err = parse_trace(text).unwrap_err();
            assert_eq!(err.line, line, "{text:?}: {err}");
            assert!(err.to_string().contains(needle), "{text:?}: {err}");
            assert!(err.to_string().starts_with(&format!("route trace line {line}:")));
        }
    }
}
