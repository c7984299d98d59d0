//! A queue's topics: named by the templates, found on the broker (with
//! `topology = "existing"`) or created (with `declare`).

use ojs_queue::settings::Topology;
use ojs_queue::{BrokerErrorKind, Error, Result};
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;

use crate::client::START_REQUEST_TIMEOUT;
use crate::Inner;

/// The topic of each [`Destination`] of a queue; `None` where the broker has none
/// (only with `topology = "existing"`).
pub(crate) type Destinations = [Option<String>; 3];

/// Which of a queue's three topics a record goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Destination {
    Queue = 0,
    Retry = 1,
    DeadLetters = 2,
}

impl Inner {
    /// The queue's topics, indexed by [`Destination`].
    pub(crate) fn topic_names(&self, queue: &str) -> [String; 3] {
        [
            self.config.topic_of(queue),
            self.config.retry_topic_of(queue),
            self.config.dead_topic_of(queue),
        ]
    }

    /// The topics a queue's records go to: with `declare` its three topics,
    /// created when missing; with `existing` those the broker has — the
    /// queue topic must exist (an error names it otherwise), retries go
    /// back to the queue topic when there is no retry topic, and a missing
    /// dead topic is `None`.
    pub(crate) async fn destinations(&self, queue: &str) -> Result<Destinations> {
        if self.config.topology == Topology::Declare {
            self.ensure_topics(queue).await?;
            return Ok(self.topic_names(queue).map(Some));
        }
        if let Some(l) = self
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(l.clone());
        }
        let [main, retry, dead] = self.topic_names(queue);
        let mut found = Vec::new();
        for topic in [&main, &retry, &dead] {
            found.push(self.topic_exists(topic).await?);
        }
        if !found[0] {
            return Err(Error::broker(
                "kafka",
                format!("topic {main:?} does not exist (topology = \"existing\" creates nothing; create it, or use topology = \"declare\")"),
                true,
            )
.with_broker_kind(BrokerErrorKind::NotFound));
        }
        if !found[1] {
            tracing::info!(queue, topic = %main, "no retry topic; delayed retries go back to the queue topic");
        }
        let lanes = [
            Some(main.clone()),
            Some(if found[1] { retry } else { main }),
            found[2].then_some(dead),
        ];
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), lanes.clone());
        Ok(lanes)
    }

    /// Whether the broker has `topic` (a metadata request for it alone;
    /// auto-creation is off with `topology = "existing"`).
    pub(crate) async fn topic_exists(&self, topic: &str) -> Result<bool> {
        let producer = self.producer();
        let name = topic.to_owned();
        let md = tokio::task::spawn_blocking(move || {
            use rdkafka::producer::Producer as _;
            producer
                .client()
                .fetch_metadata(Some(&name), START_REQUEST_TIMEOUT)
        })
        .await
        .map_err(|e| Error::broker("kafka", e.to_string(), true))?
        .map_err(|e| self.unreachable(&e))?;
        Ok(md
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    }

    /// Creates the queue's three topics if this process has not seen them.
    pub(crate) async fn ensure_topics(&self, queue: &str) -> Result<()> {
        let names = self.topic_names(queue);
        let missing: Vec<&String> = {
            let known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
            names.iter().filter(|n| !known.contains(*n)).collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let new: Vec<NewTopic<'_>> = missing
            .iter()
            .map(|n| {
                NewTopic::new(
                    n,
                    self.config.partitions,
                    TopicReplication::Fixed(self.config.replication),
                )
            })
            .collect();
        let opts = AdminOptions::new()
            .operation_timeout(Some(START_REQUEST_TIMEOUT))
            .request_timeout(Some(START_REQUEST_TIMEOUT));
        let results = self
            .admin
            .create_topics(new.iter(), &opts)
            .await
            .map_err(|e| self.unreachable(&e))?;
        for r in results {
            match r {
                // An existing topic is used with the settings it has.
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code @ RDKafkaErrorCode::TopicAuthorizationFailed))
                | Err((name, code @ RDKafkaErrorCode::ClusterAuthorizationFailed)) => {
                    // No CreateTopics ACL: a topic created by someone else
                    // still works.
                    if !self.topic_exists(&name).await? {
                        return Err(Error::broker(
                            "kafka",
                            format!("creating topic {name}: {code} (the principal may not create topics; create it beforehand and set topology = \"existing\")"),
                            // The cluster's ACLs, not the message, are at fault.
                            true,
                        ));
                    }
                }
                Err((name, code)) => {
                    return Err(Error::broker(
                        "kafka",
                        format!("creating topic {name}: {code}"),
                        true,
                    ));
                }
            }
        }
        let mut known = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        known.extend(names);
        Ok(())
    }
}
