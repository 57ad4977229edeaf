#!/bin/bash
# First start: initdb with POSTGRES_USER as the superuser and POSTGRES_PASSWORD as its password,
# host connections with scram-sha-256, listening on every address, then POSTGRES_DB created (in
# single-user mode, so nothing listens before it exists). Every start: run the command as the
# postgres user. The official image's documented behaviour, for the variables the compose files set.
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown -R postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
if [ "${1:0:1}" = "-" ]; then set -- postgres "$@"; fi
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set (the superuser password)}"
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    initdb --username="$user" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") -D "$PGDATA" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 >/dev/null
    printf '\nhost all all all scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
    printf "\nlisten_addresses = '*'\n" >> "$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then
        q='"'; qq='""'  # identifiers quoted, a quote in them doubled
        printf 'CREATE DATABASE "%s" OWNER "%s";\n' "${db//$q/$qq}" "${user//$q/$qq}" \
            | postgres --single -D "$PGDATA" -j postgres >/dev/null
    fi
    echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
exec "$@"
