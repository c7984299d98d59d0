#!/bin/sh
# RabbitMQ on the ports the test gives it. With host networking there is no
# port mapping: each container listens on free loopback ports of its own and
# needs its own node name, epmd port and distribution port, or two of them
# (or one beside the machine's own RabbitMQ) would meet in one epmd.
set -eu
: "${AMQP_PORT:=5672}"
: "${DIST_PORT:=$((AMQP_PORT + 20000))}"
: "${EPMD_PORT:=$((AMQP_PORT + 10000))}"
export RABBITMQ_NODENAME="rabbit-${AMQP_PORT}@localhost"
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT="$AMQP_PORT"
export RABBITMQ_DIST_PORT="$DIST_PORT"
export ERL_EPMD_PORT="$EPMD_PORT"
export ERL_EPMD_ADDRESS=127.0.0.1
# Distribution on loopback too (it listens on every interface by default).
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
export RABBITMQ_MNESIA_BASE=/tmp/rabbitmq/mnesia
export RABBITMQ_LOG_BASE=/tmp/rabbitmq/log
export RABBITMQ_LOGS=-
export HOME=/tmp/rabbitmq
mkdir -p "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
# The Erlang cookie of this container alone.
if [ ! -f "$HOME/.erlang.cookie" ]; then
  head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$HOME/.erlang.cookie"
  chmod 400 "$HOME/.erlang.cookie"
fi
# The upstream script, not Debian's wrapper, which sends the log to a file.
exec /usr/lib/rabbitmq/bin/rabbitmq-server
