#!/usr/bin/env python3
"""Independent clients for the broker suites: resources and records made, and
checked, the way other teams' tools make them (pika, boto3, confluent-kafka),
never through ojs-bridge's own adapters.

Endpoints come from the suites' environment (scripts/brokers.sh env):
OJS_BRIDGE_TEST_AMQP_URL, OJS_BRIDGE_TEST_KAFKA_URL, OJS_BRIDGE_TEST_SQS_URL.
Output is JSON on stdout; a missing resource exits 3.
"""

import argparse
import base64
import json
import os
import sys
import time
import urllib.parse


def amqp_connection():
    import pika

    url = os.environ.get("OJS_BRIDGE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    return pika.BlockingConnection(pika.URLParameters(url))


def kafka_conf():
    url = os.environ.get("OJS_BRIDGE_TEST_KAFKA_URL", "kafka://127.0.0.1:9092")
    return {"bootstrap.servers": url.removeprefix("kafka://").split("?")[0]}


def sqs_client():
    import boto3

    url = os.environ.get("OJS_BRIDGE_TEST_SQS_URL", "sqs://us-east-1?endpoint=http://127.0.0.1:4566")
    rest = url.removeprefix("sqs://")
    region, _, query = rest.partition("?")
    params = dict(urllib.parse.parse_qsl(query))
    return boto3.client(
        "sqs",
        region_name=region,
        endpoint_url=params.get("endpoint"),
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "test"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "test"),
    )


def pairs(items):
    out = {}
    for item in items or []:
        k, _, v = item.partition("=")
        out[k] = v
    return out


def typed(value):
    try:
        return int(value)
    except ValueError:
        return value


# RabbitMQ -------------------------------------------------------------------


def rabbit_queue(a):
    conn = amqp_connection()
    ch = conn.channel()
    args = {k: typed(v) for k, v in pairs(a.arg).items()}
    if a.dead_letter_exchange:
        ch.exchange_declare(a.dead_letter_exchange, exchange_type="fanout", durable=True)
        args["x-dead-letter-exchange"] = a.dead_letter_exchange
        if a.dlq:
            ch.queue_declare(a.dlq, durable=True)
            ch.queue_bind(a.dlq, a.dead_letter_exchange)
    ch.queue_declare(a.name, durable=True, arguments=args)
    conn.close()
    print(json.dumps({"queue": a.name, "arguments": args}))


def rabbit_exchange(a):
    conn = amqp_connection()
    ch = conn.channel()
    ch.exchange_declare(a.name, exchange_type=a.type, durable=True)
    for binding in a.bind or []:
        queue, _, key = binding.partition(":")
        ch.queue_bind(queue, a.name, routing_key=key or queue)
    conn.close()
    print(json.dumps({"exchange": a.name}))


def rabbit_exists(a):
    import pika

    conn = amqp_connection()
    ch = conn.channel()
    try:
        if a.exchange:
            ch.exchange_declare(a.name, passive=True)
            print(json.dumps({"exists": True}))
        else:
            q = ch.queue_declare(a.name, passive=True)
            print(json.dumps({"exists": True, "messages": q.method.message_count}))
        conn.close()
    except pika.exceptions.ChannelClosedByBroker as e:
        print(json.dumps({"exists": False, "reply": e.reply_code}))
        sys.exit(3)


def rabbit_delete(a):
    conn = amqp_connection()
    ch = conn.channel()
    for name in a.names:
        if a.exchange:
            ch.exchange_delete(name)
        else:
            ch.queue_delete(name)
    conn.close()


def rabbit_publish(a):
    import pika

    conn = amqp_connection()
    ch = conn.channel()
    ch.confirm_delivery()
    headers = pairs(a.header)
    # Names given in hex go out as the bytes they are: AMQP says short
    # strings are UTF-8, but pika and RabbitMQ pass on whatever they get.
    for name, value in pairs(a.header_hex).items():
        headers[bytes.fromhex(name)] = value
    # Typed values the way other AMQP clients write them: JSON numbers,
    # booleans, objects (tables), arrays and null (void) as pika encodes them.
    for name, value in pairs(a.header_json).items():
        headers[name] = json.loads(value)
    message_id = bytes.fromhex(a.message_id_hex) if a.message_id_hex else a.message_id
    props = pika.BasicProperties(
        content_type=a.content_type or None,
        headers=headers or None,
        message_id=message_id,
        delivery_mode=2,
    )
    for i in range(a.count):
        body = a.body.replace("{i}", str(i)).encode()
        ch.basic_publish(a.exchange, a.routing_key, body, props, mandatory=True)
    conn.close()
    print(json.dumps({"published": a.count}))


def rabbit_get(a):
    conn = amqp_connection()
    ch = conn.channel()
    out = []
    deadline = time.time() + a.timeout
    while len(out) < a.count and time.time() < deadline:
        method, props, body = ch.basic_get(a.name, auto_ack=True)
        if method is None:
            time.sleep(0.1)
            continue
        out.append(
            {
                "body": body.decode("utf-8", "replace"),
                "content_type": props.content_type,
                "message_id": props.message_id,
                "headers": {k: str(v) for k, v in (props.headers or {}).items()},
                # Each header's Python type as pika decoded it (int, bool,
                # dict, list, NoneType, str, bytes) and its value as JSON.
                "header_types": {k: type(v).__name__ for k, v in (props.headers or {}).items()},
                "header_json": {k: json.loads(json.dumps(v, default=str)) for k, v in (props.headers or {}).items()},
            }
        )
    conn.close()
    for m in out:
        print(json.dumps(m))


# SQS ------------------------------------------------------------------------


def sqs_queue(a):
    c = sqs_client()
    attrs = {k: v for k, v in pairs(a.attr).items()}
    if a.dlq:
        dlq_url = c.create_queue(QueueName=a.dlq)["QueueUrl"]
        arn = c.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attrs["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": str(a.max_receive)})
    url = c.create_queue(QueueName=a.name, Attributes=attrs)["QueueUrl"]
    print(json.dumps({"queue": a.name, "url": url}))


def sqs_list(a):
    # One ListQueues answer holds at most 1,000 queues: page through the rest.
    c = sqs_client()
    urls, page = [], {"QueueNamePrefix": a.prefix, "MaxResults": 1000}
    while True:
        answer = c.list_queues(**page)
        urls += answer.get("QueueUrls", [])
        if not answer.get("NextToken"):
            break
        page["NextToken"] = answer["NextToken"]
    print(json.dumps(sorted(u.rsplit("/", 1)[-1] for u in urls)))


def sqs_send(a):
    c = sqs_client()
    url = c.get_queue_url(QueueName=a.name)["QueueUrl"]
    attrs = {k: {"DataType": "String", "StringValue": v} for k, v in pairs(a.attr).items()}
    # Attributes of their own type, as other SQS clients write them: Number,
    # or a custom label such as String.json.
    for k, typed in pairs(a.typed_attr).items():
        data_type, _, value = typed.partition(":")
        attrs[k] = {"DataType": data_type, "StringValue": value}
    for i in range(a.count):
        c.send_message(QueueUrl=url, MessageBody=a.body.replace("{i}", str(i)), MessageAttributes=attrs)
    print(json.dumps({"sent": a.count}))


def sqs_count(a):
    c = sqs_client()
    url = c.get_queue_url(QueueName=a.name)["QueueUrl"]
    attrs = c.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible", "RedrivePolicy"],
    )["Attributes"]
    print(json.dumps(attrs))


def sqs_receive(a):
    c = sqs_client()
    url = c.get_queue_url(QueueName=a.name)["QueueUrl"]
    out = []
    deadline = time.time() + a.timeout
    while len(out) < a.count and time.time() < deadline:
        r = c.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1, MessageAttributeNames=["All"])
        for m in r.get("Messages", []):
            attrs = m.get("MessageAttributes", {})
            out.append({
                "body": m["Body"],
                "attributes": {k: v.get("StringValue") for k, v in attrs.items()},
                # What another reader sees: each attribute's type, and Binary values as hex.
                "types": {k: v.get("DataType") for k, v in attrs.items()},
                "binary_hex": {k: v["BinaryValue"].hex() for k, v in attrs.items() if "BinaryValue" in v},
            })
            c.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    for m in out:
        print(json.dumps(m))


# Kafka ----------------------------------------------------------------------


def kafka_topic(a):
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(kafka_conf())
    futures = admin.create_topics([NewTopic(a.name, a.partitions, 1, config=pairs(a.config))])
    for f in futures.values():
        f.result(15)
    print(json.dumps({"topic": a.name}))


def kafka_list(a):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka_conf())
    topics = admin.list_topics(timeout=15).topics
    print(json.dumps(sorted(t for t in topics if t.startswith(a.prefix))))


def kafka_produce(a):
    from confluent_kafka import Producer

    conf = dict(kafka_conf(), **{"compression.type": a.compression, "linger.ms": 20})
    p = Producer(conf)
    errors = []
    headers = list(pairs(a.header).items())
    for i in range(a.count):
        value = a.value.replace("{i}", str(i)).encode()
        if a.value_base64:
            value = base64.b64decode(a.value)
        key = a.key.replace("{i}", str(i)).encode() if a.key else None
        p.produce(a.topic, value, key=key, headers=headers or None, on_delivery=lambda e, m: e and errors.append(str(e)))
    left = p.flush(30)
    if errors or left:
        print(json.dumps({"errors": errors[:3], "left": left}))
        sys.exit(1)
    print(json.dumps({"produced": a.count, "compression": a.compression}))


def kafka_consume(a):
    from confluent_kafka import Consumer

    conf = {"group.id": a.group, "auto.offset.reset": "earliest", "session.timeout.ms": 6000}
    if a.no_commit:
        # Reads from where the group is without moving it: what that group
        # has still to read.
        conf["enable.auto.commit"] = False
    c = Consumer(dict(kafka_conf(), **conf))
    c.subscribe([a.topic])
    out = []
    deadline = time.time() + a.timeout
    while len(out) < a.count and time.time() < deadline:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        out.append(
            {
                "key": (m.key() or b"").decode("utf-8", "replace"),
                "value": (m.value() or b"").decode("utf-8", "replace"),
                "value_base64": base64.b64encode(m.value() or b"").decode("ascii"),
                "headers": {k: (v or b"").decode("utf-8", "replace") for k, v in (m.headers() or [])},
            }
        )
    c.close()
    for m in out:
        print(json.dumps(m))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("rabbit-queue")
    s.add_argument("name")
    s.add_argument("--arg", action="append", help="queue argument k=v (numbers become integers)")
    s.add_argument("--dead-letter-exchange")
    s.add_argument("--dlq")
    s.set_defaults(fn=rabbit_queue)

    s = sub.add_parser("rabbit-exchange")
    s.add_argument("name")
    s.add_argument("--type", default="direct")
    s.add_argument("--bind", action="append", help="QUEUE[:ROUTING_KEY]")
    s.set_defaults(fn=rabbit_exchange)

    s = sub.add_parser("rabbit-exists")
    s.add_argument("name")
    s.add_argument("--exchange", action="store_true")
    s.set_defaults(fn=rabbit_exists)

    s = sub.add_parser("rabbit-delete")
    s.add_argument("names", nargs="+")
    s.add_argument("--exchange", action="store_true")
    s.set_defaults(fn=rabbit_delete)

    s = sub.add_parser("rabbit-publish")
    s.add_argument("--exchange", default="")
    s.add_argument("--routing-key", required=True)
    s.add_argument("--body", required=True)
    s.add_argument("--content-type")
    s.add_argument("--message-id")
    s.add_argument("--header", action="append")
    s.add_argument("--header-hex", action="append", help="NAME_IN_HEX=VALUE (any bytes as the name)")
    s.add_argument("--message-id-hex", help="message id as hex bytes")
    s.add_argument("--header-json", action="append", help="NAME=JSON (a typed value: number, boolean, object, array, null)")
    s.add_argument("--count", type=int, default=1)
    s.set_defaults(fn=rabbit_publish)

    s = sub.add_parser("rabbit-get")
    s.add_argument("name")
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--timeout", type=float, default=10)
    s.set_defaults(fn=rabbit_get)

    s = sub.add_parser("sqs-queue")
    s.add_argument("name")
    s.add_argument("--dlq")
    s.add_argument("--max-receive", type=int, default=5)
    s.add_argument("--attr", action="append")
    s.set_defaults(fn=sqs_queue)

    s = sub.add_parser("sqs-list")
    s.add_argument("--prefix", default="")
    s.set_defaults(fn=sqs_list)

    s = sub.add_parser("sqs-send")
    s.add_argument("name")
    s.add_argument("--body", required=True)
    s.add_argument("--attr", action="append")
    s.add_argument("--typed-attr", action="append", help="NAME=TYPE:VALUE (Number, String.json, ...)")
    s.add_argument("--count", type=int, default=1)
    s.set_defaults(fn=sqs_send)

    s = sub.add_parser("sqs-count")
    s.add_argument("name")
    s.set_defaults(fn=sqs_count)

    s = sub.add_parser("sqs-receive")
    s.add_argument("name")
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--timeout", type=float, default=10)
    s.set_defaults(fn=sqs_receive)

    s = sub.add_parser("kafka-topic")
    s.add_argument("name")
    s.add_argument("--partitions", type=int, default=1)
    s.add_argument("--config", action="append")
    s.set_defaults(fn=kafka_topic)

    s = sub.add_parser("kafka-list")
    s.add_argument("--prefix", default="")
    s.set_defaults(fn=kafka_list)

    s = sub.add_parser("kafka-produce")
    s.add_argument("topic")
    s.add_argument("--value", required=True)
    s.add_argument("--value-base64", action="store_true")
    s.add_argument("--key")
    s.add_argument("--header", action="append")
    s.add_argument("--compression", default="none")
    s.add_argument("--count", type=int, default=1)
    s.set_defaults(fn=kafka_produce)

    s = sub.add_parser("kafka-consume")
    s.add_argument("topic")
    s.add_argument("--group", default="independent-reader")
    s.add_argument("--count", type=int, default=1)
    s.add_argument("--timeout", type=float, default=30)
    s.add_argument("--no-commit", action="store_true")
    s.set_defaults(fn=kafka_consume)

    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
