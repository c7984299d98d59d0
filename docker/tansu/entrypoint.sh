#!/bin/sh
# tansu on 127.0.0.1:$KAFKA_PORT (host networking: the test picks the port),
# records in memory.
set -eu
: "${KAFKA_PORT:=9092}"
echo "tansu: listening on 127.0.0.1:${KAFKA_PORT}"
exec tansu broker --listener-url "tcp://127.0.0.1:${KAFKA_PORT}" \
  --advertised-listener-url "tcp://127.0.0.1:${KAFKA_PORT}" \
  --storage-engine memory://tansu/
