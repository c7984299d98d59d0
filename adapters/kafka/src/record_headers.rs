//! A consumed record's headers, read straight from librdkafka with their
//! names as bytes.
//!
//! rdkafka's own reader (`Headers::try_get`, 0.39) turns each name into a
//! `&str` with `to_str().unwrap()`. The Kafka protocol does not require a
//! header name to be UTF-8, and librdkafka and other clients write any
//! bytes there, so one such record from another team's producer would
//! panic our consumer and, replayed after every restart, wedge the
//! partition. Reading the names as bytes lets the caller decide
//! ([`crate::received_record`] reads them the way Kafka's Java client
//! does). One of the workspace's two modules of unsafe code (the other is
//! `ojs-sqlite`'s VFS): two librdkafka calls whose results borrow from the
//! message.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr;

use rdkafka::bindings as rdsys;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaRespErr;

/// The headers of one received record, in order: (name, value), a null
/// value as `None`. Borrows the message, which owns what they point to.
pub(crate) struct RecordHeaders<'a> {
    list: *const rdsys::rd_kafka_headers_t,
    next: usize,
    count: usize,
    message: PhantomData<&'a BorrowedMessage<'a>>,
}

impl<'a> RecordHeaders<'a> {
    pub(crate) fn of(message: &'a BorrowedMessage<'_>) -> Self {
        let mut list = ptr::null_mut();
        // SAFETY: `message.ptr()` is the live librdkafka message that
        // `message` owns for at least 'a. librdkafka sets `list` to the
        // message's own header list (parsed on first use) or leaves it null
        // and answers NOENT when there is none; the list lives as long as
        // the message, which the returned value borrows.
        let err = unsafe { rdsys::rd_kafka_message_headers(message.ptr(), &mut list) };
        let count = if err == RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR && !list.is_null() {
            // SAFETY: `list` is the non-null header list librdkafka just
            // returned for a message that is still alive.
            unsafe { rdsys::rd_kafka_header_cnt(list) }
        } else {
            0
        };
        RecordHeaders {
            list,
            next: 0,
            count,
            message: PhantomData,
        }
    }
}

impl<'a> Iterator for RecordHeaders<'a> {
    type Item = (&'a [u8], Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        while self.next < self.count {
            let idx = self.next;
            self.next += 1;
            let mut name = ptr::null();
            let mut value = ptr::null();
            let mut size = 0;
            // SAFETY: `self.list` is non-null here (`count` is 0 otherwise)
            // and belongs to the message borrowed for 'a; `idx` is below
            // the count librdkafka reported, and librdkafka checks it again.
            let err = unsafe {
                rdsys::rd_kafka_header_get_all(self.list, idx, &mut name, &mut value, &mut size)
            };
            if err != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
                continue;
            }
            // SAFETY: librdkafka keeps each header name NUL-terminated in
            // the header's own allocation, owned by the message ('a).
            let name = unsafe { CStr::from_ptr(name) }.to_bytes();
            let value = (!value.is_null()).then(|| {
                // SAFETY: a non-null value is `size` bytes owned by the
                // header, which the message owns ('a).
                unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }
            });
            return Some((name, value));
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.count - self.next))
    }
}

impl std::fmt::Debug for RecordHeaders<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordHeaders")
            .field("count", &self.count)
            .finish_non_exhaustive()
    }
}
