//! grpcq request payloads ↔ proto3 JSON, driven by a FileDescriptorSet.

use std::path::Path;

use ojs_core::mapping::TranscodedPayload;
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};
use serde_json::Value;

/// Transcodes payloads of one route.
#[derive(Debug, Clone)]
pub struct Transcoder {
    pool: DescriptorPool,
    /// The configured request type; otherwise looked up per call.
    fixed: Option<MessageDescriptor>,
}

impl Transcoder {
    /// Loads a FileDescriptorSet file; `message_type`, when given, must be
    /// in it.
    pub fn load(path: &Path, message_type: Option<&str>) -> Result<Self, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::from_bytes(&bytes, message_type).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A FileDescriptorSet's bytes; `message_type`, when given, must be in
    /// it.
    pub fn from_bytes(bytes: &[u8], message_type: Option<&str>) -> Result<Self, String> {
        // prost-reflect 0.16 panics (an index out of bounds while it words
        // the error) on a file whose `syntax` it does not know, such as
        // "editions": such a set is refused here first, by name. Found by
        // the descriptor_transcode fuzz target.
        let set = prost_types::FileDescriptorSet::decode(bytes)
            .map_err(|e| format!("not a protobuf FileDescriptorSet: {e}"))?;
        if let Some(file) = set
            .file
            .iter()
            .find(|f| !matches!(f.syntax.as_deref(), None | Some("proto2") | Some("proto3")))
        {
            return Err(format!(
                "file {:?} has syntax {:?}; only proto2 and proto3 descriptor sets are supported",
                file.name(),
                file.syntax()
            ));
        }
        let pool = DescriptorPool::decode(bytes)
            .map_err(|e| format!("not a protobuf FileDescriptorSet: {e}"))?;
        let fixed = match message_type {
            Some(name) => Some(
                pool.get_message_by_name(name)
                    .ok_or_else(|| format!("message type {name:?} is not in the descriptor set"))?,
            ),
            None => None,
        };
        Ok(Transcoder { pool, fixed })
    }

    /// The same set with `message_type` as the fixed request type.
    pub fn for_type(&self, message_type: &str) -> Option<Self> {
        Some(Transcoder {
            pool: self.pool.clone(),
            fixed: Some(self.pool.get_message_by_name(message_type)?),
        })
    }

    /// Full names of the message types in the set, in pool order.
    pub fn message_types(&self) -> impl Iterator<Item = String> + '_ {
        self.pool.all_messages().map(|m| m.full_name().to_owned())
    }

    /// The request type of a call: the configured one, else the input of
    /// method `action` of service `topic`.
    fn request_type(&self, topic: &str, action: &str) -> Result<MessageDescriptor, String> {
        if let Some(d) = &self.fixed {
            return Ok(d.clone());
        }
        let service = self
            .pool
            .get_service_by_name(topic)
            .ok_or_else(|| format!("service {topic:?} is not in the descriptor set"))?;
        let method = service
            .methods()
            .find(|m| m.name() == action)
            .ok_or_else(|| format!("service {topic:?} has no method {action:?}"))?;
        Ok(method.input())
    }

    /// The request as proto3 JSON. `Ok(None)` when JSON cannot carry it
    /// exactly (unknown fields, non-canonical encoding): the caller then
    /// carries the bytes as base64url so nothing is lost.
    pub fn to_json(
        &self,
        topic: &str,
        action: &str,
        payload: &[u8],
    ) -> Result<Option<TranscodedPayload>, String> {
        let desc = self.request_type(topic, action)?;
        let msg = DynamicMessage::decode(desc.clone(), payload)
            .map_err(|e| format!("payload is not a {}: {e}", desc.full_name()))?;
        let json = serde_json::to_value(&msg).map_err(|e| format!("{}: {e}", desc.full_name()))?;
        // Proof of losslessness: the JSON must give back the same bytes.
        let back = DynamicMessage::deserialize(desc.clone(), &json)
            .map(|m| m.encode_to_vec())
            .ok();
        if back.as_deref() != Some(payload) {
            return Ok(None);
        }
        Ok(Some(TranscodedPayload {
            json,
            message_type: desc.full_name().to_owned(),
        }))
    }

    /// The request bytes of proto3 JSON. `message_type` (from the job's
    /// meta) wins over the route's lookup.
    pub fn from_json(
        &self,
        json: &Value,
        message_type: Option<&str>,
        topic: &str,
        action: &str,
    ) -> Result<Vec<u8>, String> {
        let desc = match message_type {
            Some(name) => self
                .pool
                .get_message_by_name(name)
                .ok_or_else(|| format!("message type {name:?} is not in the descriptor set"))?,
            None => self.request_type(topic, action)?,
        };
        DynamicMessage::deserialize(desc.clone(), json)
            .map(|m| m.encode_to_vec())
            .map_err(|e| format!("args are not a proto3 JSON {}: {e}", desc.full_name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with a syntax prost-reflect does not know is an error that
    /// names it, not a panic (prost-reflect 0.16 panics on it).
    #[test]
    fn an_unknown_syntax_is_refused_by_name() {
        let set = prost_types::FileDescriptorSet {
            file: vec![prost_types::FileDescriptorProto {
                name: Some("a.proto".into()),
                syntax: Some("editions".into()),
                ..Default::default()
            }],
        };
        let err = Transcoder::from_bytes(&set.encode_to_vec(), None).unwrap_err();
        assert!(err.contains("a.proto") && err.contains("editions"), "{err}");
        assert!(Transcoder::from_bytes(b"\xff\xff", None).is_err());
    }
}
