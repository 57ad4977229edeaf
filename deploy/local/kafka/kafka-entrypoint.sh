#!/bin/bash
# The broker's start, as the official apache/kafka image does it: every KAFKA_* variable but the
# JVM options becomes a server.properties line (strip KAFKA_, lower case, "___" -> "-",
# "__" -> "_", "_" -> "."), the storage is formatted with CLUSTER_ID unless it already is, then
# kafka.Kafka runs in the foreground. Data lives in /tmp/kraft-combined-logs unless KAFKA_LOG_DIRS.
set -euo pipefail
config=/opt/kafka/config/server.properties
: "${CLUSTER_ID:?CLUSTER_ID must be set (the KRaft cluster id the storage is formatted with)}"
jvm_options=" KAFKA_VERSION KAFKA_HEAP_OPTS KAFKA_LOG4J_OPTS KAFKA_OPTS KAFKA_JMX_OPTS KAFKA_JVM_PERFORMANCE_OPTS
 KAFKA_GC_LOG_OPTS KAFKA_LOG4J_ROOT_LOGLEVEL KAFKA_LOG4J_LOGGERS KAFKA_TOOLS_LOG4J_LOGLEVEL KAFKA_JMX_HOSTNAME KAFKA_JMX_PORT "
{
    echo "log.dirs=/tmp/kraft-combined-logs"
    for var in $(compgen -e); do
        [[ $var == KAFKA_* && $jvm_options != *" $var "* ]] || continue
        name=${var#KAFKA_}; name=${name,,}
        name=${name//___/-}; name=${name//__/@}; name=${name//_/.}; name=${name//@/_}
        printf '%s=%s\n' "$name" "${!var}"
    done
} > "$config"
java -Xmx256M -XX:TieredStopAtLevel=1 -Dorg.slf4j.simpleLogger.defaultLogLevel=warn -cp '/opt/kafka/libs/*' \
    kafka.tools.StorageTool format --ignore-formatted -t "$CLUSTER_ID" -c "$config"
# shellcheck disable=SC2086  # word lists, as in Kafka's own kafka-run-class.sh
exec java ${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G} \
    ${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true} \
    ${KAFKA_OPTS:-} -cp '/opt/kafka/libs/*' kafka.Kafka "$config"
