//! grpcq request payloads ↔ proto3 JSON, driven by a FileDescriptorSet.

use std::path::Path;

use ojs_grpcq::mapping::TranscodedPayload;
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, ReflectMessage};
use serde_json::Value;

/// Transcodes payloads of one route.
#[derive(Debug, Clone)]
pub struct Transcoder {
    pool: DescriptorPool,
    /// The configured request type; otherwise looked up per call.
    fixed: Option<MessageDescriptor>,
    /// Whether the set defines google.protobuf.Any (see [`too_deep`]).
    has_any: bool,
}

/// Deepest message nesting a payload may have to be carried as JSON: the
/// recursion limit protobuf decoders (prost among them) apply.
const MAX_NESTING: usize = 100;

/// Whether `msg` nests messages deeper than `budget`, counting the message
/// packed in each google.protobuf.Any as the levels it holds. prost-reflect
/// decodes an Any's value afresh while it writes JSON, so protobuf's
/// recursion limit does not bound an Any in an Any in an Any…: a payload of
/// a few hundred KiB of them overflowed a thread's stack (found by the
/// descriptor_transcode fuzz target). This walk is itself bounded by
/// `budget`.
fn too_deep(msg: &DynamicMessage, budget: usize) -> bool {
    use prost_reflect::{MapKey, Value as V};
    let Some(budget) = budget.checked_sub(1) else {
        return true;
    };
    let desc = msg.descriptor();
    if desc.full_name() == "google.protobuf.Any" {
        // Read as prost-reflect's JSON writer reads it (re-encoded and
        // decoded as prost_types::Any, whatever the set declares the fields
        // as): a set whose "Any" declares `value` as a message or
        // `type_url` as bytes gets expanded all the same.
        let Ok(prost_types::Any {
            type_url: url,
            value,
        }) = msg.transcode_to::<prost_types::Any>()
        else {
            return false;
        };
        let name = url.rsplit('/').next().unwrap_or_default();
        let Some(packed) = desc.parent_pool().get_message_by_name(name) else {
            return false;
        };
        // Undecodable: prost-reflect's JSON fails the same way, no deeper.
        return match DynamicMessage::decode(packed, value.as_slice()) {
            Ok(inner) => too_deep(&inner, budget),
            Err(_) => false,
        };
    }
    let nested = |v: &V| match v {
        V::Message(m) => too_deep(m, budget),
        V::List(items) => items
            .iter()
            .any(|i| matches!(i, V::Message(m) if too_deep(m, budget))),
        V::Map(entries) => entries
            .iter()
            .any(|(_, i): (&MapKey, &V)| matches!(i, V::Message(m) if too_deep(m, budget))),
        _ => false,
    };
    msg.fields().any(|(_, v)| nested(v))
}

/// The key types protobuf allows in a map.
fn valid_map_key(kind: &prost_reflect::Kind) -> bool {
    use prost_reflect::Kind as K;
    matches!(
        kind,
        K::Int32
            | K::Sint32
            | K::Sfixed32
            | K::Int64
            | K::Sint64
            | K::Sfixed64
            | K::Uint32
            | K::Fixed32
            | K::Uint64
            | K::Fixed64
            | K::Bool
            | K::String
    )
}

/// A file of `set` that imports itself, directly or through others. protoc
/// refuses import cycles; prost-reflect 0.16 follows a cycle of public
/// imports until the stack overflows (found by the descriptor_transcode fuzz
/// target). Iterative, so the check itself cannot overflow.
fn import_cycle(set: &prost_types::FileDescriptorSet) -> Option<&str> {
    use std::collections::HashMap;
    let index: HashMap<&str, usize> = set
        .file
        .iter()
        .enumerate()
        .map(|(i, f)| (f.name(), i))
        .collect();
    let deps = |i: usize| {
        set.file[i]
            .dependency
            .iter()
            .filter_map(|d| index.get(d.as_str()).copied())
    };
    // 0 unvisited, 1 on the current path, 2 done.
    let mut state = vec![0u8; set.file.len()];
    for start in 0..set.file.len() {
        if state[start] != 0 {
            continue;
        }
        let mut stack = vec![(start, deps(start).collect::<Vec<_>>())];
        state[start] = 1;
        while let Some((node, pending)) = stack.last_mut() {
            match pending.pop() {
                Some(next) if state[next] == 1 => return Some(set.file[next].name()),
                Some(next) if state[next] == 0 => {
                    state[next] = 1;
                    stack.push((next, deps(next).collect()));
                }
                Some(_) => {}
                None => {
                    state[*node] = 2;
                    stack.pop();
                }
            }
        }
    }
    None
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
        if let Some(name) = import_cycle(&set) {
            return Err(format!(
                "file {name:?} imports itself, directly or through other files (an import cycle)"
            ));
        }
        let pool = DescriptorPool::decode(bytes)
            .map_err(|e| format!("not a protobuf FileDescriptorSet: {e}"))?;
        // prost-reflect 0.16 accepts a map entry type without its key or
        // value field, or with a key type protobuf does not allow (a float,
        // bytes, a message), then panics decoding any payload that uses the
        // map (found by the same fuzz target): refused here, by name.
        if let Some(entry) = pool.all_messages().find(|m| {
            m.is_map_entry()
                && (m.get_field(2).is_none()
                    || !m.get_field(1).is_some_and(|key| valid_map_key(&key.kind())))
        }) {
            return Err(format!(
                "map entry type {} lacks its value field (2) or a key field (1) of an integer, bool or string type",
                entry.full_name()
            ));
        }
        let fixed = match message_type {
            Some(name) => Some(
                pool.get_message_by_name(name)
                    .ok_or_else(|| format!("message type {name:?} is not in the descriptor set"))?,
            ),
            None => None,
        };
        let has_any = pool.get_message_by_name("google.protobuf.Any").is_some();
        Ok(Transcoder {
            pool,
            fixed,
            has_any,
        })
    }

    /// The same set with `message_type` as the fixed request type.
    pub fn for_type(&self, message_type: &str) -> Option<Self> {
        Some(Transcoder {
            pool: self.pool.clone(),
            fixed: Some(self.pool.get_message_by_name(message_type)?),
            has_any: self.has_any,
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
        if self.has_any && too_deep(&msg, MAX_NESTING) {
            // Carried as bytes (lossless), never expanded.
            return Ok(None);
        }
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
    fn descriptor_sets_that_would_panic_prost_reflect_are_refused_by_name() {
        let set = prost_types::FileDescriptorSet {
            file: vec![prost_types::FileDescriptorProto {
                name: Some("a.proto".into()),
                syntax: Some("editions".into()),
                ..Default::default()
            }],
        };
        let err = Transcoder::from_bytes(&set.encode_to_vec(), None).unwrap_err();
        assert!(err.contains("a.proto") && err.contains("editions"), "{err}");
        // A map entry without its value field (prost-reflect panics on it).
        use prost_types::field_descriptor_proto::{Label, Type};
        let field = |name: &str, number: i32, kind: Type, label: Label, type_name: Option<&str>| {
            prost_types::FieldDescriptorProto {
                name: Some(name.into()),
                number: Some(number),
                label: Some(label as i32),
                r#type: Some(kind as i32),
                type_name: type_name.map(str::to_owned),
                json_name: Some(name.into()),
                ..Default::default()
            }
        };
        let set = prost_types::FileDescriptorSet {
            file: vec![prost_types::FileDescriptorProto {
                name: Some("m.proto".into()),
                package: Some("p".into()),
                syntax: Some("proto3".into()),
                message_type: vec![prost_types::DescriptorProto {
                    name: Some("M".into()),
                    field: vec![field(
                        "meta",
                        1,
                        Type::Message,
                        Label::Repeated,
                        Some(".p.M.MetaEntry"),
                    )],
                    nested_type: vec![prost_types::DescriptorProto {
                        name: Some("MetaEntry".into()),
                        field: vec![field("key", 1, Type::String, Label::Optional, None)],
                        options: Some(prost_types::MessageOptions {
                            map_entry: Some(true),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        match Transcoder::from_bytes(&set.encode_to_vec(), None) {
            Err(err) => assert!(err.contains("p.M.MetaEntry"), "{err}"),
            // If prost-reflect itself refuses it one day, fine too; it must
            // not get as far as decoding.
            Ok(_) => panic!("a map entry without a value field was accepted"),
        }
        // A map entry whose key is bytes (protobuf forbids it).
        let mut bytes_key = set.clone();
        bytes_key.file[0].message_type[0].nested_type[0].field = vec![
            field("key", 1, Type::Bytes, Label::Optional, None),
            field("value", 2, Type::String, Label::Optional, None),
        ];
        match Transcoder::from_bytes(&bytes_key.encode_to_vec(), None) {
            Err(err) => assert!(err.contains("p.M.MetaEntry"), "{err}"),
            Ok(_) => panic!("a map entry with a bytes key was accepted"),
        }
        // The same entry with a string key is fine.
        let mut good = bytes_key.clone();
        good.file[0].message_type[0].nested_type[0].field[0] =
            field("key", 1, Type::String, Label::Optional, None);
        let t = Transcoder::from_bytes(&good.encode_to_vec(), Some("p.M")).unwrap();
        let json = t
            .to_json("", "", &[0x0A, 6, 0x0A, 1, b'k', 0x12, 1, b'v'])
            .unwrap()
            .unwrap();
        assert_eq!(json.json["meta"]["k"], "v");
        assert!(Transcoder::from_bytes(b"\xff\xff", None).is_err());
    }

    /// Files that import themselves, directly or in a ring, publicly: an
    /// error naming the file, not a stack overflow.
    #[test]
    fn import_cycles_are_refused_by_name() {
        let file = |name: &str, dep: &str| prost_types::FileDescriptorProto {
            name: Some(name.into()),
            dependency: vec![dep.into()],
            public_dependency: vec![0],
            ..Default::default()
        };
        for files in [
            vec![file("a.proto", "a.proto")],
            vec![
                file("a.proto", "b.proto"),
                file("b.proto", "c.proto"),
                file("c.proto", "a.proto"),
            ],
        ] {
            let set = prost_types::FileDescriptorSet { file: files };
            let err = Transcoder::from_bytes(&set.encode_to_vec(), None).unwrap_err();
            assert!(
                err.contains("import cycle") && err.contains(".proto"),
                "{err}"
            );
        }
        // A chain is fine.
        let set = prost_types::FileDescriptorSet {
            file: vec![
                file("a.proto", "b.proto"),
                prost_types::FileDescriptorProto {
                    name: Some("b.proto".into()),
                    ..Default::default()
                },
            ],
        };
        assert!(Transcoder::from_bytes(&set.encode_to_vec(), None).is_ok());
    }

    /// A proto2 group field of its own message type, nested thousands
    /// deep (two bytes a level).
    #[test]
    fn groups_nested_thousands_deep_are_not_a_stack_overflow() {
        use prost_types::field_descriptor_proto::{Label, Type};
        let set = prost_types::FileDescriptorSet {
            file: vec![prost_types::FileDescriptorProto {
                name: Some("g.proto".into()),
                package: Some("p".into()),
                syntax: Some("proto2".into()),
                message_type: vec![prost_types::DescriptorProto {
                    name: Some("G".into()),
                    field: vec![prost_types::FieldDescriptorProto {
                        name: Some("g".into()),
                        number: Some(1),
                        label: Some(Label::Optional as i32),
                        r#type: Some(Type::Group as i32),
                        type_name: Some(".p.G".into()),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        };
        let t = Transcoder::from_bytes(&set.encode_to_vec(), Some("p.G")).unwrap();
        let depth = 30_000;
        let mut payload = vec![0x0B; depth];
        payload.extend(std::iter::repeat_n(0x0C, depth));
        // prost's recursion limit covers known groups: an error, no crash.
        let err = t.to_json("", "", &payload).unwrap_err();
        assert!(err.contains("recursion limit"), "{err}");
    }

    /// A google.protobuf.Any nested in Any thousands deep: prost-reflect
    /// decodes each Any's value afresh while it writes JSON, so protobuf's
    /// recursion limit does not bound the depth.
    #[test]
    fn any_nested_thousands_deep_is_not_a_stack_overflow() {
        use prost_types::field_descriptor_proto::{Label, Type};
        let field = |name: &str, number: i32, kind: Type| prost_types::FieldDescriptorProto {
            name: Some(name.into()),
            number: Some(number),
            label: Some(Label::Optional as i32),
            r#type: Some(kind as i32),
            json_name: Some(name.into()),
            ..Default::default()
        };
        let set = prost_types::FileDescriptorSet {
            file: vec![prost_types::FileDescriptorProto {
                name: Some("google/protobuf/any.proto".into()),
                package: Some("google.protobuf".into()),
                syntax: Some("proto3".into()),
                message_type: vec![
                    prost_types::DescriptorProto {
                        name: Some("Any".into()),
                        field: vec![
                            field("type_url", 1, Type::String),
                            field("value", 2, Type::Bytes),
                        ],
                        ..Default::default()
                    },
                    prost_types::DescriptorProto {
                        name: Some("Leaf".into()),
                        field: vec![field("name", 1, Type::String)],
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
        };
        let t = Transcoder::from_bytes(&set.encode_to_vec(), Some("google.protobuf.Any")).unwrap();
        // `depth` Anys around a Leaf: depth + 1 levels of messages.
        let nested = |depth: usize| {
            let mut payload = vec![0x0A, 1, b'x'];
            let mut url = "type.googleapis.com/google.protobuf.Leaf";
            for _ in 0..depth {
                payload = prost_types::Any {
                    type_url: url.into(),
                    value: payload,
                }
                .encode_to_vec();
                url = "type.googleapis.com/google.protobuf.Any";
            }
            payload
        };
        // Too deep: carried as bytes (the caller base64s them), no crash.
        assert!(t.to_json("", "", &nested(3000)).unwrap().is_none());
        assert!(t.to_json("", "", &nested(MAX_NESTING)).unwrap().is_none());
        // As deep as protobuf allows: JSON, on a test thread's 2 MiB stack
        // (a tokio worker thread's size).
        let json = t
            .to_json("", "", &nested(MAX_NESTING - 1))
            .unwrap()
            .unwrap();
        assert_eq!(
            json.json["@type"],
            "type.googleapis.com/google.protobuf.Any"
        );
        // A set whose "Any" declares type_url as bytes: prost-reflect's JSON
        // writer reads it as an Any all the same (the fuzz target's second
        // find); so does the depth check.
        let mut bytes_url = set.clone();
        bytes_url.file[0].message_type[0].field[0] = field("type_url", 1, Type::Bytes);
        let t = Transcoder::from_bytes(&bytes_url.encode_to_vec(), Some("google.protobuf.Any"))
            .unwrap();
        assert!(matches!(
            t.to_json("", "", &nested(3000)),
            Ok(None) | Err(_)
        ));
    }
}
