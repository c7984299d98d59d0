//! `ojs-bridge convert` as a user runs it: a real process, stdin/stdout, exit codes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::support;

use std::process::Output;

const MINIMAL: &str = r#"{"specversion":"1.0","id":"019539a4-b68c-7def-8000-1a2b3c4d5e6f","type":"email.send","queue":"default","args":["user@example.com","welcome"]}"#;

fn convert(args: &[&str], stdin: &[u8]) -> Output {
    let mut all = vec!["convert"];
    all.extend_from_slice(args);
    support::ojs_bridge(&all, stdin)
}

#[test]
fn json_to_proto_and_back_through_stdin() {
    let proto = convert(&["--from", "json", "--to", "proto"], MINIMAL.as_bytes());
    assert!(
        proto.status.success(),
        "{}",
        String::from_utf8_lossy(&proto.stderr)
    );
    assert!(
        proto.stdout.len() < MINIMAL.len(),
        "binary is smaller than JSON"
    );
    let json = convert(&["--from", "proto", "--to", "json"], &proto.stdout);
    assert!(json.status.success());
    assert_eq!(
        String::from_utf8(json.stdout).unwrap(),
        format!("{MINIMAL}\n")
    );
}

#[test]
fn ndjson_to_delimited_stream_and_back_from_a_file() {
    let dir = std::env::temp_dir().join(format!("ojs-convert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("jobs.ndjson");
    let second = MINIMAL.replace("1a2b3c4d5e6f", "1a2b3c4d5e70");
    std::fs::write(&file, format!("{MINIMAL}\n{second}\n")).unwrap();
    let stream = convert(
        &[
            "--from",
            "json",
            "--to",
            "proto-delimited",
            file.to_str().unwrap(),
        ],
        b"",
    );
    assert!(stream.status.success());
    let back = convert(
        &["--from", "proto-delimited", "--to", "json"],
        &stream.stdout,
    );
    assert_eq!(
        String::from_utf8(back.stdout).unwrap(),
        format!("{MINIMAL}\n{second}\n")
    );
    let one = convert(
        &["--from", "proto-delimited", "--to", "proto"],
        &stream.stdout,
    );
    assert_eq!(one.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&one.stderr).contains("exactly one envelope"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn invalid_input_exits_2_with_one_line_naming_the_place() {
    let input = format!(
        "{MINIMAL}\n{}\n",
        MINIMAL
            .replace("\"args\":[", "\"args\":{\"a\":[")
            .replace("]}", "]}}")
    );
    let out = convert(
        &["--from", "json", "--to", "proto-delimited"],
        input.as_bytes(),
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("line 2") && stderr.contains("args"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing half-written");

    let out = convert(&["--from", "proto", "--to", "json"], b"\x0a\x05ab");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("envelope 1") && stderr.contains("truncated"),
        "{stderr}"
    );
}

#[test]
fn unknown_fields_are_kept_proto_to_proto_and_warned_about_for_json() {
    let proto = convert(&["--from", "json", "--to", "proto"], MINIMAL.as_bytes()).stdout;
    let mut with_unknown = proto.clone();
    with_unknown.extend_from_slice(&[0x90, 0x03, 0x2a]);
    let same = convert(&["--from", "proto", "--to", "proto"], &with_unknown);
    assert_eq!(same.stdout, with_unknown);
    let json = convert(&["--from", "proto", "--to", "json"], &with_unknown);
    assert!(json.status.success());
    assert!(String::from_utf8_lossy(&json.stderr).contains("unknown to this build"));
}
