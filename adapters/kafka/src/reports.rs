//! A publish's delivery reports, awaited as one.
//!
//! rdkafka's `FutureProducer` gives every record a oneshot channel and a
//! boxed sender as its delivery opaque: two allocations per record (freed
//! on librdkafka's polling thread), a future per record to poll, and a
//! wake for each report the publishing task waits on. Here a record's
//! opaque is a plain number, its publish's slot and its index in that
//! publish. The polling thread counts each report into the slot and
//! wakes the publish once, when its last report is in.
//!
//! A slot is freed by whichever comes last: the publish taking its
//! results, or (when the publish stopped waiting) the last report. A
//! report can therefore never count into a later publish's slot. A publish
//! dropped before it handed every record to librdkafka takes the records it
//! never handed over off the count, as they will have no report.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use rdkafka::error::KafkaError;
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::ClientContext;

use crate::client_log::ClientLog;

/// Bits of an opaque that hold the record's index; the slot is above them.
const INDEX_BITS: u32 = usize::BITS / 2;

/// Records one publish may hold (a larger one is sent in parts).
pub(crate) const MAX_RECORDS: usize = (1 << INDEX_BITS) - 1;

/// The producer's context: librdkafka's delivery reports counted into the
/// publishes they belong to.
#[derive(Debug, Default)]
pub(crate) struct Reports {
    slots: Mutex<Slots>,
    log: Arc<ClientLog>,
}

#[derive(Debug, Default)]
struct Slots {
    slots: Vec<Slot>,
    free: Vec<usize>,
}

#[derive(Debug, Default)]
struct Slot {
    /// Records of the publish whose report has not come yet.
    outstanding: usize,
    /// Records that failed, by index, with librdkafka's error.
    failed: Vec<(usize, KafkaError)>,
    waker: Option<Waker>,
    /// The publish no longer waits: the last report frees the slot.
    abandoned: bool,
}

impl Reports {
    pub(crate) fn new(log: Arc<ClientLog>) -> Self {
        Reports {
            slots: Mutex::default(),
            log,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock leaves counts that are still
        // consistent (each step is one assignment).
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a publish of `records` records (at most
    /// [`MAX_RECORDS`]), each of which is then handed to librdkafka
    /// ([`Pending::enqueued`]) or not ([`Pending::not_enqueued`]), in order.
    pub(crate) fn open(self: &Arc<Self>, records: usize) -> Pending {
        debug_assert!(records <= MAX_RECORDS);
        let mut s = self.lock();
        let slot = match s.free.pop() {
            Some(i) => i,
            None => {
                s.slots.push(Slot::default());
                s.slots.len() - 1
            }
        };
        s.slots[slot].outstanding = records;
        Pending {
            reports: self.clone(),
            slot,
            records,
            handed: 0,
            done: false,
        }
    }

    /// Counts one record's report; wakes its publish when it was the last.
    fn report(&self, opaque: usize, error: Option<KafkaError>) {
        let (slot, index) = (opaque >> INDEX_BITS, opaque & MAX_RECORDS);
        let waker = {
            let mut s = self.lock();
            let Some(p) = s.slots.get_mut(slot) else {
                return;
            };
            if p.outstanding == 0 {
                // Not ours: no publish is waiting for this slot.
                return;
            }
            if let Some(e) = error {
                p.failed.push((index, e));
            }
            p.outstanding -= 1;
            if p.outstanding > 0 {
                return;
            }
            if p.abandoned {
                *p = Slot::default();
                s.free.push(slot);
                return;
            }
            p.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl ClientContext for Reports {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.log.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(&error, reason);
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: usize) {
        self.report(opaque, result.as_ref().err().map(|(e, _)| e.clone()));
    }
}

/// One publish's slot: the opaque of each of its records, and a future of
/// the records that failed.
#[derive(Debug)]
pub(crate) struct Pending {
    reports: Arc<Reports>,
    slot: usize,
    records: usize,
    /// Records handed to librdkafka, or counted as not enqueued, so far.
    handed: usize,
    /// The results were taken and the slot freed.
    done: bool,
}

impl Pending {
    /// The delivery opaque of record `index` of this publish.
    pub(crate) fn opaque(&self, index: usize) -> usize {
        (self.slot << INDEX_BITS) | (index & MAX_RECORDS)
    }

    /// The next record was handed to librdkafka: its report will come.
    pub(crate) fn enqueued(&mut self) {
        self.handed += 1;
    }

    /// Record `index` (the next one) was not enqueued: it will have no
    /// report.
    pub(crate) fn not_enqueued(&mut self, index: usize, error: KafkaError) {
        self.handed += 1;
        self.reports.report(self.opaque(index), Some(error));
    }
}

impl Future for Pending {
    /// The records that failed, by index, in no particular order.
    type Output = Vec<(usize, KafkaError)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(Vec::new());
        }
        let mut s = this.reports.lock();
        let p = &mut s.slots[this.slot];
        if p.outstanding > 0 {
            match &p.waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => p.waker = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        }
        let failed = std::mem::take(&mut p.failed);
        *p = Slot::default();
        s.free.push(this.slot);
        this.done = true;
        Poll::Ready(failed)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut s = self.reports.lock();
        let p = &mut s.slots[self.slot];
        // Records never handed over will have no report.
        p.outstanding = p
            .outstanding
            .saturating_sub(self.records.saturating_sub(self.handed));
        if p.outstanding == 0 {
            *p = Slot::default();
            s.free.push(self.slot);
        } else {
            p.abandoned = true;
            p.waker = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode;

    fn err() -> KafkaError {
        KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut)
    }

    #[tokio::test]
    async fn a_publish_completes_with_its_failures_once_every_record_reported() {
        let reports = Arc::new(Reports::default());
        let mut pending = reports.open(3);
        let opaques: Vec<usize> = (0..3).map(|i| pending.opaque(i)).collect();
        (0..3).for_each(|_| pending.enqueued());
        assert!(futures::poll!(&mut pending).is_pending());
        reports.report(opaques[2], None);
        reports.report(opaques[0], Some(err()));
        assert!(futures::poll!(&mut pending).is_pending());
        reports.report(opaques[1], None);
        let failed = pending.await;
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, 0);
    }

    #[tokio::test]
    async fn a_record_never_enqueued_counts_as_failed() {
        let reports = Arc::new(Reports::default());
        let mut pending = reports.open(2);
        pending.enqueued();
        reports.report(pending.opaque(0), None);
        pending.not_enqueued(1, err());
        let failed = pending.await;
        assert_eq!(failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn a_late_report_of_an_abandoned_publish_never_counts_into_a_later_one() {
        let reports = Arc::new(Reports::default());
        let mut first = reports.open(2);
        let (late_a, late_b) = (first.opaque(0), first.opaque(1));
        first.enqueued();
        first.enqueued();
        // The publish stops waiting with both reports outstanding.
        drop(first);
        let second = reports.open(1);
        assert_ne!(
            second.opaque(0) >> INDEX_BITS,
            late_a >> INDEX_BITS,
            "an abandoned slot is not reused before its reports are in"
        );
        reports.report(late_a, Some(err()));
        // The second publish is not touched by the first one's reports.
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        let mut second = second;
        assert!(Pin::new(&mut second).poll(&mut cx).is_pending());
        reports.report(late_b, Some(err()));
        // The first one's last report freed its slot, which is reused.
        let mut third = reports.open(1);
        assert_eq!(third.opaque(0) >> INDEX_BITS, late_a >> INDEX_BITS);
        assert!(Pin::new(&mut third).poll(&mut cx).is_pending());
        reports.report(second.opaque(0), None);
        match Pin::new(&mut second).poll(&mut cx) {
            Poll::Ready(failed) => assert!(failed.is_empty(), "{failed:?}"),
            Poll::Pending => panic!("the second publish's one report is in"),
        }
        reports.report(third.opaque(0), None);
        match Pin::new(&mut third).poll(&mut cx) {
            Poll::Ready(failed) => assert!(failed.is_empty(), "{failed:?}"),
            Poll::Pending => panic!("the third publish's one report is in"),
        }
    }

    #[test]
    fn a_publish_dropped_before_handing_over_every_record_frees_its_slot() {
        let reports = Arc::new(Reports::default());
        let mut first = reports.open(3);
        let slot = first.opaque(0) >> INDEX_BITS;
        first.enqueued();
        // Dropped with one record in librdkafka and two never handed over.
        drop(first);
        reports.report(slot << INDEX_BITS, None);
        let again = reports.open(1);
        assert_eq!(again.opaque(0) >> INDEX_BITS, slot, "the slot was freed");
    }

    #[test]
    fn opaques_keep_slot_and_index_apart() {
        let reports = Arc::new(Reports::default());
        let pending: Vec<Pending> = (0..3).map(|_| reports.open(MAX_RECORDS)).collect();
        let o = pending[2].opaque(MAX_RECORDS - 1);
        assert_eq!(o >> INDEX_BITS, 2);
        assert_eq!(o & MAX_RECORDS, MAX_RECORDS - 1);
    }
}
