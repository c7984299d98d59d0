//! Kafka test settings shared by the Kafka suites.

use ojs_adapter_kafka::KafkaConfig;

/// A config for tests: the tansu test broker holds a group join for half the
/// session timeout, so a short session keeps rebalances quick
/// (shared/BROKERS.md).
pub fn test_config(url: &str) -> KafkaConfig {
    let mut c = KafkaConfig::from_url(url).expect("valid kafka URL");
    c.session_timeout_ms = 2000;
    c.librdkafka_options
        .insert("heartbeat.interval.ms".into(), "500".into());
    c
}

/// Writes one record whose headers' names are raw bytes, through
/// librdkafka's C API: no Rust or Python Kafka client here writes a header
/// name that is not UTF-8 (rdkafka takes `&str`, confluent-kafka turns
/// bytes into their Python repr), but the protocol allows it and
/// librdkafka writes what it is given.
#[allow(unsafe_code)]
pub fn produce_raw_header_names(
    brokers: &str,
    topic: &str,
    headers: &[(&[u8], &[u8])],
    payload: &[u8],
) -> anyhow::Result<()> {
    use rdkafka::bindings as rdsys;
    use rdkafka::bindings::rd_kafka_vtype_t::*;
    use rdkafka::producer::{BaseProducer, Producer as _};
    use std::ffi::{c_void, CStr, CString};

    let producer: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let topic = CString::new(topic)?;
    let names = headers
        .iter()
        .map(|(name, _)| CString::new(*name))
        .collect::<Result<Vec<_>, _>>()?;
    let vu = |vtype, u| rdsys::rd_kafka_vu_t { vtype, u };
    let mut args = vec![
        vu(
            RD_KAFKA_VTYPE_TOPIC,
            rdsys::rd_kafka_vu_s__bindgen_ty_1 {
                cstr: topic.as_ptr(),
            },
        ),
        vu(
            RD_KAFKA_VTYPE_MSGFLAGS,
            rdsys::rd_kafka_vu_s__bindgen_ty_1 {
                i: rdsys::RD_KAFKA_MSG_F_COPY,
            },
        ),
        vu(
            RD_KAFKA_VTYPE_VALUE,
            rdsys::rd_kafka_vu_s__bindgen_ty_1 {
                mem: rdsys::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                    ptr: payload.as_ptr() as *mut c_void,
                    size: payload.len(),
                },
            },
        ),
    ];
    for (name, (_, value)) in names.iter().zip(headers) {
        args.push(vu(
            RD_KAFKA_VTYPE_HEADER,
            rdsys::rd_kafka_vu_s__bindgen_ty_1 {
                header: rdsys::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                    name: name.as_ptr(),
                    val: value.as_ptr() as *const c_void,
                    size: value.len() as isize,
                },
            },
        ));
    }
    // SAFETY: the client is alive; every pointer in `args` is valid for its
    // length for the call (`topic`, `names`, `payload`, `headers` outlive
    // it), each union member is the one its tag names, and MSG_F_COPY has
    // librdkafka copy the payload (header names and values it always
    // copies).
    let error = unsafe {
        rdsys::rd_kafka_produceva(producer.client().native_ptr(), args.as_ptr(), args.len())
    };
    if !error.is_null() {
        // SAFETY: a non-null error from produceva is ours to read and free.
        let message = unsafe { CStr::from_ptr(rdsys::rd_kafka_error_string(error)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above; freed once, not used after.
        unsafe { rdsys::rd_kafka_error_destroy(error) };
        anyhow::bail!("rd_kafka_produceva: {message}");
    }
    producer.flush(std::time::Duration::from_secs(30))?;
    Ok(())
}
