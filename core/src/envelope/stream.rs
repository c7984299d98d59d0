//! Length-delimited envelope streams (`…+proto; delimited=true`) and the
//! batch messages of docs/design.md §1.
//!
//! Each envelope is prefixed by its length as a protobuf varint: the standard
//! "delimited" format that protobuf libraries read and write (docs/design.md §2).

use crate::envelope::wire::{self, Reader, WT_LEN};
use crate::envelope::JobEnvelope;
use crate::error::{Error, Result};

/// Appends one envelope, varint-length-prefixed.
pub fn write_delimited(out: &mut Vec<u8>, job: &JobEnvelope) -> Result<()> {
    job.validate()?;
    if let Some(key) = job.unknown_attributes.keys().next() {
        return Err(Error::Unrepresentable(key.clone()));
    }
    wire::put_varint(out, job.proto_encoded_len() as u64);
    job.encode_proto_into(out)
}

/// Encodes envelopes as one delimited stream.
pub fn encode_delimited<'a>(jobs: impl IntoIterator<Item = &'a JobEnvelope>) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for job in jobs {
        write_delimited(&mut out, job)?;
    }
    Ok(out)
}

/// Iterates over the envelopes of a delimited stream. After the first error
/// (a truncated prefix or body, or an invalid envelope) the iterator ends.
pub fn decode_delimited(bytes: &[u8]) -> DelimitedIter<'_> {
    DelimitedIter {
        reader: Reader::new(bytes),
        failed: false,
    }
}

/// Iterator returned by [`decode_delimited`].
#[derive(Debug)]
pub struct DelimitedIter<'a> {
    reader: Reader<'a>,
    failed: bool,
}

impl Iterator for DelimitedIter<'_> {
    type Item = Result<JobEnvelope>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.reader.is_empty() {
            return None;
        }
        let at = self.reader.offset();
        let item = self.reader.sub().and_then(|mut sub| {
            JobEnvelope::from_proto_bytes(sub.rest()).map_err(|e| rebase(e, at))
        });
        self.failed = item.is_err();
        Some(item)
    }
}

/// Errors inside one envelope of a stream report their offset within it; say
/// where that envelope starts.
fn rebase(e: Error, stream_offset: usize) -> Error {
    match e {
        Error::MalformedProtobuf { offset, reason } => Error::MalformedProtobuf {
            offset,
            reason: format!("{reason} (in the envelope starting at byte {stream_offset})"),
        },
        other => other,
    }
}

/// Encodes a `BatchEnqueueRequest` (field 1: repeated `JobEnvelope`).
pub fn encode_batch(jobs: &[JobEnvelope]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for job in jobs {
        job.validate()?;
        wire::put_len_header(&mut out, 1, job.proto_encoded_len());
        job.encode_proto_into(&mut out)?;
    }
    Ok(out)
}

/// The bytes of each `JobEnvelope` of a `BatchEnqueueRequest`, undecoded:
/// for a server that fills system fields before it validates a job.
pub fn split_batch(bytes: &[u8]) -> Result<Vec<&[u8]>> {
    let mut r = Reader::new(bytes);
    let mut jobs = Vec::new();
    while !r.is_empty() {
        let (field, wt) = r.key()?;
        if field == 1 {
            r.expect("jobs", wt, WT_LEN)?;
            jobs.push(r.sub()?.rest());
        } else {
            r.skip(field, wt)?;
        }
    }
    Ok(jobs)
}

/// Decodes a `BatchEnqueueRequest`. Each job is validated on its own:
/// the outer error is for bytes that are not a batch at all, the inner
/// results say which jobs are invalid.
pub fn decode_batch(bytes: &[u8]) -> Result<Vec<Result<JobEnvelope>>> {
    let mut r = Reader::new(bytes);
    let mut jobs = Vec::new();
    while !r.is_empty() {
        let (field, wt) = r.key()?;
        if field == 1 {
            r.expect("jobs", wt, WT_LEN)?;
            jobs.push(JobEnvelope::from_proto_bytes(r.sub()?.rest()));
        } else {
            r.skip(field, wt)?;
        }
    }
    Ok(jobs)
}
