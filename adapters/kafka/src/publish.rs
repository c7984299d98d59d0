//! Publishing: records produced through the idempotent producer, each
//! publish waiting for all of its delivery reports ([`crate::reports`]).

use std::sync::Arc;

use ojs_queue::{BrokerErrorKind, Error, FailedPublish, OutgoingMessage, Result};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::BaseRecord;
use tokio::time::Instant;

use crate::client::{kafka_error, make_producer, Producer, ORIGIN_TOPIC_HEADER, QUEUE_FULL_WAIT};
use crate::topology::{Destination, Destinations};
use crate::{reports, Inner};

impl Inner {
    pub(crate) fn producer(&self) -> Arc<Producer> {
        self.producer
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Swaps in a new producer unless someone already replaced `broken`.
    pub(crate) fn rebuild_producer(&self, broken: &Arc<Producer>) -> Result<()> {
        let fresh = Arc::new(make_producer(&self.config, &self.log)?);
        let mut slot = self.producer.write().unwrap_or_else(|e| e.into_inner());
        if Arc::ptr_eq(&slot, broken) {
            *slot = fresh;
        }
        Ok(())
    }

    pub(crate) fn forget_topics(&self, queue: &str) {
        let mut known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        for t in self.topic_names(queue) {
            known.remove(&t);
        }
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
    }

    /// Hands `records` to librdkafka in order and waits for every report;
    /// returns the records that failed, by their index in `records`. A
    /// record a full local queue refuses is offered again, and the ones
    /// after it wait with it, until the publish timeout.
    pub(crate) async fn enqueue_and_wait(
        &self,
        producer: &Producer,
        topics: &Destinations,
        records: &[(usize, Destination, OutgoingMessage)],
    ) -> Vec<(usize, KafkaError)> {
        use rdkafka::producer::Producer as _;
        let mut pending = producer.client().context().open(records.len());
        let deadline = Instant::now() + self.config.publish_timeout();
        for (index, (_, destination, m)) in records.iter().enumerate() {
            let Some(topic) = &topics[*destination as usize] else {
                pending.not_enqueued(
                    index,
                    KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopic),
                );
                continue;
            };
            // A retry record says which queue topic it goes back to.
            let origin = (*destination == Destination::Retry)
                .then(|| topics[Destination::Queue as usize].as_deref())
                .flatten();
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len() + 1);
            for (k, v) in &m.headers {
                if origin.is_some() && k == ORIGIN_TOPIC_HEADER {
                    continue;
                }
                headers = headers.insert(Header {
                    key: k.as_str(),
                    value: Some(v.as_bytes()),
                });
            }
            if let Some(origin) = origin {
                headers = headers.insert(Header {
                    key: ORIGIN_TOPIC_HEADER,
                    value: Some(origin.as_bytes()),
                });
            }
            let mut record: BaseRecord<'_, [u8], [u8], usize> =
                BaseRecord::with_opaque_to(topic, pending.opaque(index))
                    .payload(m.payload.as_ref())
                    .headers(headers);
            if let Some(key) = &m.key {
                record = record.key(&key[..]);
            }
            loop {
                match producer.send(record) {
                    Ok(()) => {
                        pending.enqueued();
                        break;
                    }
                    Err((e, back))
                        if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                            && Instant::now() < deadline =>
                    {
                        record = back;
                        tokio::time::sleep(QUEUE_FULL_WAIT).await;
                    }
                    Err((e, _)) => {
                        pending.not_enqueued(index, e);
                        break;
                    }
                }
            }
        }
        pending.await
    }

    /// Produces each message to its destination's topic and waits for every
    /// delivery report. Topic names are rendered once per call, not per
    /// record.
    pub(crate) async fn produce(
        &self,
        queue: &str,
        items: Vec<(usize, Destination, OutgoingMessage)>,
    ) -> Vec<FailedPublish> {
        let topics = match self.destinations(queue).await {
            Ok(t) => t,
            Err(e) => {
                let (text, retryable) = (e.to_string(), e.is_retryable());
                return items
                    .into_iter()
                    .map(|(index, _, message)| FailedPublish {
                        index,
                        message,
                        error: Error::broker("kafka", text.clone(), retryable),
                    })
                    .collect();
            }
        };
        let producer = self.producer();
        // Every record is enqueued before any report is awaited, and the
        // reports are awaited as one: the task wakes once, when the last is
        // in (not once per record, as a future per record would have it).
        let mut errors: Vec<Option<KafkaError>> = items.iter().map(|_| None).collect();
        for (part, first) in items
            .chunks(reports::MAX_RECORDS)
            .zip((0..).step_by(reports::MAX_RECORDS))
        {
            for (index, error) in self.enqueue_and_wait(&producer, &topics, part).await {
                errors[first + index] = Some(error);
            }
        }
        let mut failed = Vec::new();
        let mut timed_out = 0;
        for ((index, destination, message), error) in items.into_iter().zip(errors) {
            if topics[destination as usize].is_none() {
                failed.push(FailedPublish {
                    index,
                    message,
                    error: Error::broker(
                        "kafka",
                        format!(
                            "topic {:?} does not exist (topology = \"existing\" creates nothing)",
                            self.topic_names(queue)[destination as usize]
                        ),
                        true,
                    )
                    .with_broker_kind(BrokerErrorKind::NotFound),
                });
                continue;
            }
            if let Some(e) = error {
                timed_out += usize::from(matches!(
                    e.rdkafka_error_code(),
                    Some(RDKafkaErrorCode::MessageTimedOut)
                ));
                failed.push(FailedPublish {
                    index,
                    message,
                    error: kafka_error(&e),
                });
            }
        }
        if !failed.is_empty() {
            // The topic may have gone away (a broker restarted without its
            // data): librdkafka then only waits for metadata until the message
            // times out. Make the next publish check the topics again;
            // creating an existing topic is a cheap no-op.
            self.forget_topics(queue);
            // An idempotent producer whose id the cluster no longer knows can
            // stay stuck; a fatal error or a batch that timed out entirely
            // gets a fresh producer (new id) for the next publish.
            let fatal = {
                use rdkafka::producer::Producer as _;
                producer.client().fatal_error()
            };
            if fatal.is_some() || timed_out == failed.len() {
                let fatal = fatal.map(|(code, reason)| format!("{code:?}: {reason}"));
                tracing::warn!(fatal, timed_out, "rebuilding the kafka producer");
                if let Err(e) = self.rebuild_producer(&producer) {
                    tracing::warn!(error = %e, "could not rebuild the kafka producer");
                }
            }
        }
        failed
    }
}
