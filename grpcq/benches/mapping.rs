//! The bridge's per-message work without any broker: a grpcq call's bytes
//! decoded, mapped to an OJS job (deterministic id, meta, base64url
//! payload) and encoded as an outgoing message with its binding headers —
//! stage by stage and all together. With the broker clients' own cost this
//! is what a bridged message costs beyond a raw copy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

// The allocator the ojs-bridge binary ships with: what the daemon pays.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use ojs_core::Encoding;
use ojs_grpcq as grpcq;
use ojs_grpcq::mapping;
use ojs_queue::OutgoingMessage;

fn call() -> grpcq::Message {
    let mut m = grpcq::Message {
        originator: "bench-service".into(),
        topic: "payment.PaymentService".into(),
        action: "ProcessPayment".into(),
        payload: vec![b'x'; 96],
        message_id: "5f0c6a1e-9a53-4c8e-8c3a-2f7d1e0b9a41".into(),
        timestamp_ms: 1_763_700_000_000,
        metadata: Default::default(),
    };
    m.metadata.insert("tenant".into(), "t7".into());
    m
}

fn to_job(call: &grpcq::Message) -> ojs_core::JobEnvelope {
    // As the daemon names it: snake_case segments the schema accepts.
    let job_type = ojs_core::envelope::type_from_topic_action(&call.topic, &call.action);
    mapping::call_to_job(call, job_type, "default".into(), None)
}

fn stages(c: &mut Criterion) {
    let call = call();
    let bytes = bytes::Bytes::from(grpcq::encode(&call));
    let in_place = grpcq::Call::decode(bytes.clone()).unwrap();
    let job = to_job(&call);
    let job_type = ojs_queue::HeaderValue::from("payment.payment_service.process_payment");
    // A route's queue, named once when the daemon starts.
    let queue = ojs_queue::HeaderValue::from_static("default");
    let mut group = c.benchmark_group("call_to_job");
    group.throughput(Throughput::Elements(1));
    // As the daemon reads a call: in place, sharing the delivery's bytes.
    group.bench_function("decode_call", |b| {
        b.iter(|| black_box(grpcq::Call::decode_lenient(black_box(&bytes)).unwrap()))
    });
    // The same into prost's message (every field allocated): the reference.
    group.bench_function("decode_call_prost", |b| {
        b.iter(|| black_box(grpcq::decode_lenient(black_box(&bytes)).unwrap()))
    });
    group.bench_function("job_id", |b| {
        b.iter(|| black_box(mapping::call_job_id(&call.message_id, call.timestamp_ms)))
    });
    group.bench_function("map", |b| b.iter(|| black_box(to_job(black_box(&call)))));
    group.bench_function("encode_message", |b| {
        b.iter(|| black_box(OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap()))
    });
    group.bench_function("direct_encode", |b| {
        b.iter(|| {
            black_box(mapping::call_to_job_message(
                black_box(&in_place),
                &job_type,
                &queue,
            ))
        })
    });
    // Naming and checking a job type the first time (what `JobTypes`
    // remembers for the calls after it).
    group.bench_function("name_job_type", |b| {
        b.iter(|| {
            let name = ojs_core::envelope::type_from_topic_action(
                black_box(&call.topic),
                black_box(&call.action),
            );
            ojs_core::envelope::validate_job_type(&name).unwrap();
            black_box(ojs_queue::HeaderValue::from(name))
        })
    });
    // What the daemon does per call on a route to OJS protobuf: decode,
    // name the job type (remembered from the call before, as the daemon
    // does within a batch; every call here names the same method), encode
    // the job straight from the call.
    let mut job_types = mapping::JobTypes::new();
    group.bench_function("all", |b| {
        b.iter(|| {
            let call = grpcq::Call::decode_lenient(black_box(&bytes)).unwrap();
            let job_type = job_types.of(call.topic(), call.action()).unwrap();
            black_box(mapping::call_to_job_message(&call, &job_type, &queue))
        })
    });
    // The same through a JobEnvelope (routes that keep it or transcode).
    group.bench_function("all_via_envelope", |b| {
        b.iter(|| {
            let call = grpcq::decode_lenient(black_box(&bytes)).unwrap();
            let job = to_job(&call);
            black_box(OutgoingMessage::from_envelope(&job, Encoding::OjsProto).unwrap())
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = stages
}
criterion_main!(benches);
