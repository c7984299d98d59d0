//! `ojs-bridge convert`: envelopes between OJS JSON, binary protobuf and
//! length-delimited protobuf streams.

use std::fmt;
use std::io::Write;

use ojs_core::envelope::stream::{decode_delimited, write_delimited};
use ojs_core::JobEnvelope;
use serde_json::Value;

/// Envelope formats the converter reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// OJS JSON: one envelope, or NDJSON (one per line) on input; NDJSON on output.
    Json,
    /// One binary `JobEnvelope`.
    Proto,
    /// Varint-length-delimited `JobEnvelope`s.
    ProtoDelimited,
}

/// What went wrong, and where: printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// An input envelope that does not decode.
    #[error("{location}: {error}")]
    Input {
        /// Where in the input.
        location: Location,
        /// What was wrong.
        error: ojs_core::Error,
    },
    /// An envelope that cannot be written in the output format.
    #[error("envelope {index}: cannot write as {format:?}: {error}")]
    Output {
        /// 1-based envelope number.
        index: usize,
        /// The output format.
        format: Format,
        /// Why.
        error: ojs_core::Error,
    },
    /// `--to proto` with other than exactly one envelope.
    #[error("--to proto writes exactly one envelope, the input has {0}; use --to proto-delimited for several")]
    NotExactlyOne(usize),
    /// Reading or writing failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// A place in the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// A JSON line (1-based).
    Line(usize),
    /// The nth envelope of a binary input (1-based).
    Envelope(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Envelope(n) => write!(f, "envelope {n}"),
        }
    }
}

/// Reads every envelope of `input` in `from`.
pub fn read_envelopes(input: &[u8], from: Format) -> Result<Vec<JobEnvelope>, ConvertError> {
    match from {
        Format::Json => read_json(input),
        Format::Proto => JobEnvelope::from_proto_bytes(input)
            .map(|j| vec![j])
            .map_err(|error| ConvertError::Input {
                location: Location::Envelope(1),
                error,
            }),
        Format::ProtoDelimited => decode_delimited(input)
            .enumerate()
            .map(|(i, r)| {
                r.map_err(|error| ConvertError::Input {
                    location: Location::Envelope(i + 1),
                    error,
                })
            })
            .collect(),
    }
}

fn line_at(input: &[u8], offset: usize) -> usize {
    1 + input[..offset.min(input.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

/// One pretty-printed envelope or NDJSON: any whitespace-separated sequence
/// of JSON objects.
fn read_json(input: &[u8]) -> Result<Vec<JobEnvelope>, ConvertError> {
    let mut stream = serde_json::Deserializer::from_slice(input).into_iter::<Value>();
    let mut jobs = Vec::new();
    loop {
        // Skip whitespace so the start offset names the envelope's own line.
        let rest = &input[stream.byte_offset()..];
        let start =
            stream.byte_offset() + rest.iter().take_while(|b| b.is_ascii_whitespace()).count();
        let Some(next) = stream.next() else { break };
        let line = line_at(input, start);
        let value = next.map_err(|e| ConvertError::Input {
            location: Location::Line(e.line()),
            error: ojs_core::Error::InvalidJson {
                line: None,
                reason: e.to_string(),
            },
        })?;
        let job = JobEnvelope::from_json_value(value).map_err(|error| ConvertError::Input {
            location: Location::Line(line),
            error,
        })?;
        jobs.push(job);
    }
    Ok(jobs)
}

/// Writes `jobs` in `to`; warns on `warn` about what JSON cannot carry.
pub fn write_envelopes(
    jobs: &[JobEnvelope],
    to: Format,
    out: &mut impl Write,
    warn: &mut impl Write,
) -> Result<(), ConvertError> {
    let output = |index: usize, error| ConvertError::Output {
        index: index + 1,
        format: to,
        error,
    };
    match to {
        Format::Json => {
            for (i, job) in jobs.iter().enumerate() {
                if job.has_unknown_fields() {
                    writeln!(
                        warn,
                        "warning: envelope {}: protobuf fields unknown to this build are dropped (JSON cannot carry them); convert proto to proto to keep them",
                        i + 1
                    )?;
                }
                let bytes = job.to_json_vec().map_err(|e| output(i, e))?;
                out.write_all(&bytes)?;
                out.write_all(b"\n")?;
            }
        }
        Format::Proto => {
            if jobs.len() != 1 {
                return Err(ConvertError::NotExactlyOne(jobs.len()));
            }
            let bytes = jobs[0].to_proto_bytes().map_err(|e| output(0, e))?;
            out.write_all(&bytes)?;
        }
        Format::ProtoDelimited => {
            let mut buf = Vec::new();
            for (i, job) in jobs.iter().enumerate() {
                write_delimited(&mut buf, job).map_err(|e| output(i, e))?;
            }
            out.write_all(&buf)?;
        }
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = r#"{"specversion":"1.0","id":"019539a4-b68c-7def-8000-1a2b3c4d5e6f","type":"email.send","queue":"default","args":["a"]}"#;

    #[test]
    fn pretty_single_and_ndjson_are_both_read() {
        let pretty =
            serde_json::to_string_pretty(&serde_json::from_str::<Value>(A).unwrap()).unwrap();
        assert_eq!(
            read_envelopes(pretty.as_bytes(), Format::Json)
                .unwrap()
                .len(),
            1
        );
        let ndjson = format!("{A}\n\n{A}\n");
        assert_eq!(
            read_envelopes(ndjson.as_bytes(), Format::Json)
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn errors_name_the_line() {
        let bad = A.replace("email.send", "bad type");
        let input = format!("{A}\n{bad}\n");
        let err = read_envelopes(input.as_bytes(), Format::Json).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("line 2: invalid attribute `type`"),
            "{err}"
        );
        let err = read_envelopes(b"{\n\"x\": }", Format::Json).unwrap_err();
        assert!(err.to_string().starts_with("line 2:"), "{err}");
    }

    #[test]
    fn proto_output_takes_exactly_one() {
        let jobs = read_envelopes(format!("{A}\n{A}").as_bytes(), Format::Json).unwrap();
        let err =
            write_envelopes(&jobs, Format::Proto, &mut Vec::new(), &mut Vec::new()).unwrap_err();
        assert!(matches!(err, ConvertError::NotExactlyOne(2)));
    }
}
