//! OJS conformance against the official JSON Schemas and vectors
//! (`../shared/conformance/ojs-json-schema`, unchanged from the OJS
//! project): every valid vector, as the file is, survives JSON → protobuf →
//! JSON and JSON → protobuf → protobuf → JSON through `ojs-bridge convert`
//! with the same meaning; every invalid vector is refused naming the
//! attribute; and the envelopes the bridge itself produces (grpcq mapping,
//! `send`, federation meta, the job client) are valid against
//! `job.schema.json`, checked with a maintained JSON-Schema validator.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use ojs_bridge_tests::brokers::missing;
use ojs_core::JobEnvelope;
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping;
use ojs_queue::QueueAdapter;
use serde_json::{json, Value};

fn conformance_dir() -> Option<PathBuf> {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance/ojs-json-schema");
    if dir.join("schemas/v1/job.schema.json").exists() {
        Some(dir)
    } else {
        missing(
            "the OJS conformance data",
            &format!(
                "{} is not there (shared/ beside the checkout)",
                dir.display()
            ),
        )
    }
}

/// Resolves the schemas' `$ref`s (`https://openjobspec.org/schemas/v1/X.json`)
/// to the local files; nothing is fetched.
struct LocalSchemas(PathBuf);

impl jsonschema::Retrieve for LocalSchemas {
    fn retrieve(
        &self,
        uri: &jsonschema::Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        let name = uri
            .as_str()
            .strip_prefix("https://openjobspec.org/schemas/v1/")
            .and_then(|n| n.strip_suffix(".json"))
            .ok_or_else(|| format!("not an OJS schema: {}", uri.as_str()))?;
        let path = self.0.join(format!("schemas/v1/{name}.schema.json"));
        Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
    }
}

fn job_validator(dir: &Path) -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("schemas/v1/job.schema.json")).unwrap(),
    )
    .unwrap();
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .with_retriever(LocalSchemas(dir.to_owned()))
        .build(&schema)
        .unwrap()
}

fn assert_schema_valid(v: &jsonschema::Validator, what: &str, job: &Value) {
    let errors: Vec<String> = v
        .iter_errors(job)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} is not schema-valid: {errors:?}\n{job}"
    );
}

fn convert(args: &[&str], input: &[u8]) -> (bool, Vec<u8>, String) {
    let mut all = vec!["convert"];
    all.extend_from_slice(args);
    let out = support::ojs_bridge(&all, input);
    (
        out.status.success(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The envelope's meaning: defaults equal to absent, `null` of a known
/// attribute equal to absent, timestamps as instants, numbers as numbers.
fn meaning(v: &Value) -> Value {
    let mut v = v.clone();
    let Value::Object(m) = &mut v else { return v };
    const KNOWN: [&str; 12] = [
        "meta",
        "priority",
        "timeout",
        "attempt",
        "retry",
        "unique",
        "schema",
        "state",
        "error",
        "result",
        "errors",
        "extensions",
    ];
    m.retain(|k, v| !(v.is_null() && (KNOWN.contains(&k.as_str()) || k.ends_with("_at"))));
    m.entry("queue").or_insert(json!("default"));
    for (k, default) in [
        ("meta", json!({})),
        ("priority", json!(0)),
        ("timeout", json!(0)),
        ("attempt", json!(0)),
        ("errors", json!([])),
        ("extensions", json!({})),
    ] {
        if m.get(k) == Some(&default) {
            m.remove(k);
        }
    }
    if let Some(Value::Object(retry)) = m.get_mut("retry") {
        if retry.get("jitter") == Some(&json!(true)) {
            retry.remove("jitter");
        }
    }
    let keys: Vec<String> = m.keys().cloned().collect();
    for k in keys {
        if k.ends_with("_at") {
            if let Some(t) = m
                .get(&k)
                .and_then(Value::as_str)
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            {
                m.insert(k, json!(t.timestamp_nanos_opt()));
            }
        }
    }
    if let Some(Value::Array(errors)) = m.get_mut("errors") {
        for e in errors {
            if let Some(t) = e
                .get("occurred_at")
                .and_then(Value::as_str)
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            {
                e["occurred_at"] = json!(t.timestamp_nanos_opt());
            }
        }
    }
    numbers(&mut v);
    v
}

fn numbers(v: &mut Value) {
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64() {
                if f.fract() == 0.0 && f.abs() < 9.0e15 {
                    *v = json!(f as i64);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(numbers),
        Value::Object(map) => map.values_mut().for_each(numbers),
        _ => {}
    }
}

fn vectors(dir: &Path, kind: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join(kind))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_official_vectors_pass_both_ways() {
    let Some(dir) = conformance_dir() else { return };
    let validator = job_validator(&dir);
    let valid = vectors(&dir, "valid");
    let invalid = vectors(&dir, "invalid");
    let mut passed_valid = 0;
    let mut failures = Vec::new();
    for (name, bytes) in &valid {
        let original: Value = serde_json::from_slice(bytes).unwrap();
        // The official validator agrees the vector is valid.
        assert_schema_valid(&validator, name, &original);
        let (ok, proto, err) = convert(&["--from", "json", "--to", "proto"], bytes);
        if !ok {
            failures.push(format!("{name}: json → proto refused: {err}"));
            continue;
        }
        let (ok, proto2, err) = convert(&["--from", "proto", "--to", "proto"], &proto);
        assert!(ok, "{name}: proto → proto: {err}");
        let mut same = true;
        for (route, bytes) in [
            ("json → proto → json", &proto),
            ("json → proto → proto → json", &proto2),
        ] {
            let (ok, json_out, err) = convert(&["--from", "proto", "--to", "json"], bytes);
            assert!(ok, "{name}: {route}: {err}");
            let back: Value = serde_json::from_slice(&json_out).unwrap();
            if meaning(&back) != meaning(&original) {
                same = false;
                failures.push(format!(
                    "{name}: {route} changed the meaning:\n  in:  {}\n  out: {}",
                    meaning(&original),
                    meaning(&back)
                ));
            }
            // What the bridge writes is schema-valid too.
            assert_schema_valid(&validator, &format!("{name} after {route}"), &back);
        }
        passed_valid += usize::from(same);
    }
    let mut refused_invalid = 0;
    let mut accepted_by_design = 0;
    for (name, bytes) in &invalid {
        let document: Value = serde_json::from_slice(bytes).unwrap();
        assert!(
            !validator.is_valid(&document),
            "{name}: the official schema accepts it"
        );
        let (ok, _, err) = convert(&["--from", "json", "--to", "proto"], bytes);
        if name.ends_with("type-with-hyphens.json") {
            // The one deliberate difference (docs/envelope.md): a `-`
            // inside a type's segment is taken, as the public OJS servers
            // and the official conformance cases take it.
            assert!(ok, "{name}: a dashed type is taken by design: {err}");
            accepted_by_design += 1;
            continue;
        }
        if ok {
            failures.push(format!("{name}: accepted, but the schema refuses it"));
            continue;
        }
        // One line naming the attribute (`…`) or what is missing.
        let names_it = err.contains('`') || err.contains("must be");
        if names_it {
            refused_invalid += 1;
        } else {
            failures.push(format!(
                "{name}: refused without naming the attribute: {err}"
            ));
        }
    }
    println!(
        "OJS conformance: valid {passed_valid}/{} both ways, invalid {refused_invalid}/{} refused, {accepted_by_design} taken by design (a dashed type)",
        valid.len(),
        invalid.len()
    );
    assert_eq!(accepted_by_design, 1);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(
        (valid.len(), invalid.len()),
        (17, 24),
        "the vector set changed"
    );
}

#[tokio::test]
async fn every_envelope_the_bridge_produces_is_schema_valid() {
    let Some(dir) = conformance_dir() else { return };
    let validator = job_validator(&dir);

    // The grpcq → OJS mapping, default type and a full call.
    let mut call = grpcq::Message {
        originator: "order-service-pod-1".into(),
        topic: "payment.PaymentService".into(),
        action: "ProcessPayment".into(),
        payload: vec![0, 1, 2, 250],
        message_id: "m-1".into(),
        timestamp_ms: 1_704_067_200_000,
        metadata: Default::default(),
    };
    call.metadata
        .insert("deadline_ms".into(), "1704067260000".into());
    call.metadata.insert("priority".into(), "5".into());
    call.metadata.insert(
        "traceparent".into(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
    );
    let job = mapping::call_to_job(
        &call,
        ojs_core::envelope::type_from_topic_action(&call.topic, &call.action),
        "payments".into(),
        None,
    );
    assert_eq!(job.job_type, "payment.payment_service.process_payment");
    assert_schema_valid(&validator, "a mapped call", &job.to_json_value().unwrap());
    // …and back to the exact call.
    let (topic, action) = mapping::job_topic_action(&job).unwrap();
    let mapping::JobPayload::Bytes(payload) = mapping::job_payload(&job).unwrap() else {
        panic!("a base64url payload");
    };
    assert_eq!(mapping::job_to_call(&job, topic, action, payload), call);

    // The job client (enqueue middleware stamps ids and times).
    let memory: Arc<dyn QueueAdapter> = Arc::new(ojs_adapter_memory::MemoryAdapter::named(
        &uuid::Uuid::new_v4().to_string(),
    ));
    let client = ojs_grpcq::publisher::JobClient::new(memory.clone());
    let enqueued = client
        .enqueue(JobEnvelope::new("email.send", vec![json!("a@b.c")]).with_queue("mail"))
        .await
        .unwrap();
    assert_schema_valid(
        &validator,
        "an enqueued job",
        &enqueued.to_json_value().unwrap(),
    );

    // A federated publish (federation meta stamped).
    let regions = vec![ojs_queue::federation::RegionSpec {
        name: "eu".into(),
        adapter: memory.clone(),
        probe: Arc::new(ojs_queue::federation::AdapterProbe(memory.clone())),
    }];
    let federation = ojs_queue::federation::Federation::new(
        ojs_queue::federation::FederationSettings::new("eu"),
        regions,
    )
    .unwrap();
    let out = ojs_queue::OutgoingMessage::from_envelope(
        &JobEnvelope::new("report.build", vec![json!(1)]).with_queue("reports"),
        ojs_core::Encoding::OjsProto,
    )
    .unwrap();
    federation.publish("reports", vec![out]).await.unwrap();
    let mut consumer = memory
        .consumer("reports", Default::default())
        .await
        .unwrap();
    let d = consumer
        .receive(1, std::time::Duration::from_secs(2))
        .await
        .unwrap()
        .pop()
        .unwrap();
    let stamped = &ojs_core::Encoding::OjsProto
        .decode_envelopes(&d.payload)
        .unwrap()[0];
    assert!(
        stamped.meta.keys().any(|k| k.starts_with("ojs.federation")),
        "{:?}",
        stamped.meta
    );
    assert_schema_valid(
        &validator,
        "a federated job",
        &stamped.to_json_value().unwrap(),
    );

    // `ojs-bridge send` into the embedded broker, read back with `tail`.
    let data = ojs_bridge_tests::tempdir::TempDir::new("conformance-send");
    let url = format!("local://{}", data.path().display());
    let line = br#"{"specversion":"1.0","id":"019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f","type":"email.send","queue":"mail","args":["a@b.c"],"x_tenant":"acme","retry":{"max_attempts":0}}"#;
    let mut send = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(["send", "--to", &url])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    send.stdin.take().unwrap().write_all(line).unwrap();
    assert!(send.wait_with_output().unwrap().status.success());
    let tail = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args([
            "tail",
            "--from",
            &url,
            "--queue",
            "mail",
            "--count",
            "1",
            "--timeout-secs",
            "5",
        ])
        .output()
        .unwrap();
    let printed: Value = serde_json::from_slice(&tail.stdout).unwrap();
    let message = &printed["message"];
    assert_schema_valid(&validator, "a sent job", message);
    assert_eq!(
        message["x_tenant"], "acme",
        "unknown attributes cross protobuf"
    );
    assert_eq!(
        message["retry"]["max_attempts"], 0,
        "never retry stays never retry"
    );

    // A type the schema refuses is refused by `send` too, naming it.
    let mut send = Command::new(env!("CARGO_BIN_EXE_ojs-bridge"))
        .args(["send", "--to", &url])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    send.stdin
        .take()
        .unwrap()
        .write_all(br#"{"specversion":"1.0","id":"019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f","type":"Email.Send","args":[]}"#)
        .unwrap();
    let out = send.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`type`") && err.contains("pattern"), "{err}");
}
