//! Envelope codec speed and size: protobuf vs JSON for the minimal envelope
//! (type, id, queue, one arg), a typical one (type, queue, two string args,
//! priority, timeout, retry policy) and one with 64 KiB of args.
//!
//! Targets on the 2-core reference machine: protobuf/JSON size ratio ≤ 0.45
//! for the typical envelope; protobuf encode + decode of it under 2 µs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ojs_core::{JobEnvelope, RetryPolicy};
use serde_json::json;

fn minimal() -> JobEnvelope {
    let mut job = JobEnvelope::new(
        "email.send",
        vec![json!("user@example.com"), json!("welcome")],
    );
    job.id = "019539a4-b68c-7def-8000-1a2b3c4d5e6f".into();
    job.created_at = None;
    job
}

fn typical() -> JobEnvelope {
    let mut job = JobEnvelope::new("video.transcode", vec![json!("video_001"), json!("1080p")]);
    job.id = "019539a4-b68c-7def-8000-2b3c4d5e6f7a".into();
    job.queue = "media".into();
    job.created_at = None;
    job.priority = 5;
    job.timeout = 3600;
    job.retry = Some(RetryPolicy {
        max_attempts: Some(3),
        initial_interval: "PT10S".into(),
        backoff_coefficient: 2.0,
        jitter: true,
        on_exhaustion: "dead_letter".into(),
        ..RetryPolicy::default()
    });
    job
}

fn large() -> JobEnvelope {
    let chunk = "x".repeat(1024);
    let args = (0..64).map(|_| json!(chunk)).collect();
    let mut job = JobEnvelope::new("blob.process", args);
    job.created_at = None;
    job
}

fn cases() -> Vec<(&'static str, JobEnvelope)> {
    vec![
        ("minimal", minimal()),
        ("typical", typical()),
        ("args_64k", large()),
    ]
}

fn sizes() {
    println!("\nwire sizes (bytes)          proto     json   ratio");
    for (name, job) in cases() {
        let p = job.to_proto_bytes().unwrap().len();
        let j = job.to_json_vec().unwrap().len();
        println!("{name:<24} {p:>8} {j:>8}   {:.3}", p as f64 / j as f64);
    }
    println!();
}

fn codecs(c: &mut Criterion) {
    sizes();
    let mut group = c.benchmark_group("envelope");
    for (name, job) in cases() {
        let proto = job.to_proto_bytes().unwrap();
        let json = job.to_json_vec().unwrap();
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::new("proto_encode", name), &job, |b, j| {
            b.iter(|| black_box(j.to_proto_bytes().unwrap()))
        });
        group.bench_with_input(BenchmarkId::new("proto_decode", name), &proto, |b, p| {
            b.iter(|| black_box(JobEnvelope::from_proto_bytes(p).unwrap()))
        });
        group.bench_with_input(BenchmarkId::new("proto_roundtrip", name), &job, |b, j| {
            b.iter(|| {
                black_box(JobEnvelope::from_proto_bytes(&j.to_proto_bytes().unwrap()).unwrap())
            })
        });
        group.bench_with_input(BenchmarkId::new("json_encode", name), &job, |b, j| {
            b.iter(|| black_box(j.to_json_vec().unwrap()))
        });
        group.bench_with_input(BenchmarkId::new("json_decode", name), &json, |b, p| {
            b.iter(|| black_box(JobEnvelope::from_json_slice(p).unwrap()))
        });
    }
    group.finish();
}

/// A timestamp as the envelope's JSON writes it, beside chrono's own
/// formatter (the same text).
fn timestamps(c: &mut Criterion) {
    use chrono::SecondsFormat;
    let t = chrono::DateTime::from_timestamp(1_795_000_000, 123_000_000).unwrap();
    let mut group = c.benchmark_group("timestamp");
    group.bench_function("ours", |b| {
        b.iter(|| {
            black_box(ojs_core::timestamp::rfc3339(
                black_box(&t),
                SecondsFormat::AutoSi,
            ))
        })
    });
    group.bench_function("chrono", |b| {
        b.iter(|| black_box(black_box(&t).to_rfc3339_opts(SecondsFormat::AutoSi, true)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = codecs, timestamps
}
criterion_main!(benches);
