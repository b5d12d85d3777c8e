#!/usr/bin/env bash
# Real PostgreSQL and Redis for the integration tier, private to this checkout.
#
#   scripts/services.sh start   install (Debian packages, idempotent) and start both
#   scripts/services.sh stop    stop both (data stays in the state dir)
#   scripts/services.sh status  say what is running
#   scripts/services.sh env     print `export LORAPLANE_TEST_PG_URL=...` and `export
#                               LORAPLANE_TEST_REDIS_URL=...` (eval "$(scripts/services.sh env)")
#   scripts/services.sh install only install the packages (postgresql, redis-server, prometheus)
#
# State lives in ${LORAPLANE_SERVICES_DIR:-$HOME/.cache/loraplane/services}: pg/ (the cluster,
# owned by the `postgres` user, since CI runs as root and postgres refuses to), redis/.
# Ports are fixed and loopback-only: PostgreSQL 127.0.0.1:${LORAPLANE_PG_PORT:-55432},
# Redis 127.0.0.1:${LORAPLANE_REDIS_PORT:-56379}. Database `loraplane`, user `loraplane`,
# password `loraplane`. Prometheus is only installed here; starting it is another script's job.
# As root, the state dir's parents get o+x so the `postgres` user can reach its data dir, and
# package installs run under a policy-rc.d that keeps the system-wide daemons from starting.
set -euo pipefail

STATE_DIR="${LORAPLANE_SERVICES_DIR:-$HOME/.cache/loraplane/services}"
PG_PORT="${LORAPLANE_PG_PORT:-55432}"
REDIS_PORT="${LORAPLANE_REDIS_PORT:-56379}"
PG_DIR="$STATE_DIR/pg"
PG_DATA="$PG_DIR/data"
PG_LOG="$PG_DIR/postgres.log"
REDIS_DIR="$STATE_DIR/redis"
REDIS_PID="$REDIS_DIR/redis.pid"
DB_NAME=loraplane
DB_USER=loraplane
DB_PASSWORD=loraplane

log() { printf 'services: %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

pg_bindir() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    [ -x "$dir/pg_ctl" ] && { echo "$dir"; return 0; }
  done
  command -v pg_ctl >/dev/null 2>&1 && { dirname "$(command -v pg_ctl)"; return 0; }
  return 1
}

install_packages() {
  local missing=()
  pg_bindir >/dev/null 2>&1 || missing+=(postgresql)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Do not let the packages' own init scripts start system-wide daemons on default ports.
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod +x "$policy"
    created_policy=1
  fi
  if ! as_root apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; then
    as_root apt-get update >/dev/null
    as_root apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ "$created_policy" = 1 ]; then as_root rm -f "$policy"; fi
}

run_as_postgres() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

pg_running() {
  local bin
  bin="$(pg_bindir)" || return 1
  [ -f "$PG_DATA/PG_VERSION" ] && run_as_postgres "$bin/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1
}

start_postgres() {
  local bin
  bin="$(pg_bindir)"
  mkdir -p "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then
    chown -R postgres:postgres "$PG_DIR"
    # postgres must be able to traverse to its data dir
    local parent="$PG_DIR"
    while [ "$parent" != / ]; do
      parent="$(dirname "$parent")"
      chmod o+x "$parent" 2>/dev/null || true
    done
  fi
  if [ ! -f "$PG_DATA/PG_VERSION" ]; then
    log "initdb $PG_DATA"
    run_as_postgres "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >/dev/null \
      || run_as_postgres "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 >/dev/null
  fi
  if pg_running; then
    log "postgresql already running on 127.0.0.1:$PG_PORT"
  else
    log "starting postgresql on 127.0.0.1:$PG_PORT"
    run_as_postgres "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $PG_DIR -c max_connections=200 -c fsync=off" start >/dev/null
  fi
  local psql=("$bin/psql" -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA)
  if [ "$(run_as_postgres "${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname='$DB_USER'")" != 1 ]; then
    run_as_postgres "${psql[@]}" -c "CREATE ROLE $DB_USER LOGIN PASSWORD '$DB_PASSWORD' CREATEDB"
  fi
  if [ "$(run_as_postgres "${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname='$DB_NAME'")" != 1 ]; then
    run_as_postgres "${psql[@]}" -c "CREATE DATABASE $DB_NAME OWNER $DB_USER"
  fi
}

stop_postgres() {
  local bin
  bin="$(pg_bindir)" || return 0
  if pg_running; then
    log "stopping postgresql"
    run_as_postgres "$bin/pg_ctl" -D "$PG_DATA" -m fast -w stop >/dev/null
  fi
}

redis_running() {
  [ -f "$REDIS_PID" ] && kill -0 "$(cat "$REDIS_PID")" 2>/dev/null
}

start_redis() {
  mkdir -p "$REDIS_DIR"
  if redis_running; then
    log "redis already running on 127.0.0.1:$REDIS_PORT"
    return 0
  fi
  log "starting redis on 127.0.0.1:$REDIS_PORT"
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes --pidfile "$REDIS_PID" \
    --dir "$REDIS_DIR" --logfile "$REDIS_DIR/redis.log" --save '' --appendonly no
  local i
  for i in $(seq 1 50); do
    if redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then return 0; fi
    sleep 0.1
  done
  log "redis did not answer PING; see $REDIS_DIR/redis.log"
  return 1
}

stop_redis() {
  if redis_running; then
    log "stopping redis"
    local pid
    pid="$(cat "$REDIS_PID")"
    kill "$pid"
    local i
    for i in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    rm -f "$REDIS_PID"
  fi
}

print_env() {
  echo "export LORAPLANE_TEST_PG_URL=postgresql+psycopg://$DB_USER:$DB_PASSWORD@127.0.0.1:$PG_PORT/$DB_NAME"
  echo "export LORAPLANE_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
}

case "${1:-}" in
  install) install_packages ;;
  start)
    install_packages
    start_postgres
    start_redis
    print_env
    ;;
  stop)
    stop_redis
    stop_postgres
    ;;
  status)
    if pg_running; then echo "postgresql: running on 127.0.0.1:$PG_PORT"; else echo "postgresql: stopped"; fi
    if redis_running; then echo "redis: running on 127.0.0.1:$REDIS_PORT"; else echo "redis: stopped"; fi
    ;;
  env) print_env ;;
  *)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
