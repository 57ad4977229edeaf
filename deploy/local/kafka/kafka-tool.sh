#!/bin/bash
# /opt/kafka/bin/<tool>.sh: the Kafka command of that name (the official scripts' classes), on the
# image's jars. Tools get a small heap and log warnings only, as the official tools do.
set -euo pipefail
case "$(basename "$0" .sh)" in
    kafka-storage) class=kafka.tools.StorageTool ;;
    kafka-topics) class=org.apache.kafka.tools.TopicCommand ;;
    kafka-broker-api-versions) class=org.apache.kafka.tools.BrokerApiVersionsCommand ;;
    kafka-transactions) class=org.apache.kafka.tools.TransactionsCommand ;;
    kafka-console-consumer) class=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
    kafka-console-producer) class=org.apache.kafka.tools.ConsoleProducer ;;
    kafka-metadata-quorum) class=org.apache.kafka.tools.MetadataQuorumCommand ;;
    kafka-consumer-groups) class=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
    *) echo "kafka-tool.sh: no Kafka command is named $(basename "$0")" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # the options are word lists, as in Kafka's own scripts
exec java -Xmx256M -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Djava.awt.headless=true \
    -Dorg.slf4j.simpleLogger.defaultLogLevel=warn ${KAFKA_OPTS:-} -cp '/opt/kafka/libs/*' "$class" "$@"
