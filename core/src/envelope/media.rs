//! Media types (docs/design.md §2) and content negotiation.

use std::fmt;

use crate::envelope::stream;
use crate::envelope::JobEnvelope;
use crate::error::{Error, Result};

/// `application/openjobspec+proto`: one binary envelope.
pub const OJS_PROTO: &str = "application/openjobspec+proto";
/// `application/openjobspec+proto; delimited=true`: varint-delimited envelopes.
pub const OJS_PROTO_DELIMITED: &str = "application/openjobspec+proto; delimited=true";
/// `application/openjobspec+json`: one OJS JSON envelope.
pub const OJS_JSON: &str = "application/openjobspec+json";
/// `application/json`: accepted on input as OJS JSON.
pub const JSON: &str = "application/json";
/// `application/grpcq+proto`: one binary `grpcq.Message` (our label).
pub const GRPCQ_PROTO: &str = "application/grpcq+proto";

/// What a message body is, as named by its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// One binary `JobEnvelope`.
    OjsProto,
    /// A stream of length-delimited `JobEnvelope`s.
    OjsProtoDelimited,
    /// One OJS JSON envelope.
    OjsJson,
    /// One binary `grpcq.Message`.
    GrpcqProto,
}

impl Encoding {
    /// The canonical media type written on outgoing messages.
    pub fn media_type(self) -> &'static str {
        match self {
            Encoding::OjsProto => OJS_PROTO,
            Encoding::OjsProtoDelimited => OJS_PROTO_DELIMITED,
            Encoding::OjsJson => OJS_JSON,
            Encoding::GrpcqProto => GRPCQ_PROTO,
        }
    }

    /// Parses a `Content-Type` value. Type and parameter names are
    /// case-insensitive; `charset` is ignored; anything else is
    /// [`Error::UnknownContentType`].
    pub fn from_content_type(content_type: &str) -> Result<Encoding> {
        // What this bridge writes, as it writes it: no parsing, no
        // lowercased copy (this runs for every message).
        match content_type {
            OJS_PROTO => return Ok(Encoding::OjsProto),
            GRPCQ_PROTO => return Ok(Encoding::GrpcqProto),
            OJS_JSON => return Ok(Encoding::OjsJson),
            _ => {}
        }
        let unknown = || Error::UnknownContentType(content_type.to_owned());
        let mut parts = content_type.split(';');
        let essence = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let mut delimited = false;
        for param in parts {
            let param = param.trim();
            if param.is_empty() {
                continue;
            }
            let (name, value) = param.split_once('=').ok_or_else(unknown)?;
            let value = value.trim().trim_matches('"');
            match name.trim().to_ascii_lowercase().as_str() {
                "delimited" if value.eq_ignore_ascii_case("true") => delimited = true,
                "delimited" if value.eq_ignore_ascii_case("false") => delimited = false,
                "charset" => {}
                _ => return Err(unknown()),
            }
        }
        match (essence.as_str(), delimited) {
            ("application/openjobspec+proto", false) => Ok(Encoding::OjsProto),
            ("application/openjobspec+proto", true) => Ok(Encoding::OjsProtoDelimited),
            ("application/openjobspec+json" | "application/json", false) => Ok(Encoding::OjsJson),
            ("application/grpcq+proto", false) => Ok(Encoding::GrpcqProto),
            _ => Err(unknown()),
        }
    }

    /// Content negotiation over an `Accept`-style list of envelope encodings.
    ///
    /// JSON when the list is empty or accepts anything (the baseline); the
    /// highest `q` wins, earlier entries win ties; `q=0` excludes.
    /// [`Error::NotAcceptable`] when nothing offered is supported.
    pub fn negotiate(accept: &str) -> Result<Encoding> {
        if accept.trim().is_empty() {
            return Ok(Encoding::OjsJson);
        }
        let mut best: Option<(f32, Encoding)> = None;
        for item in accept.split(',') {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (media, q) = split_q(item);
            if q <= 0.0 {
                continue;
            }
            let essence = media
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            let candidate = match essence.as_str() {
                "*/*" | "application/*" => Some(Encoding::OjsJson),
                _ => Encoding::from_content_type(&media)
                    .ok()
                    .filter(|e| *e != Encoding::GrpcqProto),
            };
            if let Some(enc) = candidate {
                if best.is_none_or(|(bq, _)| q > bq) {
                    best = Some((q, enc));
                }
            }
        }
        best.map(|(_, e)| e)
            .ok_or_else(|| Error::NotAcceptable(accept.to_owned()))
    }

    /// Decodes one body of this encoding into envelopes (one, or many for a
    /// delimited stream). grpcq bodies are not envelopes and are rejected.
    pub fn decode_envelopes(self, body: &[u8]) -> Result<Vec<JobEnvelope>> {
        match self {
            Encoding::OjsProto => Ok(vec![JobEnvelope::from_proto_bytes(body)?]),
            Encoding::OjsJson => Ok(vec![JobEnvelope::from_json_slice(body)?]),
            Encoding::OjsProtoDelimited => stream::decode_delimited(body).collect(),
            Encoding::GrpcqProto => Err(Error::UnknownContentType(format!(
                "{GRPCQ_PROTO} carries a grpcq call, not an OJS envelope"
            ))),
        }
    }
}

/// Splits `q=` off an Accept item, keeping the other parameters.
fn split_q(item: &str) -> (String, f32) {
    let mut q = 1.0;
    let mut kept = Vec::new();
    for (i, part) in item.split(';').enumerate() {
        let trimmed = part.trim();
        if i > 0 {
            if let Some(v) = trimmed
                .strip_prefix("q=")
                .or_else(|| trimmed.strip_prefix("Q="))
            {
                q = v.trim().parse().unwrap_or(0.0);
                continue;
            }
        }
        kept.push(trimmed);
    }
    (kept.join("; "), q)
}

impl fmt::Display for Encoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.media_type())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_media_type_and_rejects_others() {
        assert_eq!(
            Encoding::from_content_type(OJS_PROTO).unwrap(),
            Encoding::OjsProto
        );
        assert_eq!(
            Encoding::from_content_type("Application/OpenJobSpec+Proto;Delimited=TRUE").unwrap(),
            Encoding::OjsProtoDelimited
        );
        assert_eq!(
            Encoding::from_content_type("application/json; charset=utf-8").unwrap(),
            Encoding::OjsJson
        );
        assert_eq!(
            Encoding::from_content_type(GRPCQ_PROTO).unwrap(),
            Encoding::GrpcqProto
        );
        for bad in [
            "text/plain",
            "application/openjobspec+xml",
            "application/openjobspec+proto; foo=bar",
            "",
        ] {
            let err = Encoding::from_content_type(bad).unwrap_err();
            assert!(
                matches!(err, Error::UnknownContentType(ref s) if s == bad),
                "{bad}: {err}"
            );
        }
        for e in [
            Encoding::OjsProto,
            Encoding::OjsProtoDelimited,
            Encoding::OjsJson,
            Encoding::GrpcqProto,
        ] {
            assert_eq!(Encoding::from_content_type(e.media_type()).unwrap(), e);
        }
    }

    #[test]
    fn negotiation_follows_the_spec() {
        assert_eq!(Encoding::negotiate("").unwrap(), Encoding::OjsJson);
        assert_eq!(Encoding::negotiate("*/*").unwrap(), Encoding::OjsJson);
        assert_eq!(Encoding::negotiate(OJS_PROTO).unwrap(), Encoding::OjsProto);
        assert_eq!(
            Encoding::negotiate(
                "application/openjobspec+json;q=0.5, application/openjobspec+proto"
            )
            .unwrap(),
            Encoding::OjsProto
        );
        assert_eq!(
            Encoding::negotiate("text/html, application/openjobspec+proto;q=0.2, */*;q=0.1")
                .unwrap(),
            Encoding::OjsProto
        );
        assert_eq!(
            Encoding::negotiate("application/openjobspec+proto; delimited=true").unwrap(),
            Encoding::OjsProtoDelimited
        );
        assert!(matches!(
            Encoding::negotiate("text/html"),
            Err(Error::NotAcceptable(_))
        ));
        assert!(matches!(
            Encoding::negotiate("application/openjobspec+proto;q=0"),
            Err(Error::NotAcceptable(_))
        ));
    }
}
