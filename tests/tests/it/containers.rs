//! The acceptance suite on broker containers this binary starts itself
//! (`ojs_bridge_tests::containers`: the images `scripts/containers.sh`
//! builds, on free loopback ports), one container per broker for all its
//! cases; and a RabbitMQ container killed (`docker kill`) and started again
//! in the middle of a stream, with nothing lost.

use ojs_bridge_tests::acceptance_tests;
use ojs_bridge_tests::brokers::{unique_queue, Broker};
use ojs_bridge_tests::containers::{start, BrokerContainer};

use crate::acceptance_kafka::Kafka;
use crate::acceptance_rabbitmq::Rabbit;
use crate::acceptance_sqs::Sqs;

async fn rabbitmq_container() -> Option<BrokerContainer> {
    start(Broker::RabbitMq).await
}

async fn kafka_container() -> Option<BrokerContainer> {
    start(Broker::Kafka).await
}

async fn sqs_container() -> Option<BrokerContainer> {
    start(Broker::Sqs).await
}

fn rabbit(c: &BrokerContainer) -> Rabbit {
    Rabbit { url: c.url.clone() }
}

fn kafka(c: &BrokerContainer) -> Kafka {
    Kafka {
        url: c.url.clone(),
        group: unique_queue("acc-group"),
        exact_depth: !c.image.contains("tansu"),
    }
}

fn sqs(c: &BrokerContainer) -> Sqs {
    Sqs { url: c.url.clone() }
}

acceptance_tests!(@in_one_test the_acceptance_suite_passes_on_a_rabbitmq_container, rabbitmq_container, rabbit);
acceptance_tests!(@in_one_test the_acceptance_suite_passes_on_a_kafka_container, kafka_container, kafka);
acceptance_tests!(@in_one_test the_acceptance_suite_passes_on_an_sqs_container, sqs_container, sqs);

/// 10,000 jobs through a RabbitMQ container that is killed (SIGKILL, as a
/// crash) and started again while they flow: durable queues and persistent
/// messages survive in the container's file system; published with
/// confirms, nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_container_killed_mid_stream_loses_nothing() {
    let Some(container) = rabbitmq_container().await else {
        return;
    };
    let id = container.id();
    let command = format!("docker kill {id} >/dev/null && sleep 2 && docker start {id} >/dev/null");
    crate::rabbitmq::restart_mid_stream(
        &container.url,
        &command,
        "rabbitmq container killed mid-stream",
    )
    .await;
}
