//! A queue's URLs: its SQS queue and dead-letter queue, found by name
//! (with `topology = "existing"`) or created with a redrive policy (with
//! `declare`), and cached.

use aws_sdk_sqs::types::QueueAttributeName;
use ojs_queue::settings::Topology;
use ojs_queue::{BrokerErrorKind, Error, Result};

use crate::client::{call_error, sqs_error};
use crate::Inner;

impl Inner {
    pub(crate) fn cached(&self, name: &str) -> Option<String> {
        self.urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    pub(crate) async fn create(&self, name: &str, redrive_to: Option<&str>) -> Result<String> {
        let mut req = self.client.create_queue().queue_name(name);
        if self.config.fifo {
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(dlq_arn) = redrive_to {
            let policy = serde_json::json!({
                "deadLetterTargetArn": dlq_arn,
                "maxReceiveCount": self.config.max_receive_count.to_string(),
            });
            req = req.attributes(QueueAttributeName::RedrivePolicy, policy.to_string());
        }
        let out = req.send().await.map_err(call_error)?;
        let url = out
            .queue_url()
            .ok_or_else(|| sqs_error("CreateQueue returned no URL"))?
            .to_owned();
        self.urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), url.clone());
        Ok(url)
    }

    /// The URL of queue `name`, or `None` when SQS has no such queue.
    pub(crate) async fn lookup(&self, name: &str) -> Result<Option<String>> {
        if let Some(url) = self.cached(name) {
            return Ok(Some(url));
        }
        match self.client.get_queue_url().queue_name(name).send().await {
            Ok(out) => {
                let url = out
                    .queue_url()
                    .ok_or_else(|| sqs_error("GetQueueUrl returned no URL"))?
                    .to_owned();
                self.urls
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_owned(), url.clone());
                Ok(Some(url))
            }
            Err(e) => {
                let missing = e
                    .as_service_error()
                    .is_some_and(|se| se.is_queue_does_not_exist())
                    || aws_sdk_sqs::error::ProvideErrorMetadata::code(&e).is_some_and(|c| {
                        c.contains("NonExistentQueue") || c.contains("QueueDoesNotExist")
                    });
                if missing {
                    Ok(None)
                } else {
                    Err(call_error(e))
                }
            }
        }
    }

    /// The dead-letter queue SQS's own RedrivePolicy of `url` names, if any.
    pub(crate) async fn redrive_target(&self, url: &str) -> Result<Option<String>> {
        let attrs = self
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(call_error)?;
        let Some(policy) = attrs
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::RedrivePolicy))
        else {
            return Ok(None);
        };
        let arn = serde_json::from_str::<serde_json::Value>(policy)
            .ok()
            .and_then(|p| p.get("deadLetterTargetArn")?.as_str().map(str::to_owned));
        // arn:aws:sqs:REGION:ACCOUNT:NAME
        match arn.as_deref().and_then(|a| a.rsplit(':').next()) {
            Some(name) if !name.is_empty() => self.lookup(name).await,
            _ => Ok(None),
        }
    }

    /// URLs of the queue and of where its dead letters go.
    ///
    /// `declare`: an existing queue is used as it is, its own redrive target
    /// as its DLQ (else the template's DLQ, created if missing); a missing
    /// queue is created after its DLQ, with a RedrivePolicy.
    /// `existing`: nothing is created; the queue must exist; its DLQ is its
    /// redrive target, else the template's queue if that exists, else none.
    pub(crate) async fn urls(&self, queue: &str) -> Result<(String, Option<String>)> {
        let (name, dlq) = (
            self.config.queue_name(queue),
            self.config.dead_letter_queue_name(queue),
        );
        if let Some(known) = self
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(queue)
        {
            return Ok(known.clone());
        }
        let resolved = match (self.lookup(&name).await?, self.config.topology) {
            (Some(url), topology) => {
                let dead = match self.redrive_target(&url).await? {
                    Some(d) => Some(d),
                    None => match (self.lookup(&dlq).await?, topology) {
                        (Some(d), _) => Some(d),
                        (None, Topology::Declare) => Some(self.create(&dlq, None).await?),
                        (None, Topology::Existing) => None,
                    },
                };
                (url, dead)
            }
            (None, Topology::Existing) => {
                return Err(Error::broker(
                    "sqs",
                    format!("queue {name:?} does not exist (topology = \"existing\" creates nothing; create it, or use topology = \"declare\")"),
                    true,
                )
.with_broker_kind(BrokerErrorKind::NotFound))
            }
            (None, Topology::Declare) => {
                let dlq_url = match self.lookup(&dlq).await? {
                    Some(u) => u,
                    None => self.create(&dlq, None).await?,
                };
                let attrs = self
                    .client
                    .get_queue_attributes()
                    .queue_url(&dlq_url)
                    .attribute_names(QueueAttributeName::QueueArn)
                    .send()
                    .await
                    .map_err(call_error)?;
                let arn = attrs
                    .attributes()
                    .and_then(|a| a.get(&QueueAttributeName::QueueArn))
                    .ok_or_else(|| sqs_error("the DLQ has no QueueArn"))?
                    .clone();
                (self.create(&name, Some(&arn)).await?, Some(dlq_url))
            }
        };
        self.resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), resolved.clone());
        Ok(resolved)
    }
}
