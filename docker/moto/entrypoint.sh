#!/bin/sh
# moto's server on 127.0.0.1:$SQS_PORT (host networking: the test picks the port).
set -eu
: "${SQS_PORT:=4566}"
exec /opt/moto/bin/moto_server -H 127.0.0.1 -p "$SQS_PORT"
